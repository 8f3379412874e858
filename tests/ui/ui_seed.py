"""Seed data for the dashboard's browser tests, written the way a running job writes it: through the worker's
`DbReporter` (metrics, histograms, logs, samples) and `crud` (tokens, jobs, status transitions, artifacts).
No API mocks: the browser then reads all of it through the real API.

    python tests/ui/ui_seed.py seed --db sqlite:///x.db --artifacts DIR [--big-steps 10000]   # prints JSON
    python tests/ui/ui_seed.py live --db sqlite:///x.db --artifacts DIR --job 1 --step 13    # one more step

The metrics are a real run's: tests/ui/recorded_run.json (tests/ui/record_run.py trains a tiny model with adaptive SD
and the online drafter on CPU and keeps what the FileReporter wrote). Step k of a seeded job replays recorded step
((k - 1) mod N) + 1, so every name and every value shape is one the worker writes; DbReporter refuses any name the
metric catalogue lacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from sqlalchemy import insert

from backend.artifact_store import digest
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from backend.persistence.models import Metric
from worker.db_reporter import DbReporter
from worker.tlt.config import JobSpec
from worker.tlt.job_spec_file import merge_spec
from worker.tlt.metric_catalog import check_names

RECORDED = Path(__file__).with_name("recorded_run.json")
LIVE_REWARD = 0.987654  # reward/mean of a step written by `live` (the browser test looks for it)
HIST_WINDOW = 300  # histograms of the big job: its last steps only (the dashboard's heat-map window)
# The big job's series: a dozen names every recorded step has (its history is bulk-inserted, not reported)
BIG_SERIES = ("reward/mean", "reward/std", "timing_s/gen", "timing_s/update", "timing_s/step", "perf/tokens_per_s",
              "response_length/p50", "response_length/p90", "response_length/max", "harvest/ratio",
              "sd/on_fraction", "sd/spec_step_fraction")


@cache
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def recorded_step(step: int) -> dict:
    """The recorded step replayed at `step`."""
    steps = recorded()["steps"]
    return steps[(step - 1) % len(steps)]


def step_metrics(step: int) -> dict[str, float]:
    """Scalar metrics of the replayed step (a recorded null, a non-finite value, is left out)."""
    return {k: float(v) for k, v in recorded_step(step)["metrics"].items() if v is not None}


def seed_names() -> set[str]:
    """Every metric and histogram name the seed writes."""
    steps = recorded()["steps"]
    return ({n for s in steps for n in s["metrics"]} | {h["name"] for s in steps for h in s["histograms"]}
            | set(BIG_SERIES))


def figures(last: int) -> dict[str, float]:
    """The job page's headline figures after steps 1..last, computed here from the recording (the browser test
    compares): harvest ratio over the job, the share of decode steps where SD ran (the mean over the steps, and at
    the last step), and the tail
    speed-up (one sequence's tokens/s with / without SD) at the newest step whose tail ran both."""
    m = step_metrics(last)
    both = [k for k in range(last, 0, -1) if {"perf/seq_tokens_per_s_tail_sd", "perf/seq_tokens_per_s_tail_plain"}
            <= step_metrics(k).keys()]
    out = {"harvest_ratio": m["harvest/used_gpu_s_total"] / m["harvest/idle_gpu_s_total"],
           "sd_ran": sum(step_metrics(k)["sd/spec_step_fraction"] for k in range(1, last + 1)) / last,
           "sd_ran_last": m["sd/spec_step_fraction"]}
    if both:
        tail = step_metrics(both[0])
        out["tail_step"] = both[0]
        out["tail_speedup"] = tail["perf/seq_tokens_per_s_tail_sd"] / tail["perf/seq_tokens_per_s_tail_plain"]
    return out


def write_step(rep: DbReporter, step: int, overrides: dict[str, float] | None = None) -> None:
    rec = recorded_step(step)
    metrics = {**step_metrics(step), **(overrides or {})}
    rep.metrics(step, metrics)
    for hist in rec["histograms"]:
        rep.histogram(step, hist["name"], hist["edges"], hist["counts"])
    rep.samples(step, rec["samples"])
    rep.log(f"step {step} reward {metrics['reward/mean']:.4f} step {metrics['timing_s/step']:.2f}s")


def make_job(sessions, owner, name: str, status: JobStatus, **spec_keys):  # type: ignore[no-untyped-def]
    spec = JobSpec.model_validate(merge_spec(recorded()["spec"], {"name": name, "max_steps": 20_000, **spec_keys}))
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
    job_id = make_job(sessions, "ui-admin", "ui-seeded-run", JobStatus.running)
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=artifacts)
    for step in range(1, steps + 1):
        write_step(rep, step)
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
    one_id = make_job(sessions, "ui-admin", "ui-one-step", JobStatus.running)
    one = DbReporter(sessions, one_id, attempt=1, artifact_root=artifacts)
    write_step(one, 1)
    one.close()
    big_id = seed_big(sessions, big_steps) if big_steps else None
    cost_id = seed_cost_switch(sessions, artifacts)
    engine.dispose()
    return {"token": token, "job_id": job_id, "failed_job_id": failed_id, "big_job_id": big_id, "steps": steps,
            "one_step_job_id": one_id, "figures": figures(steps), "cost_switch_job_id": cost_id,
            "artifact": {"sha256": sha, "size": size, "name": art_dir.name}, "live_reward": LIVE_REWARD,
            "sample_prompt": str(recorded_step(steps)["samples"][0]["prompt"]).splitlines()[-2][:24]}


COST_SWITCH = {"sd/step_s_plain/5-8": 0.05, "sd/step_s_sd/5-8": 0.11, "sd/gain/5-8": 0.62, "sd/pays/5-8": 0.0}
LONG_RESPONSE = "b" * 900  # one unbroken word: the samples table must wrap it inside its own column


def seed_cost_switch(sessions, artifacts: Path) -> int:  # type: ignore[no-untyped-def]
    """A CPU job without validation whose SD switch goes by measured step costs and judged SD off (what the demo
    shows on CPU), with an unbroken long sample response."""
    job_id = make_job(sessions, "ui-admin", "ui-cost-switch", JobStatus.running, eval_steps=0,
                      rollout={"sd_switch": "step_costs"})
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=artifacts)
    for step in (1, 2):
        rep.metrics(step, {k: v for k, v in {**step_metrics(step), **COST_SWITCH}.items() if not k.startswith("val/")})
        rep.samples(step, [{"prompt": "Write the letter b many times: ", "response": LONG_RESPONSE, "answer": "b",
                            "reward": 0.9, "length": len(LONG_RESPONSE)}])
    rep.close()
    return job_id


def seed_big(sessions, steps: int) -> int:  # type: ignore[no-untyped-def]
    """A job with `steps` steps of a dozen recorded series, replayed in a cycle (bulk-inserted: a fresh job has nothing
    to upsert), and the response-length histograms of its last HIST_WINDOW steps."""
    check_names(BIG_SERIES)  # bulk rows bypass the reporter: check the names here
    job_id = make_job(sessions, "ui-admin", "ui-10k-steps", JobStatus.running)
    now = datetime.now(UTC)
    rows = [{"job_id": job_id, "step": step, "name": n, "value": step_metrics(step)[n], "created_at": now}
            for n in BIG_SERIES for step in range(1, steps + 1)]
    with sessions() as s:
        s.execute(insert(Metric), rows)  # executemany
        for step in range(max(1, steps - HIST_WINDOW + 1), steps + 1):
            for hist in recorded_step(step)["histograms"]:
                crud.upsert_histogram(s, job_id, step, hist["name"], hist["edges"], hist["counts"])
        s.commit()
    return job_id


def live(db: str, artifacts: Path, job_id: int, step: int) -> None:
    engine = make_engine(db)
    rep = DbReporter(make_session_factory(engine), job_id, attempt=1, artifact_root=artifacts)
    write_step(rep, step, {"reward/mean": LIVE_REWARD})
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
