"""How close a decode step's GEMMs can come to the HBM limit on this GPU: the bandwidth HBM gives a pure read and a
copy, and cuBLAS's bandwidth on each weight matrix of a named architecture's decode step at M rows, for the weight
as the engine stores it ([N, K], `F.linear`) and transposed ([K, N], `x @ W^T` contiguous). Each GEMM cycles over
enough copies of its weight that none is read from L2 (a real step reads 28+ layers' weights once each).

    python bench/gemv_ceiling.py --model qwen2.5-7b --rows 1,8,64

Then, per M, the GEMM time of one step (every layer's five matrices and the head) at cuBLAS's measured speed and at
the read ceiling, and the tokens/s those bound with nothing else in the step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.tlt.kernels.tuning import time_us  # noqa: E402
from worker.tlt.model.args import ModelArgs, shape  # noqa: E402

L2_BYTES = 50 << 20  # H200: 50 MB of L2; the copies of one matrix together exceed 4x that


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum BLOCK * ITERS elements per program (reads only; one float written per program)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_tbps(x: torch.Tensor) -> float:
    """The best read bandwidth (TB/s) over a few launch shapes of the read kernel on `x` (flat bf16)."""
    n = x.numel()
    best = 0.0
    for block, iters in ((1024, 8), (2048, 8), (4096, 4), (4096, 16), (8192, 8)):
        out = torch.empty(triton.cdiv(n, block * iters), device=x.device, dtype=torch.float32)
        launch = functools.partial(_read_kernel[(out.numel(),)], x, out, n, BLOCK=block, ITERS=iters)
        us = time_us(launch, launches=4, replays=10)
        best = max(best, x.numel() * x.element_size() / us / 1e6)
    return best


def copy_tbps(x: torch.Tensor) -> float:
    y = torch.empty_like(x)
    us = time_us(lambda: y.copy_(x), launches=4, replays=10)
    return 2 * x.numel() * x.element_size() / us / 1e6


def matrices(a: ModelArgs) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count per step) of a decode step's weight matrices."""
    h, d = a.dim, a.hd
    return {"q|k|v": ((a.n_heads + 2 * a.n_kv_heads) * d, h, a.n_layers), "o_proj": (h, a.n_heads * d, a.n_layers),
            "gate|up": (2 * a.intermediate_size, h, a.n_layers), "down": (h, a.intermediate_size, a.n_layers),
            "head": (a.vocab_size, h, 1)}


def gemm_us(n: int, k: int, m: int, transposed: bool, dev: torch.device) -> float:
    """cuBLAS microseconds per x[m, k] @ W^T with W [n, k] bf16 (stored [k, n] when `transposed`), L2-cold."""
    copies = max(2, -(-4 * L2_BYTES // (2 * n * k)))
    ws = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) if transposed
          else torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

    def run() -> None:
        for w in ws:
            _ = x @ w if transposed else F.linear(x, w)

    return time_us(run, launches=2, replays=10) / copies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b", help="a named architecture (model/args.py SHAPES)")
    ap.add_argument("--vocab", type=int, default=49152, help="the head's rows (decode_shapes.py's vocabulary)")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--out", default="bench/results/gemv_ceiling_h200.md")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    args = shape(a.model, vocab_size=a.vocab)
    x = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    read, copy = read_tbps(x), copy_tbps(x)
    del x
    gpu = torch.cuda.get_device_name(dev)
    print(f"{gpu}: read {read:.2f} TB/s, copy {copy:.2f} TB/s", flush=True)
    rows = [int(r) for r in a.rows.split(",")]
    res: dict = {"gpu": gpu, "torch": torch.__version__, "model": a.model, "read_tbps": read, "copy_tbps": copy,
                 "gemms": []}
    for name, (n, k, count) in matrices(args).items():
        for m in rows:
            for transposed in (False, True):
                us = gemm_us(n, k, m, transposed, dev)
                tbps = 2 * n * k / us / 1e6
                res["gemms"].append({"matrix": name, "n": n, "k": k, "count": count, "m": m,
                                     "layout": "[K, N]" if transposed else "[N, K]", "us": us, "tbps": tbps})
                print(f"{name} [{n}x{k}] m={m} {'KN' if transposed else 'NK'}: {us:.1f} us, {tbps:.2f} TB/s",
                      flush=True)
    lines = [f"# GEMV ceiling at {a.model} (vocabulary {a.vocab}) — {gpu}, torch {torch.__version__}, bf16", "",
             f"`python bench/gemv_ceiling.py --model {a.model} --rows {a.rows}`. HBM read (a Triton kernel summing "
             f"1 GiB, best launch shape): **{read:.2f} TB/s**; copy (read + write): {copy:.2f} TB/s; datasheet "
             "4.8 TB/s. cuBLAS per weight matrix, L2-cold (each timed over copies of the weight larger than 4x L2):",
             "", "| matrix | N x K | rows M | layout | us | TB/s | % of read |", "|---|---|---|---|---|---|---|"]
    for g in res["gemms"]:
        lines.append(f"| {g['matrix']} | {g['n']} x {g['k']} | {g['m']} | {g['layout']} | {g['us']:.1f} | "
                     f"{g['tbps']:.2f} | {100 * g['tbps'] / read:.0f}% |")
    lines += ["", "One step's GEMMs (every layer's matrices and the head), best layout per matrix:", "",
              "| rows M | weight GB | cuBLAS ms | at the read ceiling ms | tok/s bound, cuBLAS | tok/s bound, read "
              "ceiling |", "|---|---|---|---|---|---|"]
    for m in rows:
        best: dict[str, float] = {}
        for g in res["gemms"]:
            if g["m"] == m:
                best[g["matrix"]] = min(best.get(g["matrix"], 1e18), g["us"] * g["count"])
        gb = sum(2 * n * k * c for n, k, c in matrices(args).values()) / 1e9
        cublas_ms, ceil_ms = sum(best.values()) / 1e3, gb / read
        res.setdefault("steps", []).append({"m": m, "weight_gb": gb, "cublas_ms": cublas_ms, "ceiling_ms": ceil_ms})
        lines.append(f"| {m} | {gb:.2f} | {cublas_ms:.3f} | {ceil_ms:.3f} | {1e3 * m / cublas_ms:,.0f} | "
                     f"{1e3 * m / ceil_ms:,.0f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
