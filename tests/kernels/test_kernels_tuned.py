"""Launch configs per (GPU, weight shape) (kernels/tuning.py) and the kernel switches (kernels/settings.py): a GPU's
file is read over the seeds and written back as tuned; shapes nobody tuned get the default rule; off CUDA the rule
always; the switches change the launch kwargs without any environment variable.
Run: python -m pytest tests/kernels/test_kernels_tuned.py -q"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.tlt.kernels import common, tuning
from worker.tlt.kernels.common import Config, default_config
from worker.tlt.kernels.settings import KernelConfig, configure, current


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    previous = configure(KernelConfig(cache_dir=tmp_path))
    tuning.forget()
    yield tmp_path
    configure(previous)
    tuning.forget()


def test_file_entries_override_seeds_and_round_trip(cache_dir: Path) -> None:
    gpu = "NVIDIA H200"
    seeded = tuning.table(gpu)
    assert seeded.configs[("qkv_rope", 960, 576)] == Config(32, 256, 4, 3)  # SmolLM2's sweep winner, no file needed
    assert not seeded.path.exists() and seeded.path == cache_dir / "NVIDIA_H200.json"
    mine = Config(64, 128, num_warps=8, num_stages=4)
    seeded.configs[("linear_residual", 3584, 18944)] = mine
    seeded.torch_faster.add(("linear_residual", 49152, 3584))
    seeded.save()
    tuning.forget()
    again = tuning.table(gpu)
    assert again.configs[("linear_residual", 3584, 18944)] == mine
    assert again.torch_faster == {("linear_residual", 49152, 3584)}
    assert again.configs[("qkv_rope", 960, 576)] == Config(32, 256, 4, 3)
    data = json.loads(again.path.read_text())
    assert data["configs"]["linear_residual,3584,18944"] == [64, 128, 8, 4, 0, True]
    other = tuning.table("Some Other GPU")
    assert other.configs == {} and other.path.name == "Some_Other_GPU.json"


def test_a_file_is_read_from_the_configured_directory(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "GPU_A.json").write_text(json.dumps({"configs": {"attention,4,128": [32, 128, 2, 3, 128],
                                                                   "qkv_rope,64,32": [16, 32, 4, 2, 0, False]}}))
    assert ("attention", 4, 128) not in tuning.table("GPU A").configs
    configure(KernelConfig(cache_dir=elsewhere))  # a new directory is noticed without forget()
    served = tuning.table("GPU A").configs
    assert served[("attention", 4, 128)] == Config(32, 128, 2, 3, 128, prefetch=True)  # a file without the field
    assert served[("qkv_rope", 64, 32)] == Config(16, 32, 4, 2, prefetch=False)


def test_off_cuda_the_default_rule_and_no_tuning(cache_dir: Path) -> None:
    calls: list[Config] = []
    cfg = tuning.config_for("linear_residual", 3584, 18944, torch.device("cpu"), launch=calls.append)
    assert cfg == default_config("linear_residual", 3584, 18944) and calls == []
    assert not tuning.prefers_torch("linear_residual", 49152, 3584, torch.device("cpu"))
    assert "default rule" in tuning.describe(torch.device("cpu"))


@pytest.mark.parametrize("kernel, n, k", [("linear_residual", 3584, 18944), ("norm_gate_up", 18944, 3584),
                                           ("qkv_rope", 4608, 3584), ("attention", 7, 128), ("linear_residual", 64, 32)])
def test_candidates_start_with_the_rule_and_fit_the_shape(kernel: str, n: int, k: int) -> None:
    cands = tuning.candidates(kernel, n, k)
    assert cands[0] == default_config(kernel, n, k) and len(set(cands)) == len(cands) >= 2
    assert all(c.block_k <= max(16, 1 << (k - 1).bit_length()) for c in cands)


def test_switches_reach_the_launch_kwargs_without_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "_pdl_supported", lambda device: True)
    dev = torch.device("cuda")
    previous = configure(KernelConfig())
    try:
        assert common.pdl_args(dev, 1) == {"USE_GDC": True, "launch_pdl": True}
        assert common.pdl_args(dev, 33) == {"USE_GDC": False}  # above pdl_max_tokens
        configure(KernelConfig(pdl=False))
        assert common.pdl_args(dev, 1) == {"USE_GDC": False}
        w = torch.empty(4, 1024, dtype=torch.bfloat16)
        assert common.prefetch_lines(1024, w) == (16, 64)
        configure(KernelConfig(prefetch=False))
        assert common.prefetch_lines(1024, w) == (0, 64) and not current().prefetch
    finally:
        configure(previous)
    with pytest.raises(ValueError):
        KernelConfig(pdl_max_tokens=-1)


def test_tuning_keeps_the_fastest_candidate_and_marks_cublas_only_by_margin(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "time_us", lambda fn: fn())  # a launch returns its own cost in us
    key = ("linear_residual", 3584, 18944)
    cands = tuning.candidates(*key)
    costs = {c: 50.0 + i for i, c in enumerate(cands)}
    costs[cands[3]] = 30.0
    tab = tuning.table("GPU T")
    assert tuning.tune(tab, key, costs.__getitem__, lambda: 28.0) == cands[3]
    assert key not in tab.torch_faster  # 28 > 0.9 x 30: within the margin, the kernel stays
    key2 = ("linear_residual", 49152, 3584)
    tuning.tune(tab, key2, lambda c: 100.0, lambda: 80.0)
    assert key2 in tab.torch_faster
    tuning.forget()
    again = tuning.table("GPU T")  # written to the file as it was tuned
    assert again.configs[key] == cands[3] and again.torch_faster == {key2}
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU T")
    assert not tuning.prefers_torch(*key2, cuda)  # cuBLAS only when the KernelConfig allows it
    configure(KernelConfig(cache_dir=cache_dir, cublas_where_faster=True))
    assert tuning.prefers_torch(*key2, cuda) and not tuning.prefers_torch(*key, cuda)


def test_an_unreadable_file_is_ignored_and_replaced(cache_dir: Path) -> None:
    (cache_dir / "GPU_C.json").write_text('{"configs": {"attention,4,128": [32, 1')  # cut short by a crash
    tab = tuning.table("GPU C")
    assert tab.configs == {}
    tab.configs[("attention", 4, 128)] = Config(64, 128, 4, 2, 64)
    tab.save()
    assert [p.name for p in cache_dir.iterdir()] == ["GPU_C.json"]  # no temporary left behind
    tuning.forget()
    assert tuning.table("GPU C").configs == {("attention", 4, 128): Config(64, 128, 4, 2, 64)}


def test_a_candidate_the_gpu_cannot_launch_is_skipped(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """H100 has less shared memory per block than the widest candidate tile asks: tuning keeps the ones that launch,
    and says so when none does."""
    from triton.runtime.errors import OutOfResources

    def cost(c: Config) -> float:
        if c == cands[0]:
            raise OutOfResources(245760, 232448, "shared memory")
        return 40.0 + cands.index(c)

    monkeypatch.setattr(tuning, "time_us", lambda fn: fn())
    key = ("linear_residual", 576, 576)
    cands = tuning.candidates(*key)
    assert tuning.tune(tuning.table("GPU T"), key, cost, None) == cands[1]

    def never(c: Config) -> float:
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(RuntimeError, match="no launch config"):
        tuning.tune(tuning.table("GPU T"), ("linear_residual", 64, 64), never, None)
