"""bench/tlt_run.py on CPU (tiny model, --quick): both modes run the same number of steps in lock-step, paired
rollouts land every K steps, the final policy and drafter are exported, and the verdict flags runs whose mean
response lengths drifted apart (then the step-count ratio is not a TLT figure). bench/tlt_projection.py: the cost
model's arithmetic (step costs interpolated by batch size, a rollout's seconds from its lengths with SD in the tail
where it pays) and an end-to-end run on a synthetic tlt_run JSON whose measured seconds it must reproduce exactly.

Run: python -m pytest tests/train/test_train_tlt_run.py -q
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str = "tlt_run") -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
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


def test_interpolation_and_rollout_seconds() -> None:
    m = _load("tlt_projection")
    cost = m.interpolate({1: 1.0, 4: 3.0})
    assert cost(1) == 1.0 and cost(4) == 3.0 and cost(2) == pytest.approx(2.0)  # halfway in log B
    assert cost(8) == pytest.approx(6.0)  # above the largest measured size: proportional to B
    # lengths 1, 3, 3: the prefill emits every first token, then two plain steps at B=2
    assert m.rollout_seconds([1, 3, 3], cost, None, 1.0, on_below=4, prefill_s=0.5) == pytest.approx(0.5 + 2 * 2.0)
    # SD (tau 2, cost 2.5 < 2 x c_plain) below 4 active: one SD step does the same work
    assert m.rollout_seconds([1, 3, 3], cost, lambda b: 2.5, 2.0, on_below=4) == pytest.approx(2.5)
    # where SD does not pay (cost / tau >= c_plain) the switch keeps plain decoding
    assert m.rollout_seconds([1, 3, 3], cost, lambda b: 5.0, 2.0, on_below=4) == pytest.approx(4.0)


def test_main_validates_and_projects(tmp_path: Path) -> None:
    m = _load("tlt_projection")
    # one paired rollout: 4 sequences of 3, 3, 5, 5 tokens; plain steps cost 0.1 s at 4 active, 0.05 s at 2
    off = {"lengths": [3, 3, 5, 5], "prefill_s": 0.2, "accept_rate_pos": [],
           "steps": {"decode": {"4": [2, 0.2, 8], "2": [2, 0.1, 4]}, "spec": {}}}
    tlt = {"lengths": [3, 3, 5, 5], "prefill_s": 0.2, "accept_rate_pos": [1.0],
           "steps": {"decode": {"4": [2, 0.2, 8]}, "spec": {"2": [1, 0.08, 4]}}}
    run = {"device": "test", "pairs": [{"step": 10, "off_s": 0.5, "tlt_s": 0.48, "off_detail": off,
                                        "tlt_detail": tlt}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    out = tmp_path / "proj.md"
    assert m.main(["--run", str(path), "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    errors = {r["twin"]: r["error"] for r in res["validation"]}
    assert errors["SD off"] == pytest.approx(0.0, abs=1e-9)  # 0.2 + 2 x 0.1 + 2 x 0.05
    assert errors["TLT"] == pytest.approx(0.0, abs=1e-9)  # 0.2 + 2 x 0.1 + one SD step (tau 2) of 0.08
    ratios = {(r["shape"], r["acceptance"]): r["ratio"] for r in res["projection"]}
    # SD only where a step pays: never much slower than SD off (the switch is per step, greedy, as the engine's is)
    assert len(ratios) == 15 and all(r >= 0.99 for r in ratios.values())
    assert ratios[("shape:qwen2.5-7b", 0.9)] > ratios[("shape:qwen2.5-7b", 0.5)]
    table = out.read_text()
    assert "PROJECTION (not measured)" in table and "1 of 2 within 10%" not in table and "2 of 2 within 10%" in table
