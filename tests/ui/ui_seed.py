"""Seed data for the dashboard's browser tests, written the way a running job writes it: through the worker's
`DbReporter` (metrics, histograms, logs, samples) and `crud` (tokens, jobs, status transitions, artifacts).
No API mocks: the browser then reads all of it through the real API.

    python tests/ui/ui_seed.py seed --db sqlite:///x.db --artifacts DIR [--big-steps 10000]   # prints JSON
    python tests/ui/ui_seed.py live --db sqlite:///x.db --artifacts DIR --job 1 --step 13    # one more step

The synthetic run is shaped like a TLT run: log-normal response lengths (a long tail), SD accept length rising as
the drafter trains, acceptance decaying with draft position, idle GPU time from the tail partly harvested.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from sqlalchemy import insert

from backend import crud
from backend.artifact_store import digest
from backend.core.db import make_engine, make_session_factory
from backend.lifecycle import JobStatus
from backend.models import Metric
from worker.db_reporter import DbReporter
from worker.tlt.config import preset

MAX_LEN = 1024  # max_completion_length of the synthetic run
LIVE_REWARD = 0.987654  # reward/mean of a step written by `live` (the browser test looks for it)
DRAFT_DEPTH = 6
HIST_WINDOW = 300  # histograms of the big job: its last steps only (the dashboard's heat-map window)


def step_values(step: int, rng: np.random.Generator) -> tuple[dict[str, float], list[float], list[int]]:
    """All metrics of one synthetic step, and its response-length histogram (edges, counts)."""
    lengths = np.minimum(MAX_LEN, rng.lognormal(mean=5.0 + 0.3 * min(1.0, step / 1000), sigma=0.7, size=64)).astype(int)
    counts, edges = np.histogram(lengths, bins=64, range=(0, MAX_LEN))
    warm = 1 - math.exp(-step / 20)  # the drafter warms up over the first steps
    gen = float(lengths.max()) / 60 + 2
    idle = 0.45 * gen
    used = idle * (0.3 + 0.6 * warm)
    accept_len = 1 + 2.6 * warm + rng.normal(0, 0.05)
    m: dict[str, float] = {
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()), "response_length/p50": float(np.percentile(lengths, 50)),
        "response_length/p90": float(np.percentile(lengths, 90)),
        "response_length/clip_ratio": float((lengths >= MAX_LEN).mean()),
        "reward/mean": 0.2 + 0.5 * warm + float(rng.normal(0, 0.02)), "reward/std": 0.4 - 0.1 * warm,
        "frac_reward_zero_std": 0.3 * (1 - warm), "actor/pg_loss": float(rng.normal(0, 0.01)),
        "actor/entropy": 1.2 - 0.3 * warm, "actor/grad_norm": 0.5 + float(rng.random()),
        "timing_s/gen": gen, "timing_s/reward": 0.1, "timing_s/update": 1.5, "timing_s/sync": 0.05,
        "timing_s/drafter": used, "timing_s/step": gen + 1.65,
        "perf/tokens_per_s": float(lengths.sum()) / gen,
        "sd/on_fraction": 0.35 + 0.1 * warm, "sd/accept_len": accept_len, "sd/arm": float(step % 3),
        "sd/tail_tokens_per_s": 40 + 60 * warm, "sd/tail_tokens_per_s_no_sd": 40.0,
        "drafter/loss": 2.0 * (1 - warm) + 0.3, "drafter/acc": 0.2 + 0.6 * warm,
        "harvest/idle_gpu_s": idle, "harvest/used_gpu_s": used, "harvest/ratio": used / idle,
    }
    for k in range(1, DRAFT_DEPTH + 1):
        m[f"sd/accept_rate_pos_{k}"] = (0.55 + 0.35 * warm) ** k
    if step % 5 == 0:
        m["val/pass@1"] = 0.1 + 0.4 * warm
    return m, [float(e) for e in edges], [int(c) for c in counts]


def write_step(rep: DbReporter, step: int, rng: np.random.Generator, overrides: dict[str, float] | None = None) -> None:
    metrics, edges, counts = step_values(step, rng)
    metrics.update(overrides or {})
    rep.metrics(step, metrics)
    rep.histogram(step, "response_length", edges, counts)
    rep.samples(step, [
        {"prompt": f"Q{step}.{i}: Natalia sold clips to {40 + i} friends...", "response": f"... #### {72 + i}",
         "reward": float(i % 2), "length": int(40 + 10 * i), "finish_reason": "stop", "answer": str(72 + i)}
        for i in range(2)
    ])
    rep.log(f"step {step} reward {metrics['reward/mean']:.4f} step {metrics['timing_s/step']:.2f}s")


def make_job(sessions, owner, name: str, status: JobStatus):  # type: ignore[no-untyped-def]
    spec = preset("demo-cpu").model_copy(update={"name": name, "max_steps": 20_000})
    with sessions() as s:
        user = crud.get_or_create_user(s, owner, admin=True)
        job, _ = crud.create_job(s, user, spec, None)
        path = {JobStatus.running: [JobStatus.starting, JobStatus.running],
                JobStatus.failed: [JobStatus.starting, JobStatus.failed]}[status]
        for to in path:
            crud.transition(s, job.id, to, reason="oom in step 3" if to == JobStatus.failed else None,
                            worker="ui-seed-worker", new_attempt=to == JobStatus.starting)
        return job.id


def seed(db: str, artifacts: Path, steps: int, big_steps: int) -> dict:
    engine = make_engine(db)
    sessions = make_session_factory(engine)
    with sessions() as s:
        _, token = crud.create_token(s, "ui-admin", admin=True, name="browser tests")
        # a registered worker, so the new-job form's submit passes admission (no Celery worker runs here)
        crud.register_worker(s, "ui-seed-worker", crud.Capacity(queues=["cpu", "gpu"], gpus=1, gpu_memory_gb=80.0,
                                                                host_memory_gb=64.0))
    rng = np.random.default_rng(0)
    job_id = make_job(sessions, "ui-admin", "ui-seeded-run", JobStatus.running)
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=artifacts)
    for step in range(1, steps + 1):
        write_step(rep, step, rng)
    rep.close()
    # a registered artifact: a drafter directory (downloads as a tar stream)
    art_dir = artifacts / f"job{job_id}" / "drafter"
    art_dir.mkdir(parents=True, exist_ok=True)
    (art_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (art_dir / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    size, sha, is_dir = digest(art_dir)
    with sessions() as s:
        crud.register_artifact(s, job_id, kind="drafter", path=str(art_dir.resolve()), is_dir=is_dir, size=size,
                               sha256=sha, step=steps)
        s.commit()
    failed_id = make_job(sessions, "ui-admin", "ui-failed-run", JobStatus.failed)
    big_id = seed_big(sessions, big_steps, rng) if big_steps else None
    engine.dispose()
    return {"token": token, "job_id": job_id, "failed_job_id": failed_id, "big_job_id": big_id, "steps": steps,
            "artifact": {"sha256": sha, "size": size, "name": art_dir.name}, "live_reward": LIVE_REWARD}


def seed_big(sessions, steps: int, rng: np.random.Generator) -> int:  # type: ignore[no-untyped-def]
    """A job with `steps` steps of a dozen metrics (bulk-inserted: a fresh job has nothing to upsert) and the
    response-length histograms of its last HIST_WINDOW steps."""
    job_id = make_job(sessions, "ui-admin", "ui-10k-steps", JobStatus.running)
    x = np.arange(1, steps + 1)
    warm = 1 - np.exp(-x / 2000)
    noise = rng.normal(0, 1, size=(12, steps))
    series = {
        "reward/mean": 0.2 + 0.5 * warm + 0.02 * noise[0], "reward/std": 0.4 - 0.1 * warm + 0.01 * noise[1],
        "timing_s/gen": 12 + noise[2], "timing_s/update": 1.5 + 0.05 * noise[3], "timing_s/step": 13.6 + noise[2],
        "perf/tokens_per_s": 900 + 50 * noise[4], "response_length/p50": 150 + 5 * noise[5],
        "response_length/p90": 380 + 20 * noise[6], "response_length/max": np.minimum(MAX_LEN, 800 + 100 * noise[7]),
        "sd/accept_len": 1 + 2.6 * warm + 0.05 * noise[8], "harvest/ratio": 0.3 + 0.6 * warm,
        "sd/on_fraction": 0.4 + 0.02 * noise[9],
    }
    now = datetime.now(UTC)
    rows = [{"job_id": job_id, "step": int(st), "name": n, "value": float(v[i]), "created_at": now}
            for n, v in series.items() for i, st in enumerate(x)]
    with sessions() as s:
        s.execute(insert(Metric), rows)  # executemany
        lengths = []  # the window's length metrics, consistent with its histograms
        for step in range(max(1, steps - HIST_WINDOW + 1), steps + 1):
            vals, edges, counts = step_values(step, rng)
            crud.upsert_histogram(s, job_id, step, "response_length", edges, counts)
            lengths += [(step, f"response_length/{k}", vals[f"response_length/{k}"]) for k in ("p50", "p90", "max")]
        crud.upsert_metrics(s, job_id, lengths)
        s.commit()
    return job_id


def live(db: str, artifacts: Path, job_id: int, step: int) -> None:
    engine = make_engine(db)
    rep = DbReporter(make_session_factory(engine), job_id, attempt=1, artifact_root=artifacts)
    write_step(rep, step, np.random.default_rng(step), {"reward/mean": LIVE_REWARD})
    rep.close()
    engine.dispose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["seed", "live"])
    ap.add_argument("--db", required=True)
    ap.add_argument("--artifacts", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--big-steps", type=int, default=0)
    ap.add_argument("--job", type=int)
    ap.add_argument("--step", type=int)
    args = ap.parse_args(argv)
    if args.command == "seed":
        sys.stdout.write(json.dumps(seed(args.db, args.artifacts, args.steps, args.big_steps)) + "\n")
    else:
        live(args.db, args.artifacts, args.job, args.step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
