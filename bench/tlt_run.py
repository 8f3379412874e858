"""A whole GRPO run, SD off vs TLT, as the paper judges TLT: the same job on GSM8K (same seed, same prompts every
step) stepped in lock-step, one step of each mode in turn, so a time budget ends both at the same step count.

    PYTHONPATH=. python bench/tlt_run.py --steps 100 --lr 5e-6 --out bench/results/tlt_run_h200.md   # H200
    PYTHONPATH=. python bench/tlt_run.py --model tiny --quick --out /tmp/t.md                         # CPU, seconds

Modes: `off` = the `h200-gsm8k-sd-off` preset; `tlt` = `h200-gsm8k-tlt` (adaptive SD switched by measured step
costs, n-gram cold start + the EAGLE-1 drafter spot-trained in the tail). Per step and cumulatively: step, rollout
and tail seconds, entropy, reward, response length, drafter top-1 accuracy, accept length, share of decode steps
that drafted. Whole-run ratios SD off / TLT: at equal step count (summed step seconds) and at equal work (rollout
seconds per generated token). When the two runs' mean response lengths differ by more than --divergence (25%), the
runs did different work (one policy drifted, e.g. to the length cap): the step-count ratio is then flagged as not a
TLT figure. Paired rollouts every --pair-every steps: the TLT run's current policy decodes the next step's prompts
with SD off and with TLT's controller (same RNG state, no spot training, no hidden-state capture, untimed warm-up
before each), a per-step rollout ratio free of the two runs' drift. The pairs restore the engine's RNG, so they do
not change the run's samples; the bandit and step costs do see their steps.
`--save-dir DIR` exports the TLT run's final policy (DIR/policy, HF) and drafter (DIR/drafter, EAGLE-1).
`--time-budget-s` stops both runs after the step at which the elapsed time passes it (same step count).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from worker.tlt import metric_catalog as mc
from worker.tlt.bench import BenchReporter, fmt, tiny_model_overrides, warm_up
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.job_spec_file import merge_spec
from worker.tlt.job_spec_translate import controller, request_sampling
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.rollout.types import GenerationOutput, Request
from worker.tlt.sd_savings import SdSavings

MODES = {"off": "h200-gsm8k-sd-off", "tlt": "h200-gsm8k-tlt"}
KEPT = ("timing_s/step", "timing_s/gen", "timing_s/update", "timing_s/drafter", mc.TAIL_S, mc.TAIL_SD_S,
        "actor/entropy", "reward/mean", "response_length/mean", "response_length/clip_ratio", mc.DRAFTER_ACC,
        mc.SD_ACCEPT_LEN, mc.SD_ON_FRACTION, mc.SD_SPEC_STEP_FRACTION, mc.SEQ_TOKENS_PER_S_TAIL_SD,
        mc.SEQ_TOKENS_PER_S_TAIL_PLAIN, mc.SD_SAVED_S)


def run_spec(a: argparse.Namespace, mode: str) -> JobSpec:
    """The mode's preset at the run's sizes; --model tiny swaps in the tiny random Llama on the toy task (CPU)."""
    over: dict[str, Any] = {
        "algorithm": {"prompts_per_step": a.prompts, "num_generations": a.samples, "max_completion_length": a.max_new,
                      "temperature": 1.0, "top_k": a.top_k, "learning_rate": a.lr},
        "rollout": {"sd_on_below": a.sd_on_below, "kv_cache_gb": a.kv_cache_gb},
        "max_steps": a.steps, "seed": a.seed, "dataset": {"validation_size": 0},
    }
    if a.model == "tiny":
        tiny_model_overrides(over)
    return JobSpec.model_validate(merge_spec(PRESETS[MODES[mode]], over))


def sync(trainer: GRPOTrainer) -> None:
    if torch.device(trainer.device).type == "cuda":
        torch.cuda.synchronize()


def rollout_detail(res: GenerationOutput) -> dict[str, Any]:
    """What a cost model needs of one rollout (bench/tlt_projection.py): the response lengths, prefill seconds, the
    acceptance rate by draft position, and per kind of step and active batch size: steps, seconds, emitted tokens."""
    steps: dict[str, dict[int, list[float]]] = {"decode": {}, "spec": {}}
    for st in res.steps:
        if st.kind != "prefill":
            acc = steps[st.kind].setdefault(st.active, [0, 0.0, 0])
            acc[0] += 1
            acc[1] += st.seconds
            acc[2] += st.emitted
    pos = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in res.sd_metrics.items() if k.startswith("sd/accept_rate_pos_"))
    return {"lengths": sorted(len(s.tokens) for s in res.sequences),
            "prefill_s": sum(st.seconds for st in res.steps if st.kind == "prefill"),
            "accept_rate_pos": [float(v) for _, v in pos], "steps": steps}


def paired_rollout(spec: JobSpec, trainer: GRPOTrainer) -> dict[str, Any]:
    """The next step's prompts decoded by the current policy with SD off and with TLT's controller (see docstring)."""
    engine = trainer.rollout.engine  # type: ignore[attr-defined]
    prompts = copy.deepcopy(trainer.sampler).next_batch(spec.algorithm.prompts_per_step)  # the sampler is untouched
    params = replace(request_sampling(spec), n=spec.algorithm.num_generations)
    reqs = [Request(list(p.ids), params) for p in prompts]
    max_len = max(len(r.prompt) for r in reqs) + params.max_new_tokens
    rng = engine.gen.get_state()
    off = controller(spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"speculative": "off"})}), [])
    engine.restore_memory()  # a no-op unless the update released the cache
    out: dict[str, Any] = {}
    try:
        for name, ctl in (("off", off), ("tlt", engine.controller)):
            warm_up(engine, reqs, max_len)
            engine.gen.set_state(rng)
            sync(trainer)
            t0 = time.perf_counter()
            res = engine.generate(reqs, controller=ctl)  # no hidden-state capture, no tail hook (spot training)
            sync(trainer)
            out[f"{name}_s"] = time.perf_counter() - t0
            out[f"{name}_tokens"] = float(sum(len(s.tokens) for s in res.sequences))
            out[f"{name}_spec_step_fraction"] = float(res.sd_metrics.get(mc.SD_SPEC_STEP_FRACTION, 0.0))
            if mc.SD_ACCEPT_LEN in res.sd_metrics:
                out[f"{name}_accept_len"] = float(res.sd_metrics[mc.SD_ACCEPT_LEN])
            out[f"{name}_detail"] = rollout_detail(res)
    finally:
        engine.gen.set_state(rng)
        if spec.rollout.release_kv_for_update:
            engine.release_memory()
    # rollout seconds per token, off / TLT: > 1 = TLT faster at equal work
    out["ratio"] = (out["off_s"] / out["off_tokens"]) / (out["tlt_s"] / out["tlt_tokens"])
    return out


def save_final(trainer: GRPOTrainer, into: Path) -> dict[str, str]:
    """The TLT run's policy (HF directory) and drafter (EAGLE-1 export) under `into`."""
    from worker.tlt.export.hf import export_policy
    from worker.tlt.speculative.drafter.export import export_drafter

    paths = {"policy": str(export_policy(trainer.model, trainer.tokenizer, into / "policy"))}
    drafter = trainer.rollout.drafter  # type: ignore[attr-defined]
    if drafter is not None:
        paths["drafter"] = str(export_drafter(drafter.train_drafter, into / "drafter"))
    return paths


def run(a: argparse.Namespace, progress: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    """Both modes, step by step in turn (see the module docstring); `progress` gets the result so far every
    --write-every steps (a run cut short by a time limit still leaves its table)."""
    from worker.tlt.build import build_trainer  # the training stack: imported only when a run starts

    specs = {m: run_spec(a, m) for m in MODES}
    trainers = {m: build_trainer(specs[m], BenchReporter())[0] for m in MODES}
    savings = SdSavings()
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    pairs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        for step in range(1, a.steps + 1):
            if a.pair_every and step % a.pair_every == 0:
                pairs.append({"step": float(step), **paired_rollout(specs["tlt"], trainers["tlt"])})
            for mode, trainer in trainers.items():
                sync(trainer)
                metrics, _, _ = trainer.step()
                sync(trainer)
                if mode == "tlt":
                    metrics.update(savings.observe(metrics))
                rows[mode].append({k: float(metrics[k]) for k in KEPT if k in metrics})
            print(f"step {step}: " + json.dumps({m: rows[m][-1] for m in MODES}), flush=True)
            if step % a.write_every == 0:
                progress({"steps": rows, "pairs": pairs, "saved": {}, "sd_saved": savings.summary(),
                          "wall_s": time.perf_counter() - t_start})
            if a.time_budget_s and time.perf_counter() - t_start > a.time_budget_s:
                break
        saved = save_final(trainers["tlt"], Path(a.save_dir)) if a.save_dir else {}
    finally:
        for t in trainers.values():
            t.close()
    return {"steps": rows, "pairs": pairs, "saved": saved, "sd_saved": savings.summary(),
            "wall_s": time.perf_counter() - t_start}


def cumulative(rows: list[dict[str, float]], tokens_per_len: int) -> dict[str, float]:
    """Whole-run sums and means of one mode's steps."""
    def total(k: str) -> float:
        return sum(r.get(k, 0.0) for r in rows)

    tokens = sum(r["response_length/mean"] for r in rows) * tokens_per_len
    last = rows[-max(1, len(rows) // 5):]  # the last 20% of steps: the reward the run reached
    rewards = [r["reward/mean"] for r in last]
    acc = [r[mc.DRAFTER_ACC] for r in rows if mc.DRAFTER_ACC in r]
    return {"steps": len(rows), "step_s": total("timing_s/step"), "gen_s": total("timing_s/gen"),
            "tail_s": total(mc.TAIL_S), "tail_sd_s": total(mc.TAIL_SD_S), "tokens": tokens,
            "gen_s_per_token": total("timing_s/gen") / tokens if tokens else 0.0,
            "len_mean": statistics.fmean(r["response_length/mean"] for r in rows),
            "len_last10": statistics.fmean(r["response_length/mean"] for r in rows[-10:]),
            "clip_last10": statistics.fmean(r.get("response_length/clip_ratio", 0.0) for r in rows[-10:]),
            "reward_last20pct": statistics.fmean(rewards),
            "reward_last20pct_se": statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else 0.0,
            "entropy_first": rows[0].get("actor/entropy", 0.0), "entropy_last": rows[-1].get("actor/entropy", 0.0),
            "drafter_acc_first": acc[0] if acc else 0.0, "drafter_acc_last": acc[-1] if acc else 0.0,
            "spec_step_share": statistics.fmean(r.get(mc.SD_SPEC_STEP_FRACTION, 0.0) for r in rows),
            "sd_saved_s": total(mc.SD_SAVED_S)}


def verdict(res: dict[str, Any], divergence: float) -> dict[str, Any]:
    """The whole run's ratios and what they mean."""
    n = res["args"]["prompts"] * res["args"]["samples"]
    off, tlt = (cumulative(res["steps"][m], n) for m in MODES)
    drift = abs(off["len_mean"] - tlt["len_mean"]) / max(off["len_mean"], tlt["len_mean"], 1e-9)
    pairs = [p["ratio"] for p in res["pairs"]]
    se = (off["reward_last20pct_se"] ** 2 + tlt["reward_last20pct_se"] ** 2) ** 0.5
    return {"off": off, "tlt": tlt, "length_drift": drift, "diverged": drift > divergence,
            "ratio_equal_steps": off["step_s"] / tlt["step_s"] if tlt["step_s"] else None,
            "ratio_equal_work": off["gen_s_per_token"] / tlt["gen_s_per_token"] if tlt["gen_s_per_token"] else None,
            "equal_reward": abs(off["reward_last20pct"] - tlt["reward_last20pct"]) <= se,
            "paired_mean": statistics.fmean(pairs) if pairs else None,
            "paired_min": min(pairs, default=None), "paired_max": max(pairs, default=None)}


def render(res: dict[str, Any]) -> str:
    a, v = res["args"], res["verdict"]
    off, tlt = v["off"], v["tlt"]
    lines = [
        f"Whole GRPO run, SD off vs TLT — {res['device']}, {res['model']}, GSM8K, {a['prompts']} prompts x "
        f"{a['samples']} samples, <= {a['max_new']} new, T=1.0, top-k {a['top_k']}, lr {a['lr']:g}, seed {a['seed']}, "
        f"{off['steps']} steps each (lock-step)",
        "",
        "| mode | steps | run s (sum of steps) | rollout s | tail s (SD steps) | s / 1k tokens (rollout) | len mean / last 10 "
        "(clip) | reward last 20% ± SE | entropy first → last | drafter acc first → last | SD drafted (steps) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, c in (("SD off", off), ("TLT", tlt)):
        lines.append(
            f"| {mode} | {c['steps']} | {fmt(c['step_s'])} | {fmt(c['gen_s'])} | {fmt(c['tail_s'])} ({fmt(c['tail_sd_s'])}) "
            f"| {fmt(1000 * c['gen_s_per_token'], 3)} | {fmt(c['len_mean'], 0)} / {fmt(c['len_last10'], 0)} "
            f"({fmt(c['clip_last10'])}) | {c['reward_last20pct']:.3f} ± {c['reward_last20pct_se']:.3f} "
            f"| {fmt(c['entropy_first'], 3)} → {fmt(c['entropy_last'], 3)} "
            f"| {fmt(c['drafter_acc_first'])} → {fmt(c['drafter_acc_last'])} | {fmt(100 * c['spec_step_share'], 1)}% |")
    eq = "" if not v["diverged"] else " — NOT a TLT figure: the runs diverged (see below)"
    pm = v["paired_mean"]
    lines += [
        "",
        f"- whole run, SD off / TLT at equal step count: **{fmt(v['ratio_equal_steps'])}x**{eq}",
        f"- at equal work (rollout seconds per generated token): **{fmt(v['ratio_equal_work'])}x**",
        f"- paired rollouts (same policy and prompts, SD off vs TLT, every {a['pair_every']} steps): "
        + (f"mean **{pm:.2f}x** ({v['paired_min']:.2f}-{v['paired_max']:.2f}x, {len(res['pairs'])} pairs)"
           if pm is not None else "none"),
        f"- mean response length differs by {100 * v['length_drift']:.0f}% between the runs "
        f"({'DIVERGED: > ' if v['diverged'] else 'within '}{100 * a['divergence']:.0f}%)",
        f"- reward over the last 20% of steps {'within' if v['equal_reward'] else 'NOT within'} one standard error "
        "(equal reward)",
        f"- TLT job summary: {res['sd_saved']}",
        "- ratios > 1 = TLT faster. The equal-step ratio is the paper's whole-run figure only when both runs did the "
        "same work (no divergence); the equal-work ratio prices the rollout per generated token; the paired ratio is "
        "the per-step rollout speed-up at the TLT run's policy and drafter, free of drift between the runs.",
        "",
        "| step | off step s | TLT step s | off len | TLT len | off reward | TLT reward | TLT entropy | drafter acc "
        "| accept len | SD drafted | paired off/TLT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    paired = {int(p["step"]): p["ratio"] for p in res["pairs"]}
    n = len(res["steps"]["tlt"])
    shown = sorted(set(range(0, n, max(1, n // 20))) | {n - 1} | {s - 1 for s in paired})
    for i in shown:
        o, t = res["steps"]["off"][i], res["steps"]["tlt"][i]
        lines.append(
            f"| {i + 1} | {fmt(o.get('timing_s/step'))} | {fmt(t.get('timing_s/step'))} "
            f"| {fmt(o.get('response_length/mean'), 0)} | {fmt(t.get('response_length/mean'), 0)} "
            f"| {fmt(o.get('reward/mean'), 3)} | {fmt(t.get('reward/mean'), 3)} | {fmt(t.get('actor/entropy'), 3)} "
            f"| {fmt(t.get(mc.DRAFTER_ACC))} | {fmt(t.get(mc.SD_ACCEPT_LEN))} "
            f"| {fmt(100 * t.get(mc.SD_SPEC_STEP_FRACTION, 0.0), 1)}% "
            f"| {fmt(paired[i + 1]) + 'x' if i + 1 in paired else '—'} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: 2 prompts x 4 samples, 8 new, 4 steps")
    ap.add_argument("--steps", type=int, default=100, help="RL steps per mode")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--sd-on-below", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=16.0, help="per mode (both trainers live at once)")
    ap.add_argument("--pair-every", type=int, default=10, help="paired rollouts every K steps; 0 = none")
    ap.add_argument("--divergence", type=float, default=0.25, help="mean-length gap that flags diverged runs")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="stop both after this many seconds; 0 = none")
    ap.add_argument("--write-every", type=int, default=10, help="rewrite --out every N steps")
    ap.add_argument("--save-dir", default=None, help="export the TLT run's final policy + drafter here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/tlt_run_h200.md")
    ap.add_argument("--json-out", default=None, help="default: --out with .json")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.samples, a.max_new, a.steps, a.pair_every, a.write_every = 2, 4, 8, 4, 2, 2
        a.sd_on_below = a.prompts * a.samples + 1  # the tiny run has no tail: SD considered from the start
    if a.model == "smollm2" and not torch.cuda.is_available():
        raise SystemExit("tlt_run.py needs a CUDA GPU for SmolLM2 (use --model tiny --quick on CPU)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    head: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if a.model == "smollm2" else "cpu", "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct bf16 (fp32 master weights)" if a.model == "smollm2" else "tiny-llama (CPU)",
        "args": vars(a)}
    out = Path(a.out)
    json_out = Path(a.json_out) if a.json_out else out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(body: dict[str, Any]) -> str:
        res = {**head, **body}
        res["verdict"] = verdict(res, a.divergence)
        table = render(res)
        out.write_text(table)
        json_out.write_text(json.dumps(res, indent=1))
        return table

    sys.stdout.write(write(run(a, write)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
