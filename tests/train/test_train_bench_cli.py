"""bench/train_bench.py and bench/train_curves.py run end to end on CPU (tiny model, --quick): every setting and mode
gets a row, TRL's step time comes from a peers.json and turns into ratio columns; the curves' overlap verdict
separates a curve within seed noise from a shifted one; --profile-update profiles one extra, unaveraged step's update
and its summary counts kernels, GPU busy time (overlaps once) and ranks kernels and host ops. bench/tlt_run.py
(tiny model, --quick): both modes run the same number of steps in lock-step, paired rollouts land every K steps, the
final policy and drafter are exported, and the verdict flags runs whose mean response lengths drifted apart.
bench/tlt_projection.py: the cost model's arithmetic and an end-to-end run on a synthetic tlt_run JSON whose
measured seconds it must reproduce exactly.

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


@pytest.mark.slow
def test_quick_run_writes_table_pairs_and_exports(tmp_path: Path) -> None:
    bench = _load("tlt_run")
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
    bench = _load("tlt_run")
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
