"""RL step time on the GPU: ours with TLT (adaptive SD + online EAGLE drafter) vs ours with SD off vs TRL
GRPOTrainer, on SmolLM2-135M-Instruct + GSM8K, printed as ONE markdown table.

    PYTHONPATH=. python bench/train_bench.py --out bench/results/train_bench_h200.md       # ~4 min on an H200
    PYTHONPATH=. python bench/train_bench.py --peers-json peers.json --out ...            # + TRL's step time
    PYTHONPATH=. python bench/train_bench.py --model tiny --quick --out /tmp/t.md         # CPU smoke run (seconds)

Settings: 8 prompts x 8 samples, <= 1024 new tokens, T=1.0, top-k 50 (HF generate's default sampling,
which TRL's generation uses), bf16 weights with fp32 master weights, AdamW lr 1e-6, the `h200-gsm8k` preset; plus
a long-tail setting, same prompts with <= 4096 new tokens (`--long-tail-max-new`), where SmolLM2 at T=1.0 leaves a
few responses running to the cap long after the rest finished: the memory-bound tail TLT targets. Each mode runs
`--steps` RL steps from the same seed and data (same prompts every step in both modes; samples differ, as SD
consumes the RNG differently); the table quotes the mean of the steps after the first (the first includes CUDA
graph capture), split into rollout (timing_s/gen, incl. spot training run inside the tail), reward (what is left
after the rollout), update, drafter (spot training after the update). TRL's figure is the mean of its
step_time_s after the first, read from `../shared/peers/hf_trl_peers.py --what grpo` output (its `trl_grpo`
section), by default from peers.json next to --out when there is one.
Modes: `tlt` = rollout.speculative adaptive (SD where measured step costs say it pays, considered below
1.5 x --sd-on-below active sequences; n-gram cold start + the EAGLE-1 drafter trained online in the tail steps SD
runs in, capped at --drafter-steps per RL step; the `h200-gsm8k-tlt` preset); `off` = speculative off, no drafter
(`h200-gsm8k-sd-off`). Outputs are rewritten after every run, so a
run cut short still leaves its finished rows.
`--profile-update` (is the update GPU- or host-bound?) runs the first mode of the first setting for one
extra step and runs only that step's `update(...)` under torch.profiler (CPU + CUDA); the step is left out of the
table's means and its kernel / CPU-op summary lands in the markdown and in the JSON's "update_profile".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from worker.tlt.bench import BenchReporter, fmt, ratio, run_trainer_steps, tiny_model_overrides
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.job_spec_file import merge_spec

QUOTED = ("timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/drafter",
          "timing_s/reward_work", "perf/tail_hook_s", "perf/tokens_per_s", "perf/tokens_per_s_tail", "response_length/mean",
          "response_length/max", "response_length/clip_ratio", "sd/on_fraction", "sd/accept_len", "reward/mean",
          "drafter/steps")
# keys by prefix: tokens/s per batch bucket, the same per sequence (fair when the batch mix differs), arms chosen
PER_BUCKET = ("perf/tokens_per_s_bucket/", "sd/arm/", "perf/seq_tokens_per_s_bucket/")
MODE_PRESETS = {"tlt": "h200-gsm8k-tlt", "off": "h200-gsm8k-sd-off"}


def bench_spec(a: argparse.Namespace, mode: str, max_new: int, extra_steps: int = 0) -> JobSpec:
    """The mode's preset with the bench's sizes; the tiny CPU variant swaps model, data and device. `extra_steps`
    are run after `--steps` (the profiled step); the presets' LR schedule is constant, so they change nothing else."""
    over: dict[str, Any] = {
        "algorithm": {"prompts_per_step": a.prompts, "num_generations": a.samples, "max_completion_length": max_new,
                      "temperature": a.temperature, "top_k": a.top_k,
                      **({"micro_batch_tokens": a.micro_batch_tokens} if a.micro_batch_tokens else {})},
        "rollout": {"sd_on_below": a.sd_on_below, "kv_cache_gb": a.kv_cache_gb},
        "drafter": {"max_train_steps_per_rl_step": a.drafter_steps, "draft_vocab_size": a.draft_vocab},
        "max_steps": a.steps + extra_steps, "seed": a.seed,
    }
    if mode == "off":
        del over["drafter"]
    if a.drafter_warm_start and mode == "tlt":
        over["drafter"]["warm_start"] = a.drafter_warm_start
    if a.model == "tiny":
        tiny_model_overrides(over)
    else:
        over["dataset"] = {"validation_size": 0}
    return JobSpec.model_validate(merge_spec(PRESETS[MODE_PRESETS[mode]], over))


def run_mode(a: argparse.Namespace, mode: str, max_new: int, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """`--steps` RL steps of one mode; per-step metrics and the mean of the quoted (after-the-first) steps. With
    `profile` (a dict to fill), one extra step runs with its update profiled; it is kept out of `steps` and the mean."""
    extra = 1 if profile is not None else 0
    spec = bench_spec(a, mode, max_new, extra)
    steps: list[dict[str, float]] = []

    def record(step: int, metrics: dict[str, float]) -> None:
        row = {k: float(v) for k, v in metrics.items() if k in QUOTED or k.startswith(PER_BUCKET)}
        print(f"{mode} <= {max_new} new, step {step}: {json.dumps(row)}", flush=True)
        if step > a.steps and profile is not None:
            profile["step_metrics"] = row  # profiler overhead inside: never averaged
        else:
            steps.append(row)

    with profile_update_call(a.steps + 1, profile) if profile is not None else contextlib.nullcontext():
        build_s = run_trainer_steps(spec, BenchReporter(), record)
    quoted = steps[1:] if len(steps) > 1 else steps
    mean = {k: statistics.fmean(s[k] for s in quoted) for k in quoted[0] if all(k in s for s in quoted)}
    if profile is not None:
        profile.update(mode=mode, max_new_tokens=max_new, step=a.steps + 1,
                       unprofiled_update_s=mean.get("timing_s/update"))
    return {"mode": mode, "max_new_tokens": max_new, "build_s": build_s, "steps": steps, "quoted_steps": len(quoted),
            "mean": mean, "spec": spec.model_dump(mode="json")}


@contextlib.contextmanager
def profile_update_call(call_no: int, into: dict[str, Any]) -> Iterator[None]:
    """Run the `call_no`-th (1-based) `GRPOTrainer.update` call under torch.profiler and put its summary in `into`.
    The method is swapped on the class only while the block runs: run_trainer_steps builds the trainer itself, and
    the product code stays as it is."""
    from worker.tlt.rl.batch import plan_micro_batches
    from worker.tlt.rl.trainer import GRPOTrainer

    original = GRPOTrainer.update
    calls = 0

    def update(self: GRPOTrainer, seqs: list[Any]) -> dict[str, float]:
        nonlocal calls
        calls += 1
        if calls != call_no:
            return original(self, seqs)
        cuda = torch.device(self.device).type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()  # the rollout's queued work must not land in the update's window
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            out = original(self, seqs)
            if cuda:
                torch.cuda.synchronize()
            wall_s = time.perf_counter() - t0
        lengths = [len(s) for s in seqs]
        into.update(wall_s=wall_s, cuda=cuda, sequences=len(seqs), tokens=sum(lengths),
                    response_tokens=sum(len(s.response_ids) for s in seqs),
                    micro_batches=len(plan_micro_batches(lengths, self.algo.micro_batch_tokens)) if seqs else 0,
                    **profile_summary(prof))
        return out

    GRPOTrainer.update = update  # type: ignore[method-assign]
    try:
        yield
    finally:
        GRPOTrainer.update = original  # type: ignore[method-assign]


def profile_summary(prof: torch.profiler.profile, top_kernels: int = 15, top_cpu: int = 10) -> dict[str, Any]:
    """GPU side: kernel count, summed kernel time, busy time (union of kernel + copy intervals, so overlapping
    streams count once), top kernels by total time. Host side: top ops by self CPU time (launch overhead such as
    cudaLaunchKernel shows up here when the update is host-bound)."""
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    is_copy = [e.name.startswith(("Memcpy", "Memset")) for e in device]
    kernels = [e for e, c in zip(device, is_copy, strict=True) if not c]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        acc = by_name.setdefault(e.name, [0, 0.0])
        acc[0] += 1
        acc[1] += e.time_range.elapsed_us()
    busy_us, end = 0.0, float("-inf")
    for e in sorted(device, key=lambda e: e.time_range.start):  # union of intervals
        start, stop = max(e.time_range.start, end), e.time_range.end
        busy_us += max(0.0, stop - start)
        end = max(end, stop)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top_kernels]
    cpu = sorted((r for r in prof.key_averages() if r.self_cpu_time_total > 0), key=lambda r: -r.self_cpu_time_total)
    return {
        "kernels": len(kernels),
        "kernel_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
        "copies": len(device) - len(kernels),
        "copy_s": sum(e.time_range.elapsed_us() for e, c in zip(device, is_copy, strict=True) if c) / 1e6,
        "gpu_busy_s": busy_us / 1e6,
        "top_kernels": [{"name": n[:80], "count": int(c), "total_ms": t / 1e3} for n, (c, t) in ranked],
        "top_cpu_ops": [{"name": r.key[:80], "count": r.count, "self_cpu_ms": r.self_cpu_time_total / 1e3}
                        for r in cpu[:top_cpu]],
    }


def render_profile(p: dict[str, Any]) -> list[str]:
    """The update-profile section of the markdown (see profile_summary)."""
    wall = p["wall_s"]
    lines = [
        f"### Update profile: {p['mode']}, <= {p['max_new_tokens']} new, step {p['step']} (an extra step, "
        f"not in the means above)",
        "",
        f"- update: {p['sequences']} sequences, {p['tokens']} tokens ({p['response_tokens']} response), "
        f"{p['micro_batches']} micro-batches; wall {fmt(wall, 3)} s under the profiler vs {fmt(p['unprofiled_update_s'], 3)} s "
        "mean unprofiled (the profiler adds host overhead per op and launch, so read wall time from the table)",
    ]
    if not p["cuda"]:
        return lines + ["- no CUDA: the update ran on the CPU, no kernels recorded", *cpu_ops_table(p), ""]
    lines += [
        f"- GPU: {p['kernels']} kernels, {fmt(p['kernel_s'], 3)} s summed kernel time; busy (union, incl. "
        f"{p['copies']} copies / memsets taking {fmt(p['copy_s'], 3)} s) {fmt(p['gpu_busy_s'], 3)} s = "
        f"{fmt(100 * p['gpu_busy_s'] / wall, 0)}% of the profiled wall (low = host-bound)",
        "",
        "| kernel (top 15 by total CUDA time) | count | total ms |",
        "|---|---|---|",
        *(f"| `{k['name']}` | {k['count']} | {fmt(k['total_ms'], 2)} |" for k in p["top_kernels"]),
    ]
    return lines + cpu_ops_table(p) + [""]


def cpu_ops_table(p: dict[str, Any]) -> list[str]:
    return ["", "| CPU op (top 10 by self CPU time) | count | self CPU ms |", "|---|---|---|",
            *(f"| `{o['name']}` | {o['count']} | {fmt(o['self_cpu_ms'], 2)} |" for o in p["top_cpu_ops"])]


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


def bucket_table(res: dict[str, Any]) -> list[str]:
    """Tokens/s per active-batch bucket, SD off vs TLT (mean of the quoted steps), with the arms TLT's bandit ran
    (switch-on steps of the quoted steps, summed over buckets): where adaptive SD gains or loses."""
    lines: list[str] = []
    pre, arm_pre, seq_pre = PER_BUCKET
    for setting, runs in res["settings"].items():
        off, tlt = runs.get("off"), runs.get("tlt")
        if off is None or tlt is None:
            continue
        buckets = [k[len(pre):] for k in tlt["mean"] if k.startswith(pre)]
        arms: Counter[str] = Counter()
        for step in tlt["steps"][1:] or tlt["steps"]:  # the quoted steps
            arms.update({k[len(arm_pre):]: v for k, v in step.items() if k.startswith(arm_pre)})
        lines += ["", f"{setting}: tokens/s per active-batch bucket (quoted steps' mean); TLT's switch-on steps per "
                  f"arm, all buckets: {', '.join(f'{n} {fmt(c, 0)}' for n, c in sorted(arms.items())) or '-'}", "",
                  "| bucket | SD off tok/s | TLT tok/s | TLT / off | SD off tok/s per sequence | TLT tok/s per sequence "
                  "| TLT / off per sequence |", "|---|---|---|---|---|---|---|"]
        for b in buckets:
            o, t = off["mean"].get(pre + b), tlt["mean"].get(pre + b)
            os_, ts = off["mean"].get(seq_pre + b), tlt["mean"].get(seq_pre + b)
            lines.append(f"| {b} | {fmt(o)} | {fmt(t)} | {ratio(t, o)} | {fmt(os_)} | {fmt(ts)} | {ratio(ts, os_)} |")
    return lines


def render(res: dict[str, Any]) -> str:
    a = res["args"]
    trl = res.get("trl_step_s")
    lines = [
        f"RL step time, ours (TLT / SD off) vs TRL GRPOTrainer — {res['device']}, torch {res['torch']}, "
        f"{res['model']}, {a['prompts']} prompts x {a['samples']} samples, T={a['temperature']}, top-k {a['top_k']}"
        + (f", update micro-batches of <= {a['micro_batch_tokens']} tokens" if a.get("micro_batch_tokens") else ""),
        "",
        "| setting | mode | step s | rollout s | reward s | update s | drafter s | tokens/s (rollout) "
        "| tail tokens/s | len mean / max (clip) | SD on / accept len | TRL / ours | SD off / TLT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, runs in res["settings"].items():
        off = runs.get("off", {}).get("mean", {}).get("timing_s/step")
        for mode, r in runs.items():
            m = r["mean"]
            step = m.get("timing_s/step")
            vs_trl = ratio(trl, step) if setting == "main" else "—"
            vs_off = ratio(off, step) if mode == "tlt" else "—"
            off_tail = runs.get("off", {}).get("mean", {}).get("perf/tokens_per_s_tail")
            tail_vs_off = f" ({ratio(m.get('perf/tokens_per_s_tail'), off_tail)})" if mode == "tlt" and off_tail else ""
            lines.append(
                f"| {setting}: <= {r['max_new_tokens']} new | {mode} ({r['quoted_steps']} steps) | {fmt(step)} "
                f"| {fmt(m.get('timing_s/gen'))} | {fmt(m.get('timing_s/reward'), 3)} | {fmt(m.get('timing_s/update'))} "
                f"| {fmt(m.get('timing_s/drafter'))} | {fmt(m.get('perf/tokens_per_s'))} "
                f"| {fmt(m.get('perf/tokens_per_s_tail'))}{tail_vs_off} "
                f"| {fmt(m.get('response_length/mean'), 0)} / {fmt(m.get('response_length/max'), 0)} "
                f"({fmt(m.get('response_length/clip_ratio'))}) "
                f"| {fmt(m.get('sd/on_fraction'))} / {fmt(m.get('sd/accept_len'))} | {vs_trl} | {vs_off} |")
    if trl is not None:
        lines.append(f"| main: <= {a['max_new_tokens']} new | TRL GRPOTrainer | {fmt(trl)} | — | — | — | — | — | — | — | — "
                     f"| 1.00x | — |")
    lines += bucket_table(res)
    notes = [
        "step s = mean of the steps after the first (the first includes CUDA graph capture); rollout includes the "
        "drafter's spot training inside the tail (perf/tail_hook_s); reward = scoring left after the rollout "
        "(the rest overlapped the tail); drafter = spot training after the update; tail tokens/s = emitted tokens / "
        "seconds over the decode steps with fewer than --sd-on-below active sequences (perf/tokens_per_s_tail)",
        "ratios: TRL / ours and SD off / TLT are step-time ratios (> 1 = ours / TLT faster); both modes see the same "
        "prompts, but their samples (and so their lengths) differ: compare tokens/s too",
        *res["notes"],
    ]
    if trl is not None:
        notes.append(f"TRL step_time_s per step: {', '.join(fmt(t) for t in res['trl_steps_s'])} "
                     f"(from {res['peers_json']})")
    prof = res.get("update_profile") or {}
    profile = [""] + render_profile(prof) if "wall_s" in prof else []  # absent until the profiled run ends
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + profile + [""])


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
    ap.add_argument("--skip-main", action="store_true", help="only the long-tail setting (its own device call)")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per mode (the first is not quoted)")
    ap.add_argument("--modes", default="off,tlt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50, help="0 = full vocabulary; 50 = HF generate's default")
    ap.add_argument("--sd-on-below", type=int, default=32, help="tlt: SD on below this many active sequences")
    ap.add_argument("--drafter-steps", type=int, default=None,
                    help="tlt: drafter spot-training steps per RL step (default: the preset's)")
    ap.add_argument("--drafter-warm-start", default=None, help="tlt: an exported drafter directory to start from")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="tlt: drafter.draft_vocab_size (chain drafts over the N most frequent response tokens)")
    ap.add_argument("--kv-cache-gb", type=float, default=24.0)
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="algorithm.micro_batch_tokens of the update (0 = the spec's default); fewer, larger "
                         "micro-batches launch fewer kernels (the update is host-bound: --profile-update)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers-json", default=None, help="default: peers.json next to --out, when present")
    ap.add_argument("--out", default="bench/results/train_bench_h200.md")
    ap.add_argument("--json-out", default=None, help="default: --out with .json")
    ap.add_argument("--profile-update", action="store_true",
                    help="run the first mode of the first setting one extra step, its update under torch.profiler")
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
    settings = {} if a.skip_main else {"main": a.max_new_tokens}
    if a.long_tail_max_new:
        settings["long-tail"] = a.long_tail_max_new
    for setting, max_new in settings.items():
        for mode in a.modes.split(","):
            profile: dict[str, Any] | None = None
            if a.profile_update and "update_profile" not in res:
                profile = res["update_profile"] = {}
            res["settings"].setdefault(setting, {})[mode] = run_mode(a, mode, max_new, profile)
            table = write(res, out, json_out)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
