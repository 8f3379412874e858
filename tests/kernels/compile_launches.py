"""Compile the fused kernels' launches for the H200 (sm_90, PDL on) without a GPU: Triton's front end and ptxas run on
CPU. The wrappers are called as the engine calls them, with each @triton.jit kernel swapped for `CompileOnly`.
Must run where TRITON_INTERPRET is unset (the kernels have to be JITFunctions, not interpreted functions):
tests/kernels/test_kernels_compile.py runs it in a subprocess. Prints `compiled <case> <kernel>` per launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from worker.tlt.decoding.row_state import RowState
from worker.tlt.kernels import attention, chain_verify, draft_sample, linear, qkv_rope, sample_commit, spec_commit
from worker.tlt.kernels.common import Config

H200 = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1"}
BF = torch.bfloat16


def _sig(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i64" if abs(v) >= 2**31 else "i32"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v)}")


class CompileOnly:
    """`kernel[grid](...)` compiles the launch for the H200 instead of running it."""

    def __init__(self, kernel: Any, case: list[str]) -> None:
        self.kernel, self.case = kernel, case

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: object, **kw: object) -> None:
            names, params = self.kernel.arg_names, self.kernel.params
            vals = dict(zip(names, args, strict=False)) | {k: v for k, v in kw.items() if k in names}
            sig = {n: "constexpr" if p.is_constexpr else _sig(vals[n]) for n, p in zip(names, params, strict=True)}
            consts = {(i,): vals[n] for i, (n, p) in enumerate(zip(names, params, strict=True)) if p.is_constexpr}
            opts = {k: v for k, v in kw.items() if k not in names}
            triton.compile(ASTSource(self.kernel, sig, consts), target=H200, options=opts)
            print("compiled", self.case[0], self.kernel.fn.__name__, flush=True)

        return launch


def cases() -> dict[str, Callable[[], None]]:
    def attn(cfg: Config) -> Callable[[], None]:
        ck = torch.randn(2, 3, 512, 64, dtype=BF)
        return lambda: attention.cache_attention(torch.randn(2, 9 * 64, dtype=BF), ck, ck.clone(),
                                                 torch.ones(1, 2, 512, dtype=torch.bool), torch.tensor([300, 301]),
                                                 row0=0, config=cfg)

    def gemms() -> None:
        x = torch.randn(1, 576, dtype=BF)
        for early in (False, True):
            linear.linear_residual(x, torch.randn(576, 576, dtype=BF), x, early_residual=early,
                                   config=Config(16, 256, 2, 3))
        linear.linear_residual(x, torch.randn(1024, 576, dtype=BF), None, config=Config(32, 64, 4, 3))
        linear.linear_residual(x, torch.randn(576, 1152, dtype=BF), None,  # an EAGLE-1 fc gathering its embedding
                               gather=(torch.randn(100, 576, dtype=BF), torch.tensor([3])), config=Config(16, 128, 4, 3))
        linear.norm_gate_up(x, torch.randn(576, dtype=BF), torch.randn(2 * 1536, 576, dtype=BF), 1e-5,
                            config=Config(32, 256, 4, 2))

    def qkv(norm: bool, bias: bool, qk_norm: bool, block_n: int) -> Callable[[], None]:
        d, hq, hkv, h = 64, 4, 2, 128
        n = (hq + 2 * hkv) * d
        ck = torch.zeros(2, hkv, 64, d, dtype=BF)
        return lambda: qkv_rope.qkv_rope_cache(
            torch.randn(1, h, dtype=BF), torch.randn(h, dtype=BF) if norm else None, torch.randn(n, h, dtype=BF),
            torch.randn(n, dtype=BF) if bias else None, torch.randn(d, dtype=BF) if qk_norm else None,
            torch.randn(d, dtype=BF) if qk_norm else None, torch.randn(64, d), torch.randn(64, d), torch.tensor([5]),
            torch.tensor([5]), ck, ck.clone(), s=1, row0=0, n_heads=hq, eps=1e-5, config=Config(block_n, 128, 4, 2))

    def sampler(dtype: torch.dtype) -> Callable[[], None]:
        def run() -> None:
            rows = RowState(2, 64, 32, 8, torch.device("cpu"))
            logits, noise = torch.randn(1, 49152, dtype=dtype), torch.rand(1, 49152)
            for temp, top_k in ((0.0, 0), (1.0, 0), (0.7, 50)):
                sample_commit.sample_commit(logits, None if temp == 0 else noise, rows, 1, temp, top_k)

        return run

    def drafts() -> None:
        for dtype in (BF, torch.float32):
            draft_sample.draft_sample(torch.randn(8, 49152, dtype=dtype), torch.rand(8, 49152), 1.0)
        draft_sample.draft_sample(torch.randn(8, 8192, dtype=BF), torch.rand(8, 8192), 1.0,  # a draft vocabulary
                                  vocab=torch.arange(8192), out=torch.zeros(8, 49152))

    def spec_commits() -> None:
        rows = RowState(8, 64, 32, 8, torch.device("cpu"))
        t, n = torch.randint(0, 9, (8, 7)), torch.full((8,), 3)
        for depth in (None, n):  # chain, tree
            spec_commit.spec_commit(t, torch.randn(8, 7), n, n, depth, torch.tensor([8]), rows, 6)

    return {"spec_commit": spec_commits, "attention_split": attn(Config(128, 64, 8, 2, split=128)), "attention": attn(Config(64, 64, 4, 2)),
            "gemms": gemms, "qkv_norm": qkv(True, False, False, 32), "qkv_drafter": qkv(False, False, False, 16),
            "qkv_qwen3": qkv(True, True, True, 64), "sampler_bf16": sampler(BF), "sampler_fp32": sampler(torch.float32), "draft_sample": drafts}


def main() -> None:
    case = [""]
    for mod in (attention, linear, qkv_rope, sample_commit, chain_verify, draft_sample, spec_commit):
        if hasattr(mod, "pdl_args"):
            mod.pdl_args = lambda device, m: {"USE_GDC": True, "launch_pdl": True}  # type: ignore[attr-defined]
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                setattr(mod, name, CompileOnly(obj, case))
    for name, run in cases().items():
        case[0] = name
        run()


if __name__ == "__main__":
    main()
