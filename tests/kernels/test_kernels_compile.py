"""The fused kernels compile for the H200 (sm_90, PDL on) on this CPU-only machine (tests/kernels/compile_launches.py:
Triton's front end and ptxas, no GPU). The interpreter the other kernel tests run in does not type-check: a
loop-carried int32 / int64 mismatch in attention passed every CPU test and failed every GPU run.
Run: python -m pytest tests/kernels/test_kernels_compile.py -q"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {  # case -> kernels its launches compile, in order
    "attention_split": ["_attention_kernel"],
    "attention": ["_attention_kernel"],
    "gemms": ["_linear_residual_kernel"] * 4 + ["_norm_gate_up_kernel"],
    "qkv_norm": ["_qkv_rope_kernel"],
    "qkv_drafter": ["_qkv_rope_kernel"],
    "qkv_qwen3": ["_qkv_rope_kernel"],
    "sampler_bf16": ["_chunk_kernel", "_finish_kernel"] * 3,
    "sampler_fp32": ["_chunk_kernel", "_finish_kernel"] * 3,
    "draft_sample": ["_chunk_kernel", "_merge_kernel", "_q_kernel"] * 3,
    "spec_commit": ["_spec_commit_kernel"] * 2,
}


def test_fused_kernels_compile_for_h200() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "tests/kernels/compile_launches.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        _, case, kernel = line.split()
        got.setdefault(case, []).append(kernel)
    assert got == EXPECTED
