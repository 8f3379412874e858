"""bench/train_bench.py and bench/train_curves.py run end to end on CPU (tiny model, --quick): every setting and mode
gets a row, TRL's step time comes from a peers.json and turns into ratio columns; the curves' overlap verdict
separates a curve within seed noise from a shifted one.

Run: python -m pytest tests/train/test_train_bench_cli.py -q
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_train_bench_quick_table_with_trl_ratio(tmp_path: Path) -> None:
    bench = _load("train_bench")
    (tmp_path / "peers.json").write_text(json.dumps({"trl_grpo": {"step_time_s": [40.0, 20.0, 22.0]}}))
    out = tmp_path / "train.md"
    assert bench.main(["--model", "tiny", "--quick", "--out", str(out)]) == 0  # peers.json found next to --out
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["trl_step_s"] == pytest.approx(21.0)  # steps after the first
    assert set(res["settings"]) == {"main", "long-tail"}
    for runs in res["settings"].values():
        assert set(runs) == {"off", "tlt"}
        for r in runs.values():
            assert len(r["steps"]) == 2 and r["quoted_steps"] == 1
            assert r["mean"]["timing_s/step"] == pytest.approx(r["steps"][1]["timing_s/step"])
        assert runs["off"]["mean"]["sd/on_fraction"] == 0.0 and runs["tlt"]["mean"]["sd/on_fraction"] > 0.0
    table = out.read_text()
    main_off = res["settings"]["main"]["off"]["mean"]["timing_s/step"]
    assert f"{21.0 / main_off:.2f}x" in table  # TRL / ours column
    assert "| long-tail: <= 16 new | tlt (1 steps)" in table and "TRL GRPOTrainer | 21.00" in table


@pytest.mark.slow
def test_train_curves_quick_runs_and_writes_curves(tmp_path: Path) -> None:
    curves = _load("train_curves")
    out = tmp_path / "curves.md"
    assert curves.main(["--model", "tiny", "--quick", "--steps", "2", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert set(res["runs"]) == {"off", "tlt", "off_seed1"}
    assert all(len(r["reward"]) == 2 for r in res["runs"].values())
    assert res["verdict"]["steps"] == 2 and "| 2 |" in out.read_text()


def test_overlap_verdict_separates_noise_from_a_shift() -> None:
    verdict = _load("train_curves").verdict
    rng = random.Random(0)
    trend = [0.1 + 0.01 * i for i in range(30)]
    off, off2, tlt = ([t + rng.gauss(0, 0.03) for t in trend] for _ in range(3))
    same = verdict(off, tlt, off2)
    assert same["overlap"] and same["mean_ok"] and same["spread_ok"]
    shifted = verdict(off, [x + 0.1 for x in tlt], off2)
    assert not shifted["overlap"] and not shifted["mean_ok"]
