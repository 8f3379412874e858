"""Time saved by SD: the cost model prices the tail's SD-step tokens at the plain per-sequence rate (the newest one
seen when a step measured none), the rollout metrics carry the tail seconds it needs, and a job with adaptive SD
writes sd/plain_estimate_s, sd/saved_s and the running sd/saved_s_total, and says what SD saved in its closing line.

Run: python -m pytest tests/train/test_train_sd_savings.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.tlt import metric_catalog as mc
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.sd_savings import SdSavings, plain_estimate_s
from worker.tlt.speculative.control.sd_metrics import RolloutSdMetrics
from worker.tlt.train import run


def step_metrics(sd_s: float, sd_rate: float | None, plain_rate: float | None) -> dict[str, float]:
    m = {mc.TAIL_SD_S: sd_s}
    if sd_rate is not None:
        m[mc.SEQ_TOKENS_PER_S_TAIL_SD] = sd_rate
    if plain_rate is not None:
        m[mc.SEQ_TOKENS_PER_S_TAIL_PLAIN] = plain_rate
    return m


def test_plain_estimate_scales_sd_seconds_by_the_speed_ratio() -> None:
    assert plain_estimate_s(2.0, 150.0, 100.0) == pytest.approx(3.0)  # SD 1.5x faster per sequence: 1 s saved
    with pytest.raises(ValueError, match="rates"):
        plain_estimate_s(1.0, 100.0, 0.0)


def test_savings_accumulate_and_reuse_the_newest_plain_rate() -> None:
    s = SdSavings()
    assert s.observe(step_metrics(1.0, 200.0, None)) == {}  # no plain rate measured yet: nothing priced
    assert "no measurable" in s.summary()
    first = s.observe(step_metrics(1.0, 200.0, 100.0))
    assert first[mc.SD_PLAIN_ESTIMATE_S] == pytest.approx(2.0) and first[mc.SD_SAVED_S] == pytest.approx(1.0)
    second = s.observe(step_metrics(2.0, 50.0, None))  # this tail drafted throughout: priced at the last plain rate
    assert second[mc.SD_SAVED_S] == pytest.approx(-1.0)  # SD slower than plain: time lost, shown as negative
    assert second[mc.SD_SAVED_S_TOTAL] == pytest.approx(0.0)
    assert s.observe(step_metrics(0.0, None, 120.0)) == {}  # a step whose tail ran no SD
    assert s.plain_rate == 120.0
    assert s.summary() == "SD saved 0.0 s of tail time over 2 steps (3.0 s with SD vs 3.0 s plain estimate)"


def test_rollout_metrics_report_tail_seconds() -> None:
    m = RolloutSdMetrics(on_below=4)
    m.observe_step(active=8, sd_on=False, arm=None, verify_tokens=1, emitted=8, seconds=0.5)  # full batch
    m.observe_step(active=2, sd_on=True, arm="ngram", verify_tokens=3, emitted=4, seconds=0.25,
                   accepted_per_pos=[1, 1])
    m.observe_step(active=2, sd_on=True, arm="none", verify_tokens=1, emitted=2, seconds=0.125)
    out = m.summary()
    assert out[mc.TAIL_S] == pytest.approx(0.375) and out[mc.TAIL_SD_S] == pytest.approx(0.25)
    assert mc.lookup(mc.TAIL_S) and mc.lookup(mc.SD_SAVED_S_TOTAL).kind == "cumulative"  # type: ignore[union-attr]


def test_job_reports_time_saved(tmp_path: Path, toy_spec) -> None:
    spec = toy_spec({"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 12}, max_steps=4,
                    save_steps=100)
    # adaptive SD over the whole (tiny) batch: the bandit plays n-gram drafts and plain decoding in the same tail
    # (the threshold switch: on CPU the default cost switch rightly keeps SD off, and this test must see it run)
    spec = spec.model_copy(update={
        "rollout": spec.rollout.model_copy(update={"speculative": "adaptive", "sd_on_below": 64,
                                                   "sd_switch": "active_batch"}),
        "drafter": spec.drafter.model_copy(update={"kind": "ngram"}),
    })
    run(spec, tmp_path, FileReporter(tmp_path))
    recs = [r["metrics"] for r in read_metrics(tmp_path)]
    priced = [m for m in recs if mc.SD_SAVED_S in m]
    assert priced, [sorted(m) for m in recs]
    total = 0.0
    for m in priced:
        assert m[mc.SD_SAVED_S] == pytest.approx(m[mc.SD_PLAIN_ESTIMATE_S] - m[mc.TAIL_SD_S])
        total += m[mc.SD_SAVED_S]
        assert m[mc.SD_SAVED_S_TOTAL] == pytest.approx(total)
    closing = (tmp_path / "train.log").read_text().splitlines()[-1]
    found = re.search(r"done: 4 steps; SD saved (-?[\d.]+) s of tail time over (\d+) steps", closing)
    assert found, closing
    assert float(found[1]) == pytest.approx(total, abs=0.06) and int(found[2]) == len(priced)
