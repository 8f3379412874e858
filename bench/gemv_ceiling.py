"""How close a decode step's GEMMs can come to the HBM limit on this GPU: the bandwidth of a kernel that only reads,
on 1 GiB and on each weight matrix of a named architecture's decode step (its own size: what one kernel per matrix
can reach), and cuBLAS's bandwidth on each matrix at M rows, for the weight as the engine stores it ([N, K],
`F.linear`) and transposed ([K, N] contiguous, `x @ W`). Each timing cycles over enough copies of its tensor that none
is read from L2 (a real step reads 28+ layers' weights once each).

    python bench/gemv_ceiling.py --model qwen2.5-7b --rows 1,8,64

Then, per M, the GEMM time of one step (every layer's four matrices and the head) at cuBLAS's measured speed and with
every matrix at its read ceiling, and the tokens/s those bound with nothing else in the step.
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


READ_SHAPES = ((1024, 8), (2048, 8), (4096, 4), (4096, 16), (8192, 8), (1024, 2), (2048, 2), (4096, 1))


def read_us(xs: list[torch.Tensor]) -> float:
    """Microseconds per tensor to read each of `xs` (flat bf16, read one after another, as a step reads its
    matrices) with the read kernel's best launch shape."""
    best = float("inf")
    for block, iters in READ_SHAPES:
        launches = []
        for x in xs:
            out = torch.empty(triton.cdiv(x.numel(), block * iters), device=x.device, dtype=torch.float32)
            launches.append(functools.partial(_read_kernel[(out.numel(),)], x, out, x.numel(), BLOCK=block,
                                              ITERS=iters))

        def run(fns: list = launches) -> None:
            for fn in fns:
                fn()

        best = min(best, time_us(run, launches=2, replays=10) / len(xs))
    return best


def cold_copies(numel: int) -> int:
    """How many copies of a `numel` bf16 tensor, read in turn, keep each read out of L2."""
    return max(2, -(-4 * L2_BYTES // (2 * numel)))


def matrices(a: ModelArgs) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count per step) of a decode step's weight matrices."""
    h, d = a.dim, a.hd
    return {"q|k|v": ((a.n_heads + 2 * a.n_kv_heads) * d, h, a.n_layers), "o_proj": (h, a.n_heads * d, a.n_layers),
            "gate|up": (2 * a.intermediate_size, h, a.n_layers), "down": (h, a.intermediate_size, a.n_layers),
            "head": (a.vocab_size, h, 1)}


def gemm_us(n: int, k: int, m: int, transposed: bool, dev: torch.device) -> float:
    """cuBLAS microseconds per x[m, k] @ W^T with W [n, k] bf16 (stored [k, n] when `transposed`), L2-cold."""
    copies = cold_copies(n * k)
    ws = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) if transposed
          else torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

    def run() -> None:
        for w in ws:
            _ = x @ w if transposed else F.linear(x, w)

    return time_us(run, launches=2, replays=10) / copies


def cell(name: str) -> str:
    """A matrix name as a markdown table cell (q|k|v's bars escaped)."""
    return name.replace("|", "\\|")


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
    big = 1 << 29  # 1 GiB of bf16
    read = 2 * big / read_us([torch.empty(big, device=dev, dtype=torch.bfloat16)]) / 1e6
    gpu = torch.cuda.get_device_name(dev)
    print(f"{gpu}: read {read:.2f} TB/s (1 GiB)", flush=True)
    rows = [int(r) for r in a.rows.split(",")]
    res: dict = {"gpu": gpu, "torch": torch.__version__, "model": a.model, "read_tbps": read, "matrices": {},
                 "gemms": []}
    for name, (n, k, count) in matrices(args).items():
        xs = [torch.empty(n * k, device=dev, dtype=torch.bfloat16) for _ in range(cold_copies(n * k))]
        r_us = read_us(xs)
        del xs
        res["matrices"][name] = {"n": n, "k": k, "count": count, "read_us": r_us, "read_tbps": 2 * n * k / r_us / 1e6}
        print(f"{name} [{n}x{k}] read: {r_us:.1f} us, {2 * n * k / r_us / 1e6:.2f} TB/s", flush=True)
        for m in rows:
            for transposed in (False, True):
                us = gemm_us(n, k, m, transposed, dev)
                tbps = 2 * n * k / us / 1e6
                res["gemms"].append({"matrix": name, "m": m, "layout": "[K, N]" if transposed else "[N, K]",
                                     "us": us, "tbps": tbps})
                print(f"{name} m={m} {'KN' if transposed else 'NK'}: {us:.1f} us, {tbps:.2f} TB/s", flush=True)
    mats = res["matrices"]
    lines = [f"# GEMV ceiling at {a.model} (vocabulary {a.vocab}) — {gpu}, torch {torch.__version__}, bf16", "",
             f"`python bench/gemv_ceiling.py --model {a.model} --rows {a.rows}`. HBM read ceiling: a Triton kernel "
             f"that only reads (sums) its input, best of {len(READ_SHAPES)} launch shapes: **{read:.2f} TB/s** on "
             "1 GiB (datasheet 4.8 TB/s), and below on each weight matrix's own size, which is what a kernel per "
             "matrix can reach. Everything L2-cold: each timing cycles over copies of the matrix larger than 4x L2.",
             "", "| matrix | N x K | MB | read us | read TB/s | per step |", "|---|---|---|---|---|---|"]
    for name, v in mats.items():
        lines.append(f"| {cell(name)} | {v['n']} x {v['k']} | {2 * v['n'] * v['k'] / 1e6:.0f} | {v['read_us']:.1f} | "
                     f"{v['read_tbps']:.2f} | {v['count']} |")
    lines += ["", "cuBLAS (`F.linear` on [N, K]; `x @ W` on [K, N] contiguous):", "",
              "| matrix | rows M | layout | us | TB/s | % of this matrix's read |", "|---|---|---|---|---|---|"]
    for g in res["gemms"]:
        lines.append(f"| {cell(g['matrix'])} | {g['m']} | {g['layout']} | {g['us']:.1f} | {g['tbps']:.2f} | "
                     f"{100 * mats[g['matrix']]['read_us'] / g['us']:.0f}% |")
    lines += ["", "One step's GEMMs (every layer's matrices and the head; cuBLAS: the faster layout per matrix):", "",
              "| rows M | weight GB | cuBLAS ms | every matrix at its read ceiling ms | tok/s bound, cuBLAS | "
              "tok/s bound, read ceiling |", "|---|---|---|---|---|---|"]
    gb = sum(2 * v["n"] * v["k"] * v["count"] for v in mats.values()) / 1e9
    ceil_ms = sum(v["read_us"] * v["count"] for v in mats.values()) / 1e3
    for m in rows:
        best: dict[str, float] = {}
        for g in res["gemms"]:
            if g["m"] == m:
                best[g["matrix"]] = min(best.get(g["matrix"], 1e18), g["us"] * mats[g["matrix"]]["count"])
        cublas_ms = sum(best.values()) / 1e3
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
