"""Launch rules: the default rule prefetches weight rows only for matrices that fit the L2 budget, and tuning offers
the other choice once. (Which forward a model takes: tests/kernels/test_kernels_gemm_forward.py.)
Run: python -m pytest tests/kernels/test_kernels_routing.py -q"""

from __future__ import annotations

from worker.tlt.kernels.common import PREFETCH_MAX_BYTES, default_config
from worker.tlt.kernels.tuning import candidates


def test_prefetch_only_for_matrices_that_fit_the_budget() -> None:
    assert default_config("linear_residual", 576, 1536).prefetch  # SmolLM2's down
    assert default_config("linear_residual", 3584, 3584).prefetch  # Qwen2.5-7B's o_proj: 26 MB
    assert not default_config("norm_gate_up", 18944, 3584).prefetch  # its gate|up: 272 MB
    assert not default_config("linear_residual", 3584, 18944).prefetch
    half = PREFETCH_MAX_BYTES // 4  # bf16 elements of half the budget
    assert default_config("norm_gate_up", half // 1024, 1024).prefetch
    assert not default_config("norm_gate_up", 2 * half // 1024, 1024).prefetch
    cands = candidates("norm_gate_up", 18944, 3584)  # the rule's choice everywhere but one: the other choice
    assert [c.prefetch for c in cands].count(True) == 1
