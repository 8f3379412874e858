"""bench/spec_profile.py runs end to end on CPU (tiny random target, random EAGLE-1 drafter): SD off and chain SD,
phases per step, a profiler window, one markdown table + JSON.

Run: python -m pytest tests/drafter/test_spec_profile_smoke.py -x -q
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "spec_profile.py"


def test_tiny_cpu_run_reports_phases_and_positive_walls(tmp_path: Path) -> None:
    main = runpy.run_path(str(BENCH), run_name="spec_profile_bench")["main"]
    md, js = tmp_path / "sp.md", tmp_path / "sp.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--model", "tiny", "--device", "cpu", "--batch", "4", "--new-tokens", "32",
                     "--profile-steps", "2", "--out", str(md), "--json-out", str(js)]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench pins one thread on CPU; leave the session as it was
    res = json.loads(js.read_text())
    off, sd = res["arms"]
    assert (off["arm"], sd["arm"]) == ("SD off", "chain SD")
    for arm in (off, sd):
        assert arm["clean"]["steps"] > 0 and arm["clean"]["wall_ms_per_step"] > 0
        assert arm["instrumented"]["wall_ms_per_step"] > 0
        assert arm["profile"]["steps"] == 2 and arm["profile"]["top_cpu_ops"]
    assert off["instrumented"]["phases"]["decode"]["host_ms"] > 0
    phases = sd["instrumented"]["phases"]
    for key in ("step", "step/propose", "step/verify (eager)", "step/hidden hook", "engine.sync"):
        assert phases[key]["host_ms"] > 0, key
    # children nest inside their parent: a step's parts cannot take longer than the step
    assert phases["step/propose"]["host_ms"] + phases["step/verify (eager)"]["host_ms"] <= phases["step"]["host_ms"]
    assert phases["step/propose/pack (host)"]["calls"] == 1.0  # one host pack per draft
    assert set(sd["profile"]["ranges"]) >= {"step", "step/propose", "step/verify (eager)"}
    text = md.read_text()
    assert "| arm | phase | ms per step (host) |" in text and "Top CUDA kernels by self time" in text


def test_draft_vocab_run_reports_its_coverage(tmp_path: Path) -> None:
    main = runpy.run_path(str(BENCH), run_name="spec_profile_bench")["main"]
    md, js = tmp_path / "sp.md", tmp_path / "sp.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--model", "tiny", "--device", "cpu", "--batch", "2", "--new-tokens", "16", "--profile-steps",
                     "1", "--draft-vocab", "40", "--vocab-prompts", "4", "--out", str(md), "--json-out", str(js)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(js.read_text())
    assert res["draft_vocab"] == 40
    for arm in res["arms"]:
        assert 0.0 < arm["clean"]["vocab_coverage"] < 1.0
    assert "Draft vocabulary: 40 tokens" in md.read_text()
