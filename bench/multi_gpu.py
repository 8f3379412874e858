"""Multi-GPU RL step time: 1 GPU vs 2 GPUs (data-parallel rollout + update, idle ranks train the drafter),
TLT vs SD off, with the harvest ratio, on SmolLM2-135M-Instruct + GSM8K, as ONE markdown table.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python bench/multi_gpu.py --out bench/results/multi_gpu_h200.md  # 2 x H200,
                                                           # ~4-5 min; JSON next to it (or --json-out PATH)
    PYTHONPATH=. python bench/multi_gpu.py --model tiny --steps 2 --out /tmp/mg.md --json-out /tmp/mg.json  # CPU
    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python bench/multi_gpu.py --gpus 2 --modes tlt --zero-stage 0,1 \
        --out /tmp/multi_gpu_zero.md                    # 2-GPU rows: torch replicated AdamW vs DeepSpeed ZeRO-1

Same work per step in every row: --prompts x --samples responses (<= --max-new-tokens, T=1.0, top-k --top-k), the
`h200-gsm8k-tlt` / `h200-gsm8k-sd-off` presets. With 2 GPUs each rank rolls out half the prompts, the policy
gradient is all-reduced (worker/tlt/multigpu/update.py), and the rank whose shard finishes first spot-trains the drafter
until the other finishes (worker/tlt/multigpu/harvest.py; the engine's in-tail hook is off there). 1-GPU rows step a
single trainer in this process (the TLT preset trains the drafter inside its own tail and after the update); 2-GPU
rows run `worker.tlt.multigpu.launch.run` (2 spawned ranks, NCCL) and read rank 0's merged metrics. Quoted: the mean of
the steps after the first (the first includes CUDA graph capture). harvest idle / used are GPU-seconds per step over
all GPUs. 2-GPU rows run first, so this process holds no GPU memory while the ranks run. `--zero-stage 0,1` runs each
2-GPU row once per `resources.zero_stage` (0: torch data parallel; 1-3: DeepSpeed, rl/deepspeed_update.py) and
quotes the largest rank's AdamW state and peak allocated memory (torch.cuda.max_memory_allocated, the run's
high-water mark) next to its step and update time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from worker.tlt.bench import BenchReporter, fmt, ratio, run_trainer_steps
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.job_spec_file import merge_spec

QUOTED = ("timing_s/step", "timing_s/gen", "timing_s/update", "timing_s/drafter", "timing_s/sync",
          "perf/tokens_per_s", "response_length/mean", "response_length/max", "sd/on_fraction", "sd/accept_len",
          "harvest/idle_gpu_s", "harvest/used_gpu_s", "harvest/ratio", "drafter/steps", "drafter/acc",
          "timeline/gpu0/rollout_s", "timeline/gpu1/rollout_s", "reward/mean", "perf/optimizer_state_mib",
          "perf/peak_mem_mib", "perf/kv_released_gb", "timing_s/kv_restore")
MODE_PRESETS = {"tlt": "h200-gsm8k-tlt", "off": "h200-gsm8k-sd-off"}


def print_step(step: int, values: dict[str, float]) -> None:
    print(f"  step {step}: " + json.dumps({k: round(values[k], 4) for k in QUOTED if k in values}), flush=True)


def bench_spec(a: argparse.Namespace, mode: str, gpus: int, zero_stage: int = 0) -> JobSpec:
    over: dict[str, Any] = {
        "algorithm": {"prompts_per_step": a.prompts, "num_generations": a.samples,
                      "max_completion_length": a.max_new_tokens, "top_k": a.top_k},
        "rollout": {"sd_on_below": a.sd_on_below, "release_kv_for_update": a.release_kv},
        "dataset": {"validation_size": 0},
        "resources": {"gpus": gpus, "zero_stage": zero_stage},
        "max_steps": a.steps, "save_steps": 10_000, "save_total_limit": 1, "seed": a.seed,
    }
    if mode == "tlt":
        over["drafter"] = {"max_train_steps_per_rl_step": a.drafter_steps,
                           **({"warm_start": a.drafter_warm_start} if a.drafter_warm_start else {})}
    if a.model == "tiny":
        over["model"] = {"builtin": "tiny-llama", "dtype": "float32"}
        over["dataset"] = {"builtin": "toy-count", "validation_size": 0, "system_prompt": None}
        over["algorithm"]["reward_funcs"] = ["toy_count"]
        over["resources"] = {"gpus": 0, "zero_stage": zero_stage}
        over["rollout"].update(cuda_graphs=False, kv_cache_gb=0.05)
    return JobSpec.model_validate(merge_spec(PRESETS[MODE_PRESETS[mode]], over))


def run_one_gpu(spec: JobSpec) -> list[dict[str, float]]:
    rec = BenchReporter(on_metrics=print_step)
    run_trainer_steps(spec, rec, rec.metrics)
    return rec.steps


def run_two_gpus(spec: JobSpec) -> list[dict[str, float]]:
    from worker.tlt.multigpu import launch

    rec = BenchReporter(on_metrics=print_step)
    with tempfile.TemporaryDirectory(prefix="mgpu-") as d:
        launch.run(spec, Path(d), rec, resume=False, world=2)
    return rec.steps


def quote(steps: list[dict[str, float]]) -> dict[str, float]:
    quoted = steps[1:] if len(steps) > 1 else steps
    return {k: statistics.fmean(s[k] for s in quoted) for k in QUOTED if all(k in s for s in quoted)}


def kv_release_note(runs: list[dict[str, Any]], on: bool) -> str:
    """What releasing the KV cache for the update freed and cost (the largest per-step figures of any run)."""
    if not on:
        return "KV cache kept through the update (rollout.release_kv_for_update off)"
    freed = max((r["mean"].get("perf/kv_released_gb", 0.0) for r in runs), default=0.0)
    back = max((r["mean"].get("timing_s/kv_restore", 0.0) for r in runs), default=0.0)
    return (f"KV cache released for the update (rollout.release_kv_for_update): {fmt(freed)} GB freed per step; "
            f"re-allocated in {fmt(back)} s at the next rollout, whose CUDA graphs are re-captured inside rollout s")


def render(res: dict[str, Any]) -> str:
    a = res["args"]
    rows = {(r["gpus"], r["mode"], r.get("zero_stage", 0)): r["mean"] for r in res["runs"]}
    lines = [
        f"Multi-GPU RL step, 1 vs 2 GPUs, TLT vs SD off — {res['device']}, torch {res['torch']}, {a['model']}, "
        f"{a['prompts']} prompts x {a['samples']} samples, <= {a['max_new_tokens']} new tokens, top-k {a['top_k']}",
        "",
        "| GPUs | mode | step s | rollout s (GPU0 / GPU1) | update s | drafter+sync s | tokens/s | len mean / max "
        "| SD on / accept | harvest idle / used GPU-s (ratio) | AdamW state / peak MiB (max rank) | 1 GPU / 2 GPUs "
        "| SD off / TLT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        m, g, mode, zero = r["mean"], r["gpus"], r["mode"], r.get("zero_stage", 0)
        step = m.get("timing_s/step")
        per_gpu = (f" ({fmt(m.get('timeline/gpu0/rollout_s'))} / {fmt(m.get('timeline/gpu1/rollout_s'))})"
                   if g > 1 else "")
        harvest = (f"{fmt(m.get('harvest/idle_gpu_s'))} / {fmt(m.get('harvest/used_gpu_s'))} "
                   f"({fmt(m.get('harvest/ratio'))})" if "harvest/idle_gpu_s" in m else "—")
        one = rows.get((1, mode, 0), {}).get("timing_s/step")
        off = rows.get((g, "off", zero), {}).get("timing_s/step")
        memory = (f"{fmt(m.get('perf/optimizer_state_mib'), 1)} / {fmt(m.get('perf/peak_mem_mib'), 0)}"
                  if g > 1 else "—")
        lines.append(
            f"| {g} | {mode}{f' ZeRO-{zero}' if g > 1 else ''} ({r['quoted_steps']} steps) | {fmt(step)} | {fmt(m.get('timing_s/gen'))}{per_gpu} "
            f"| {fmt(m.get('timing_s/update'))} | {fmt(m.get('timing_s/drafter', 0) + m.get('timing_s/sync', 0))} "
            f"| {fmt(m.get('perf/tokens_per_s'))} | {fmt(m.get('response_length/mean'), 0)} / "
            f"{fmt(m.get('response_length/max'), 0)} | {fmt(m.get('sd/on_fraction'))} / {fmt(m.get('sd/accept_len'))} "
            f"| {harvest} | {memory} | {ratio(one, step) if g > 1 else '—'} | {ratio(off, step) if mode == 'tlt' else '—'} |")
    notes = [
        "step s: mean of the steps after the first; 1 GPU / 2 GPUs and SD off / TLT are step-time ratios (> 1 = the "
        "second faster). Rows sample different tokens (per-rank streams, SD consumes the RNG differently): compare "
        "tokens/s and lengths too",
        "2 GPUs: rollout s is the slowest rank's rollout incl. the harvest wait; GPU0 / GPU1 their own shards; "
        "harvest idle = GPU-seconds from a rank's shard done to all ranks done, used = drafter training inside it",
        "1 GPU TLT: harvest idle = the rollout's tail (incl. drafter steps between tail steps), used = those drafter "
        "steps, per step (speculative/drafter/online.py)",
        "ZeRO-0: every rank holds all AdamW moments; ZeRO-1: each rank its shard, plus a parameter broadcast per step "
        "(in update s); peak MiB is the rank's allocator high-water mark over the run (— on CPU)",
        kv_release_note(res["runs"], a.get("release_kv", False)),
        *res["notes"],
    ]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + [""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="tiny: CPU smoke run (gloo)")
    ap.add_argument("--modes", default="off,tlt")
    ap.add_argument("--gpus", default="2,1", help="GPU counts to run, in this order")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--sd-on-below", type=int, default=32)
    ap.add_argument("--drafter-steps", type=int, default=16, help="spot-training cap per RL step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--release-kv", action="store_true", help="rollout.release_kv_for_update: KV cache freed for the update")
    ap.add_argument("--drafter-warm-start", default=None, help="tlt: an exported drafter directory to start from")
    ap.add_argument("--zero-stage", default="0", help="resources.zero_stage of the 2-GPU rows, e.g. 0 or 0,2 (each)")
    ap.add_argument("--out", default="bench/results/multi_gpu_h200.md")
    ap.add_argument("--json-out", default=None, help="default: --out with a .json suffix")
    a = ap.parse_args(argv)
    if a.model == "smollm2" and torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs (or --model tiny for a CPU run)", file=sys.stderr)
        return 2
    device = "CPU (gloo)" if a.model == "tiny" else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    res: dict[str, Any] = {"args": vars(a), "device": device, "torch": torch.__version__, "runs": [], "notes": []}
    out = Path(a.out)
    json_out = Path(a.json_out) if a.json_out else out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    zero_stages = [int(z) for z in a.zero_stage.split(",")]
    for gpus in (int(g) for g in a.gpus.split(",")):
        for mode in a.modes.split(","):
            for zero in zero_stages if gpus > 1 else [0]:  # one GPU has nothing to shard across
                spec = bench_spec(a, mode, gpus, zero)
                print(f"== {gpus} GPU(s), {mode}" + (f", ZeRO-{zero}" if gpus > 1 else ""), flush=True)
                t0 = time.perf_counter()
                steps = run_two_gpus(spec) if gpus == 2 else run_one_gpu(spec)
                quoted = steps[1:] if len(steps) > 1 else steps
                res["runs"].append({"gpus": gpus, "mode": mode, "zero_stage": zero, "wall_s": time.perf_counter() - t0,
                                    "steps": steps, "quoted_steps": len(quoted), "mean": quote(steps)})
                table = render(res)  # rewritten after every run: a run cut short still leaves its rows
                out.write_text(table)
                json_out.write_text(json.dumps(res, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
