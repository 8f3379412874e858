"""Reward curves with and without speculative decoding: does TLT's lossless SD leave GRPO learning unchanged?

    PYTHONPATH=. python bench/train_curves.py --out bench/results/train_curves_h200.md     # ~5 min on an H200
    PYTHONPATH=. python bench/train_curves.py --model tiny --quick --out /tmp/c.md         # CPU smoke run

Three GRPO runs of --steps steps from the same weights, data order and settings: SD off (rollout seed 0), TLT
(adaptive SD + online EAGLE-1 drafter, rollout seed 0) and SD off again with another rollout seed (1), which
measures seed noise: SD is lossless in distribution, not in samples (it draws from the RNG differently), so TLT
vs SD off can only be expected to differ as much as two SD-off seeds do. Per step the table prints reward/mean of
each run. Verdict (both must hold for "overlap"):
- mean: |mean over steps of (TLT - off)| <= 2 x sd(off - off')/sqrt(steps), the spread of a mean difference that
  seed noise alone gives;
- spread: rms(TLT - off) <= 1.5 x rms(off - off'), TLT is no further from SD off, step by step, than another seed.
Defaults keep the three runs under ~5 minutes on an H200: 4 prompts x 8 samples (not the 8 x 8 of the step-time
bench), <= 512 new tokens, 30 steps, lr 5e-6 with rewards math_accuracy + 0.5 x format (the format reward moves
within 30 steps at this lr, so the curves have a trend to compare, not just noise around 0.03).
Outputs are rewritten after every run (a cut-short run still leaves what finished).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from worker.tlt.bench import BenchReporter, run_trainer_steps
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.job_spec_file import merge_spec

TRACKED = ("reward/mean", "response_length/mean", "sd/on_fraction", "sd/accept_len", "timing_s/step",
           "timing_s/gen", "actor/grad_norm")
RUNS = {  # name: (preset, rollout seed)
    "off": ("h200-gsm8k-sd-off", 0),
    "tlt": ("h200-gsm8k-tlt", 0),
    "off_seed1": ("h200-gsm8k-sd-off", 1),
}


def curve_spec(a: argparse.Namespace, run: str) -> JobSpec:
    preset, rollout_seed = RUNS[run]
    over: dict[str, Any] = {
        "algorithm": {"prompts_per_step": a.prompts, "num_generations": a.samples,
                      "max_completion_length": a.max_new_tokens, "learning_rate": a.lr, "top_k": a.top_k,
                      "reward_funcs": ["math_accuracy", "format"], "reward_weights": [1.0, a.format_weight]},
        "rollout": {"seed": rollout_seed, "sd_on_below": a.sd_on_below, "kv_cache_gb": a.kv_cache_gb},
        "dataset": {"validation_size": 0},
        "max_steps": a.steps, "seed": a.seed,
    }
    if a.model == "tiny":
        over["model"] = {"builtin": "tiny-llama", "dtype": "bfloat16"}
        over["dataset"] = {"builtin": "toy-count", "validation_size": 0, "system_prompt": None}
        over["algorithm"].update(reward_funcs=["toy_count"], reward_weights=None)
        over["resources"] = {"gpus": 0}
        over["rollout"]["cuda_graphs"] = False
    if run == "tlt":
        over["drafter"] = {"max_train_steps_per_rl_step": a.drafter_steps} if a.drafter_steps is not None else {}
    return JobSpec.model_validate(merge_spec(PRESETS[preset], over))


def run_curve(a: argparse.Namespace, run: str) -> dict[str, Any]:
    spec = curve_spec(a, run)
    steps: list[dict[str, float]] = []

    def record(step: int, metrics: dict[str, float]) -> None:
        steps.append({k: float(metrics[k]) for k in TRACKED if k in metrics})
        print(f"{run} step {step}: reward {steps[-1]['reward/mean']:.4f} "
              f"len {steps[-1]['response_length/mean']:.0f} {steps[-1]['timing_s/step']:.2f}s", flush=True)

    t0 = time.perf_counter()
    build_s = run_trainer_steps(spec, BenchReporter(), record)
    seconds = time.perf_counter() - t0 - build_s  # the steps and the tear-down, not the build
    return {"run": run, "preset": RUNS[run][0], "rollout_seed": RUNS[run][1], "seconds": seconds,
            "steps": steps, "reward": [s["reward/mean"] for s in steps]}


def rms(xs: list[float]) -> float:
    return math.sqrt(statistics.fmean(x * x for x in xs)) if xs else 0.0


def verdict(off: list[float], tlt: list[float], off2: list[float]) -> dict[str, Any]:
    """The overlap test of the module docstring over the steps all three runs finished."""
    n = min(len(off), len(tlt), len(off2))
    if n < 2:
        return {"steps": n, "overlap": None}
    d_sd = [tlt[i] - off[i] for i in range(n)]
    d_noise = [off2[i] - off[i] for i in range(n)]
    noise_sd = statistics.stdev(d_noise)
    mean_bound = 2 * noise_sd / math.sqrt(n)
    mean_ok = abs(statistics.fmean(d_sd)) <= mean_bound
    spread_ratio = rms(d_sd) / rms(d_noise) if rms(d_noise) > 0 else math.inf
    spread_ok = spread_ratio <= 1.5
    return {"steps": n, "mean_diff_tlt_off": statistics.fmean(d_sd), "mean_diff_bound": mean_bound,
            "mean_diff_seed": statistics.fmean(d_noise), "rms_diff_tlt_off": rms(d_sd), "rms_diff_seed": rms(d_noise),
            "spread_ratio": spread_ratio, "mean_ok": mean_ok, "spread_ok": spread_ok, "overlap": mean_ok and spread_ok}


def render(res: dict[str, Any]) -> str:
    a, runs = res["args"], res["runs"]
    names = [r for r in RUNS if r in runs]
    lines = [f"GRPO reward curves, SD off vs TLT (adaptive SD + online drafter) — {res['device']}, {res['model']}, "
             f"{a['prompts']} prompts x {a['samples']} samples, <= {a['max_new_tokens']} new, T=1.0, top-k "
             f"{a['top_k']}, lr {a['lr']}", "",
             "| step | " + " | ".join(f"{n} reward" for n in names) + " | tlt - off | off_seed1 - off |",
             "|---|" + "---|" * (len(names) + 2)]
    curves = {n: runs[n]["reward"] for n in names}
    for i in range(max(len(c) for c in curves.values())):
        cells = [f"{curves[n][i]:.4f}" if i < len(curves[n]) else "—" for n in names]

        def diff(x: str, y: str, i: int = i) -> str:
            cx, cy = curves.get(x, []), curves.get(y, [])
            return f"{cx[i] - cy[i]:+.4f}" if i < len(cx) and i < len(cy) else "—"

        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {diff('tlt', 'off')} | {diff('off_seed1', 'off')} |")
    v = res.get("verdict", {})
    notes = []
    if v.get("overlap") is not None:
        notes += [
            f"verdict over {v['steps']} steps: curves {'OVERLAP' if v['overlap'] else 'DO NOT overlap'} within seed "
            f"noise (mean test {'ok' if v['mean_ok'] else 'FAILED'}: |mean(tlt - off)| = "
            f"{abs(v['mean_diff_tlt_off']):.4f} vs bound {v['mean_diff_bound']:.4f}; spread test "
            f"{'ok' if v['spread_ok'] else 'FAILED'}: rms(tlt - off) / rms(off_seed1 - off) = "
            f"{v['spread_ratio']:.2f} vs 1.5)",
        ]
    for n in names:
        st = runs[n]["steps"]
        on = [s.get("sd/on_fraction", 0.0) for s in st]
        notes.append(f"{n}: {runs[n]['seconds']:.0f} s for {len(st)} steps; mean reward {statistics.fmean(runs[n]['reward']):.4f}; "
                     f"mean length {statistics.fmean(s['response_length/mean'] for s in st):.0f}; "
                     f"SD on fraction {statistics.fmean(on):.2f}")
    return "\n".join(lines + [""] + [f"- {x}" for x in notes] + [""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: 2 prompts x 4 samples, 6 new, 3 steps")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=None, help="default 30 (--quick: 3)")
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--format-weight", type=float, default=0.5)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--sd-on-below", type=int, default=16, help="TLT: SD on below this many active sequences")
    ap.add_argument("--drafter-steps", type=int, default=None, help="TLT: spot steps per RL step (preset's default)")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=0, help="data order and weights; rollout seeds are 0 and 1")
    ap.add_argument("--runs", default="off,tlt,off_seed1")
    ap.add_argument("--out", default="bench/results/train_curves_h200.md")
    ap.add_argument("--json-out", default=None, help="default: --out with .json")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.samples, a.max_new_tokens, a.lr = 2, 4, 6, 2e-2
        a.steps = a.steps or 3
        a.sd_on_below = a.prompts * a.samples + 1
        a.drafter_steps = 1 if a.drafter_steps is None else a.drafter_steps
    a.steps = a.steps or 30
    if a.model == "smollm2" and not torch.cuda.is_available():
        raise SystemExit("train_curves.py needs a CUDA GPU for SmolLM2 (use --model tiny --quick on CPU)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(a.out)
    json_out = Path(a.json_out) if a.json_out else out.with_suffix(".json")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if a.model == "smollm2" else "cpu",
        "model": "SmolLM2-135M-Instruct bf16 (fp32 master weights)" if a.model == "smollm2" else "tiny-llama (CPU)",
        "args": vars(a), "runs": {},
    }
    table = ""
    for run in a.runs.split(","):
        res["runs"][run] = run_curve(a, run)
        if all(r in res["runs"] for r in ("off", "tlt", "off_seed1")):
            res["verdict"] = verdict(*(res["runs"][r]["reward"] for r in ("off", "tlt", "off_seed1")))
        table = render(res)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
        json_out.write_text(json.dumps(res, indent=1))
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
