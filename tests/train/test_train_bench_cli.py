"""bench/train_bench.py and bench/train_curves.py run end to end on CPU (tiny model, --quick): every setting and mode
gets a row, TRL's step time comes from a peers.json and turns into ratio columns; the curves' overlap verdict
separates a curve within seed noise from a shifted one; --profile-update profiles one extra, unaveraged step's update
and its summary counts kernels, GPU busy time (overlaps once) and ranks kernels and host ops.

Run: python -m pytest tests/train/test_train_bench_cli.py -q
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

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
    # per active-batch bucket: off vs TLT tokens/s, and the arms TLT's bandit ran (none = plain decoding)
    tlt_main = res["settings"]["main"]["tlt"]["mean"]
    buckets = [k.rsplit("/", 1)[1] for k in tlt_main if k.startswith("perf/tokens_per_s_bucket/")]
    assert buckets and all(f"| {b} | " in table for b in buckets)
    assert "main: tokens/s per active-batch bucket" in table and "arm, all buckets: " in table
    assert all(f"perf/seq_tokens_per_s_bucket/{b}" in tlt_main for b in buckets) and "TLT / off per sequence" in table


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


@pytest.mark.slow
def test_train_bench_profile_update_is_an_extra_unquoted_step(tmp_path: Path) -> None:
    bench = _load("train_bench")
    out = tmp_path / "train.md"
    argv = ["--model", "tiny", "--quick", "--long-tail-max-new", "0", "--profile-update", "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    off, tlt = res["settings"]["main"]["off"], res["settings"]["main"]["tlt"]
    assert len(off["steps"]) == len(tlt["steps"]) == 2 and off["quoted_steps"] == 1  # the profiled step not averaged
    p = res["update_profile"]
    assert (p["mode"], p["step"], p["cuda"], p["kernels"]) == ("off", 3, False, 0)
    assert p["sequences"] == 8 and p["tokens"] > p["response_tokens"] > 0 and p["wall_s"] > 0
    assert p["step_metrics"]["timing_s/update"] >= p["wall_s"]
    assert p["unprofiled_update_s"] == pytest.approx(off["mean"]["timing_s/update"])
    assert 0 < len(p["top_cpu_ops"]) <= 10 and any(o["name"] == "aten::mm" for o in p["top_cpu_ops"])
    table = out.read_text()
    assert "### Update profile: off, <= 8 new, step 3" in table and "no CUDA" in table


@dataclass
class _Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class _Event:
    name: str
    time_range: _Range
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA


@dataclass
class _Avg:
    key: str
    count: int
    self_cpu_time_total: float


class _FakeProf:
    def events(self) -> list[_Event]:
        long = "void gemm_" + "x" * 100
        return [
            _Event(long, _Range(0, 400)),
            _Event("softmax", _Range(100, 200)),  # overlaps the gemm on another stream: busy counts it once
            _Event(long, _Range(1000, 1400)),
            _Event("Memcpy HtoD (Pageable -> Device)", _Range(1400, 1500)),
            _Event("aten::mm", _Range(0, 50), torch.autograd.DeviceType.CPU),
        ]

    def key_averages(self) -> list[_Avg]:
        return [_Avg("aten::mm", 3, 50.0), _Avg("void gemm_", 2, 0.0), _Avg("cudaLaunchKernel", 40, 900.0)]


def test_profile_summary_counts_kernels_busy_union_and_ranks() -> None:
    bench = _load("train_bench")
    s = bench.profile_summary(_FakeProf())
    assert (s["kernels"], s["copies"]) == (3, 1)
    assert s["kernel_s"] == pytest.approx(900e-6) and s["copy_s"] == pytest.approx(100e-6)
    assert s["gpu_busy_s"] == pytest.approx(900e-6)  # [0, 400] + [1000, 1500]
    top = s["top_kernels"]
    assert [k["count"] for k in top] == [2, 1] and len(top[0]["name"]) == 80 and top[0]["total_ms"] == 0.8
    assert [o["name"] for o in s["top_cpu_ops"]] == ["cudaLaunchKernel", "aten::mm"]  # zero self CPU dropped
    p = {**s, "mode": "off", "max_new_tokens": 8, "step": 3, "wall_s": 0.0018, "cuda": True, "sequences": 8,
         "tokens": 456, "response_tokens": 64, "micro_batches": 1, "unprofiled_update_s": 0.001}
    text = "\n".join(bench.render_profile(p))
    assert "3 kernels" in text and "= 50% of the profiled wall" in text and f"| `{top[0]['name']}` | 2 | 0.80 |" in text
