"""Run a TLT training job: `run(spec, run_dir, reporter)` (what the Celery worker calls) and `tlt train` (no service).

    tlt train spec.yaml [--run-dir DIR] [--preset NAME]
    python -m worker.tlt.train spec.yaml --run-dir runs/demo
    python -m worker.tlt.train --preset demo-cpu --run-dir runs/demo     # a named preset instead of a file

With `--preset` and a spec file, the file's keys override the preset's. The run directory receives metrics.jsonl,
histograms.jsonl, samples.jsonl, artifacts.jsonl, train.log (file_reporter.py), checkpoints/step-N, policy/ (the
HF export) and tensorboard/ (the step metrics as TensorBoard events, tensorboard.py). A run directory that already
holds checkpoints resumes from the newest one (resume=False starts over).
Stop a `tlt train` run at its next safe point with `touch DIR/STOP`.
The parts: build.py (`build_trainer`), rl/loop.py (`train_loop`: stop, validate, report, checkpoint, export; the same
loop runs each rank of a multi-GPU job, multigpu/data_parallel.py), run_dir.py (checkpoints, resume, final exports),
job_spec_file.py (`load_spec`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from worker.tlt.build import build_trainer, pick_device, seed_everything
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.data.dataset import load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.file_reporter import FileReporter
from worker.tlt.job_spec_file import load_spec
from worker.tlt.model.load import load_model
from worker.tlt.reporting import Reporter
from worker.tlt.rl.loop import SingleDevice, train_loop
from worker.tlt.tensorboard import TensorBoardReporter


def run_drafter_warmup(spec: JobSpec, run_dir: Path, reporter: Reporter) -> None:
    """`type: drafter` jobs: warm up a drafter on the dataset's prompts (speculative/drafter/warmup.py), export to run_dir/drafter."""
    device = pick_device(spec)
    seed_everything(spec.seed)
    model, tokenizer = load_model(spec.model, device)
    ds = spec.dataset
    train_rows, _ = split_examples(load_examples(ds), 0)
    prompts = render_examples(train_rows, tokenizer, ds.system_prompt, ds.max_prompt_length)
    reporter.log(f"drafter warm-up ({spec.drafter.kind}) for {spec.model.model_dump(exclude_none=True)} on {device}")
    from worker.tlt.speculative.drafter.warmup import warmup  # drafter code is imported only by jobs that use it

    warmup(spec, model, tokenizer, [list(p.ids) for p in prompts], reporter, out_dir=run_dir / "drafter")


def run(spec: JobSpec, run_dir: Path, reporter: Reporter, resume: bool = True) -> None:
    """Train `spec` to max_steps (or until reporter.should_stop()), checkpointing and exporting into run_dir.
    `type: drafter` jobs run the drafter warm-up instead."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tb = TensorBoardReporter(reporter, run_dir / "tensorboard")  # every metric also goes to TensorBoard events
    try:
        _run(spec, run_dir, tb, resume)
    except BaseException:
        tb.close()
        raise
    tb.finish()


def _run(spec: JobSpec, run_dir: Path, reporter: Reporter, resume: bool) -> None:
    if spec.type == "drafter":
        run_drafter_warmup(spec, run_dir, reporter)
        return
    if spec.resources.gpus > 1 and spec.rollout.backend == "tlt":
        # multi-GPU jobs on our engine: one process per GPU (vLLM splits one model over the GPUs itself)
        from worker.tlt.multigpu import launch

        launch.run(spec, run_dir, reporter, resume)
        return
    trainer, val = build_trainer(spec, reporter)
    try:
        train_loop(spec, trainer, SingleDevice(), val, run_dir, reporter, resume)
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tlt train", description="Run a TLT GRPO job without the service.")
    parser.add_argument("spec", nargs="?", help="job spec YAML (JobSpec fields)")
    parser.add_argument("--run-dir", default=None, help="output directory (default runs/<spec name>)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS), help="start from a named preset")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in the run directory")
    args = parser.parse_args(argv)
    if not args.spec and not args.preset:
        parser.error("give a spec file or --preset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = load_spec(args.spec, args.preset)
    run_dir = Path(args.run_dir or f"runs/{spec.name}")
    run(spec, run_dir, FileReporter(run_dir), resume=not args.no_resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
