"""Record a real training run for the dashboard's browser tests: a tiny random Llama on the toy counting task, CPU,
adaptive speculative decoding with the online EAGLE-1 drafter (spot-trained in the tail), validation every 4 steps.
What the library's FileReporter writes (metrics, histograms, samples) goes into tests/ui/recorded_run.json, which
tests/ui/ui_seed.py replays through the worker's DbReporter: the UI tests run on metric names and values a job
really writes, not invented ones.

    python tests/ui/record_run.py [--out tests/ui/recorded_run.json] [--steps 12]     # ~5 min on 2 CPU cores

Re-record after changing what the worker writes; tests/ui/test_metric_catalog.py checks the recording against the
metric catalogue.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import read_metrics
from worker.tlt.train import FileReporter, run

OUT = Path(__file__).with_name("recorded_run.json")
SAMPLES_KEPT = 2  # sample rows per step kept in the recording


def spec(steps: int) -> JobSpec:
    return JobSpec.model_validate({
        "name": "ui-recorded-run",
        "model": {"builtin": "tiny-llama"},
        "dataset": {"builtin": "toy-count", "validation_size": 4},
        "algorithm": {"num_generations": 4, "prompts_per_step": 4, "max_completion_length": 160,
                      "learning_rate": 1e-3, "reward_funcs": ["toy_count"]},
        # 16 sequences, SD allowed below 12 active: the tail of every rollout runs the bandit's arms
        "rollout": {"speculative": "adaptive", "sd_on_below": 12, "sd_patience": 1, "draft_depth": 3,
                    "sd_switch": "active_batch"},  # the threshold: the recording must show the bandit's arms on CPU
        "drafter": {"kind": "eagle1", "max_train_steps_per_rl_step": 4, "buffer_gb": 0.01, "learning_rate": 1e-2},
        "max_steps": steps, "save_steps": steps, "save_total_limit": 1, "eval_steps": 4,
    })


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def record(steps: int) -> dict:
    job = spec(steps)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        run(job, run_dir, FileReporter(run_dir), resume=False)
        hists, samples = _jsonl(run_dir / "histograms.jsonl"), _jsonl(run_dir / "samples.jsonl")
        rows = []
        for rec in read_metrics(run_dir):
            step = rec["step"]
            rows.append({
                "step": step,
                "metrics": rec["metrics"],
                "histograms": [{k: h[k] for k in ("name", "edges", "counts")} for h in hists if h["step"] == step],
                "samples": [r for s in samples if s["step"] == step for r in s["rows"]][:SAMPLES_KEPT],
            })
    return {"spec": job.model_dump(mode="json", exclude_unset=True), "steps": rows}  # as written: re-validated by the seed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    rec = record(args.steps)
    args.out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    names = sorted({n for s in rec["steps"] for n in s["metrics"]})
    sys.stdout.write(f"{args.out}: {len(rec['steps'])} steps, {len(names)} metric names\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
