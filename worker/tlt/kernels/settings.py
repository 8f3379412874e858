"""`KernelConfig`: the switches of the fused kernels (programmatic dependent launch, L2 prefetch, the fused
sampler's batch limit, launch-config tuning at first use), one frozen dataclass read by the kernels at launch time.

Nothing here reads the environment: a benchmark or an application maps its own flags onto a KernelConfig and calls
`configure(cfg)` once (it returns the previous one, so a test can restore it); the kernels read `current()`. The
defaults are what the engine runs with; the switches exist so that a benchmark can measure what each part buys.
Tests: `python -m pytest tests/kernels/test_kernels_settings.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelConfig:
    # programmatic dependent launch on sm_90+ where Triton has it (kernels/common.py explains what it overlaps)
    pdl: bool = True
    # PDL only for calls of at most this many tokens: it pays at decode sizes and cost ~5% at 64 tokens (H200,
    # SmolLM2: larger grids, whose early-scheduled programs only wait)
    pdl_max_tokens: int = 32
    # prefetch weight rows (attention: K/V lines) into L2 before the PDL wait
    prefetch: bool = True
    # rows the fused sampler takes (more: the torch path); no limit by default: H200, SmolLM2, top-k 50, batch 64
    # decoded 47,528 tok/s with the kernels vs 41,416 with torch.topk's path
    sampler_max_batch: int = 1 << 30
    # time launch-config candidates at a weight shape's first use on CUDA and keep the winner on disk
    # (kernels/tuning.py); False: seeded or cached configs, else the default rule
    tune: bool = True
    # run cuBLAS for the linear_residual shapes where tuning measured it faster; off: the fused kernel everywhere,
    # whose rows are bit-identical at any batch (a verify and a decode round alike: greedy SD token-identical in bf16)
    cublas_where_faster: bool = False
    # kernels/gemm_forward.py: run every cuBLAS GEMM of a call of up to this many rows at exactly this many, so that
    # a row's result does not depend on the call (greedy SD token-identical to plain greedy in bf16); 0: off, each
    # call at its own M (faster: a decode GEMV reads no padding)
    gemm_pad_rows: int = 0
    # where tuned configs live, one JSON file per GPU name; None: ~/.cache/tlt/kernels
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if min(self.pdl_max_tokens, self.sampler_max_batch, self.gemm_pad_rows) < 0:
            raise ValueError("pdl_max_tokens, sampler_max_batch and gemm_pad_rows must be >= 0")

    @property
    def tuning_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else Path.home() / ".cache" / "tlt" / "kernels"


_current = KernelConfig()


def current() -> KernelConfig:
    """The switches the kernels launch with now."""
    return _current


def configure(cfg: KernelConfig) -> KernelConfig:
    """Make `cfg` the kernels' switches for this process -> the previous ones."""
    global _current
    previous, _current = _current, cfg
    return previous
