"""bench/tlt_run.py on CPU (tiny model, --quick): both modes run the same number of steps in lock-step, paired
rollouts land every K steps, the final policy and drafter are exported, and the verdict flags runs whose mean
response lengths drifted apart (then the step-count ratio is not a TLT figure).

Run: python -m pytest tests/train/test_train_tlt_run.py -q
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_tlt_run", ROOT / "bench" / "tlt_run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_quick_run_writes_table_pairs_and_exports(tmp_path: Path) -> None:
    bench = _load()
    out = tmp_path / "run.md"
    assert bench.main(["--model", "tiny", "--quick", "--out", str(out), "--save-dir", str(tmp_path / "final")]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert len(res["steps"]["off"]) == len(res["steps"]["tlt"]) == 4
    assert [p["step"] for p in res["pairs"]] == [2.0, 4.0]
    for p in res["pairs"]:
        assert p["off_tokens"] > 0 and p["tlt_tokens"] > 0
        assert p["ratio"] == pytest.approx((p["off_s"] / p["off_tokens"]) / (p["tlt_s"] / p["tlt_tokens"]))
        assert p["off_spec_step_fraction"] == 0.0  # the SD-off twin never drafts
        for twin in ("off", "tlt"):  # what the cost model reads: lengths and per-batch-size step costs
            d = p[f"{twin}_detail"]
            assert len(d["lengths"]) == 8 and sum(d["lengths"]) == p[f"{twin}_tokens"]
            assert sum(e for _, _, e in d["steps"]["decode"].values()) + sum(
                e for _, _, e in d["steps"]["spec"].values()) <= p[f"{twin}_tokens"]
        assert p["off_detail"]["steps"]["spec"] == {}
    assert all(r.get("sd/spec_step_fraction", 0.0) == 0.0 for r in res["steps"]["off"])
    v = res["verdict"]
    assert v["ratio_equal_steps"] == pytest.approx(v["off"]["step_s"] / v["tlt"]["step_s"])
    assert v["off"]["steps"] == 4 and not v["diverged"]  # the toy task's lengths hit the same cap in both
    assert (tmp_path / "final/policy/model.safetensors").exists()
    assert (tmp_path / "final/drafter/config.json").exists()
    table = out.read_text()
    assert "whole run, SD off / TLT at equal step count" in table and "paired rollouts" in table
    assert f"{v['ratio_equal_steps']:.2f}x" in table


def _rows(length: float, step_s: float, n: int = 10) -> list[dict[str, float]]:
    return [{"timing_s/step": step_s, "timing_s/gen": step_s / 2, "response_length/mean": length,
             "reward/mean": 0.1 * (i % 2), "actor/entropy": 1.0} for i in range(n)]


def test_verdict_flags_diverged_runs_and_prices_equal_work() -> None:
    bench = _load()
    res = {"args": {"prompts": 2, "samples": 4}, "pairs": [],
           "steps": {"off": _rows(900.0, 4.0), "tlt": _rows(100.0, 1.0)}}
    v = bench.verdict(res, 0.25)
    assert v["diverged"] and v["length_drift"] == pytest.approx(800 / 900)
    assert v["ratio_equal_steps"] == pytest.approx(4.0)  # the 4x comes from shorter responses, not from SD
    assert v["ratio_equal_work"] == pytest.approx((2.0 / 900) / (0.5 / 100))
    res["steps"]["tlt"] = _rows(800.0, 3.0)
    v = bench.verdict(res, 0.25)
    assert not v["diverged"] and v["equal_reward"]
