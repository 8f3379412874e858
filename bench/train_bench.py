"""RL step time on the GPU: ours with TLT (adaptive SD + online EAGLE drafter) vs ours with SD off vs TRL
GRPOTrainer, on SmolLM2-135M-Instruct + GSM8K, printed as ONE markdown table.

    PYTHONPATH=. python bench/train_bench.py --out bench/results/train_h200.md             # ~4 min on an H200
    PYTHONPATH=. python bench/train_bench.py --peers-json peers.json --out ...            # + TRL's step time
    PYTHONPATH=. python bench/train_bench.py --model tiny --quick --out /tmp/t.md         # CPU smoke run (seconds)

Settings (issue 6): 8 prompts x 8 samples, <= 1024 new tokens, T=1.0, top-k 50 (HF generate's default sampling,
which TRL's generation uses), bf16 weights with fp32 master weights, AdamW lr 1e-6, the `h200-gsm8k` preset; plus
a long-tail setting, same prompts with <= 4096 new tokens (`--long-tail-max-new`), where SmolLM2 at T=1.0 leaves a
few responses running to the cap long after the rest finished: the memory-bound tail TLT targets. Each mode runs
`--steps` RL steps from the same seed and data (same prompts every step in both modes; samples differ, as SD
consumes the RNG differently); the table quotes the mean of the steps after the first (the first includes CUDA
graph capture), split into rollout (timing_s/gen, incl. spot training run inside the tail), reward (what is left
after the rollout), update, drafter (spot training after the update). TRL's figure is the mean of its
step_time_s after the first, read from `../shared/peers/hf_trl_peers.py --what grpo` output (its `trl_grpo`
section), by default from peers.json next to --out when there is one.
Modes: `tlt` = rollout.speculative adaptive (SD on below --sd-on-below active sequences, n-gram cold start + the
EAGLE-1 drafter trained online), drafter spot training capped at --drafter-steps per RL step (the `h200-gsm8k-tlt`
preset); `off` = speculative off, no drafter (`h200-gsm8k-sd-off`). Outputs are rewritten after every run, so a
run cut short still leaves its finished rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from worker.tlt.bench import BenchReporter, fmt, ratio, run_trainer_steps
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.spec_file import merge_spec

QUOTED = ("timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/drafter",
          "timing_s/reward_work", "perf/tail_hook_s", "perf/tokens_per_s", "response_length/mean",
          "response_length/max", "response_length/clip_ratio", "sd/on_fraction", "sd/accept_len", "reward/mean",
          "drafter/steps")
MODE_PRESETS = {"tlt": "h200-gsm8k-tlt", "off": "h200-gsm8k-sd-off"}


def bench_spec(a: argparse.Namespace, mode: str, max_new: int) -> JobSpec:
    """The mode's preset with the bench's sizes; the tiny CPU variant swaps model, data and device."""
    over: dict[str, Any] = {
        "algorithm": {"prompts_per_step": a.prompts, "num_generations": a.samples, "max_completion_length": max_new,
                      "temperature": a.temperature, "top_k": a.top_k},
        "rollout": {"sd_on_below": a.sd_on_below, "kv_cache_gb": a.kv_cache_gb},
        "drafter": {"max_train_steps_per_rl_step": a.drafter_steps},
        "max_steps": a.steps, "seed": a.seed,
    }
    if mode == "off":
        del over["drafter"]
    if a.drafter_warm_start and mode == "tlt":
        over["drafter"]["warm_start"] = a.drafter_warm_start
    if a.model == "tiny":
        over["model"] = {"builtin": "tiny-llama", "dtype": "bfloat16"}
        over["dataset"] = {"builtin": "toy-count", "validation_size": 0, "system_prompt": None}
        over["algorithm"]["reward_funcs"] = ["toy_count"]
        over["resources"] = {"gpus": 0}
        over["rollout"]["cuda_graphs"] = False
    else:
        over["dataset"] = {"validation_size": 0}
    return JobSpec.model_validate(merge_spec(PRESETS[MODE_PRESETS[mode]], over))


def run_mode(a: argparse.Namespace, mode: str, max_new: int) -> dict[str, Any]:
    """`--steps` RL steps of one mode; per-step metrics and the mean of the quoted (after-the-first) steps."""
    spec = bench_spec(a, mode, max_new)
    steps: list[dict[str, float]] = []

    def record(step: int, metrics: dict[str, float]) -> None:
        steps.append({k: float(metrics[k]) for k in QUOTED if k in metrics})
        print(f"{mode} <= {max_new} new, step {step}: {json.dumps(steps[-1])}", flush=True)

    build_s = run_trainer_steps(spec, BenchReporter(), record)
    quoted = steps[1:] if len(steps) > 1 else steps
    mean = {k: statistics.fmean(s[k] for s in quoted) for k in quoted[0] if all(k in s for s in quoted)}
    return {"mode": mode, "max_new_tokens": max_new, "build_s": build_s, "steps": steps, "quoted_steps": len(quoted),
            "mean": mean, "spec": spec.model_dump(mode="json")}


def trl_step_s(peers_json: Path | None) -> tuple[float | None, list[float]]:
    """Mean TRL step time after the first step (and all of them) from hf_trl_peers.py's output, if given."""
    if peers_json is None or not peers_json.is_file():
        return None, []
    data = json.loads(peers_json.read_text())
    section = data.get("trl_grpo") or data.get("grpo") or {}
    times = [float(t) for t in section.get("step_time_s", []) if t is not None]
    if not times:
        return None, []
    quoted = times[1:] if len(times) > 1 else times
    return statistics.fmean(quoted), times


def render(res: dict[str, Any]) -> str:
    a = res["args"]
    trl = res.get("trl_step_s")
    lines = [
        f"RL step time, ours (TLT / SD off) vs TRL GRPOTrainer — {res['device']}, torch {res['torch']}, "
        f"{res['model']}, {a['prompts']} prompts x {a['samples']} samples, T={a['temperature']}, top-k {a['top_k']}",
        "",
        "| setting | mode | step s | rollout s | reward s | update s | drafter s | tokens/s (rollout) "
        "| len mean / max (clip) | SD on / accept len | TRL / ours | SD off / TLT |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, runs in res["settings"].items():
        off = runs.get("off", {}).get("mean", {}).get("timing_s/step")
        for mode, r in runs.items():
            m = r["mean"]
            step = m.get("timing_s/step")
            vs_trl = ratio(trl, step) if setting == "main" else "—"
            vs_off = ratio(off, step) if mode == "tlt" else "—"
            lines.append(
                f"| {setting}: <= {r['max_new_tokens']} new | {mode} ({r['quoted_steps']} steps) | {fmt(step)} "
                f"| {fmt(m.get('timing_s/gen'))} | {fmt(m.get('timing_s/reward'), 3)} | {fmt(m.get('timing_s/update'))} "
                f"| {fmt(m.get('timing_s/drafter'))} | {fmt(m.get('perf/tokens_per_s'))} "
                f"| {fmt(m.get('response_length/mean'), 0)} / {fmt(m.get('response_length/max'), 0)} "
                f"({fmt(m.get('response_length/clip_ratio'))}) "
                f"| {fmt(m.get('sd/on_fraction'))} / {fmt(m.get('sd/accept_len'))} | {vs_trl} | {vs_off} |")
    if trl is not None:
        lines.append(f"| main: <= {a['max_new_tokens']} new | TRL GRPOTrainer | {fmt(trl)} | — | — | — | — | — | — | — "
                     f"| 1.00x | — |")
    notes = [
        "step s = mean of the steps after the first (the first includes CUDA graph capture); rollout includes the "
        "drafter's spot training inside the tail (perf/tail_hook_s); reward = scoring left after the rollout "
        "(the rest overlapped the tail); drafter = spot training after the update",
        "ratios: TRL / ours and SD off / TLT are step-time ratios (> 1 = ours / TLT faster); both modes see the same "
        "prompts, but their samples (and so their lengths) differ: compare tokens/s too",
        *res["notes"],
    ]
    if trl is not None:
        notes.append(f"TRL step_time_s per step: {', '.join(fmt(t) for t in res['trl_steps_s'])} "
                     f"(from {res['peers_json']})")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + [""])


def write(res: dict[str, Any], out: Path, json_out: Path) -> str:
    if res["trl_step_s"] is None:  # the peer may run alongside on another GPU: pick its figure up once it lands
        peers = Path(res["peers_candidate"])
        res["trl_step_s"], res["trl_steps_s"] = trl_step_s(peers)
        res["peers_json"] = str(peers) if res["trl_step_s"] is not None else None
    table = render(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    json_out.write_text(json.dumps(res, indent=1))
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                    help="tiny: the random tiny Llama on the toy task, on CPU (smoke runs)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes: 2 prompts x 4 samples, 8 / 16 new, 2 steps, SD on from the start, 1 drafter step")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--long-tail-max-new", type=int, default=4096, help="0 = skip the long-tail setting")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per mode (the first is not quoted)")
    ap.add_argument("--modes", default="off,tlt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50, help="0 = full vocabulary; 50 = HF generate's default")
    ap.add_argument("--sd-on-below", type=int, default=32, help="tlt: SD on below this many active sequences")
    ap.add_argument("--drafter-steps", type=int, default=None,
                    help="tlt: drafter spot-training steps per RL step (default: the preset's)")
    ap.add_argument("--drafter-warm-start", default=None, help="tlt: an exported drafter directory to start from")
    ap.add_argument("--kv-cache-gb", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers-json", default=None, help="default: peers.json next to --out, when present")
    ap.add_argument("--out", default="bench/results/train_h200.md")
    ap.add_argument("--json-out", default=None, help="default: --out with .json")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite --out from its JSON (e.g. once the peers' peers.json exists); no runs")
    a = ap.parse_args(argv)
    if a.render_only:
        json_path = Path(a.json_out) if a.json_out else Path(a.out).with_suffix(".json")
        sys.stdout.write(write(json.loads(json_path.read_text()), Path(a.out), json_path))
        return 0
    if a.quick:
        a.prompts, a.samples, a.max_new_tokens, a.long_tail_max_new, a.steps = 2, 4, 8, 16, 2
        a.sd_on_below = a.prompts * a.samples + 1  # the tiny run has no tail: switch SD on after the patience
        a.drafter_steps = 1 if a.drafter_steps is None else a.drafter_steps
    if a.drafter_steps is None:
        a.drafter_steps = PRESETS[MODE_PRESETS["tlt"]]["drafter"]["max_train_steps_per_rl_step"]
    if a.model == "smollm2" and not torch.cuda.is_available():
        raise SystemExit("train_bench.py needs a CUDA GPU for SmolLM2 (use --model tiny --quick on CPU)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(a.out)
    json_out = Path(a.json_out) if a.json_out else out.with_suffix(".json")
    peers = Path(a.peers_json) if a.peers_json else out.parent / "peers.json"
    trl, trl_steps = trl_step_s(peers)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if a.model == "smollm2" else "cpu", "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct bf16 (fp32 master weights)" if a.model == "smollm2" else "tiny-llama (CPU)",
        "args": vars(a), "settings": {}, "trl_step_s": trl, "trl_steps_s": trl_steps,
        "peers_json": str(peers) if trl is not None else None, "peers_candidate": str(peers), "notes": [],
    }
    settings = {"main": a.max_new_tokens}
    if a.long_tail_max_new:
        settings["long-tail"] = a.long_tail_max_new
    for setting, max_new in settings.items():
        for mode in a.modes.split(","):
            res["settings"].setdefault(setting, {})[mode] = run_mode(a, mode, max_new)
            table = write(res, out, json_out)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
