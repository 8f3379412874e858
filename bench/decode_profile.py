"""Where batch-1 decode time goes: GPU time of one captured decode step vs the host loop around it, and the number
of kernels one step launches (eager), for our engine on SmolLM2 (forward in fused Triton kernels, or in torch ops
with and without torch.compile).

    python bench/decode_profile.py --out decode_profile.md

If the graph replay alone (GPU time, back-to-back replays timed with CUDA events) is close to the decode loop's
time per token, decode is bound by the kernels inside the graph (their count and size), not by Python.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from worker.tlt.model.load import load_gguf, smollm2_gguf_path
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling

VARIANTS = {  # name -> (fused Triton forward, compile, compile mode)
    "fused": (True, False, None),  # worker/tlt/kernels: 5 kernels per layer
    "fused_compiled": (True, True, None),  # ... and the sampling tail compiled
    "plain": (False, False, None),  # the forward in torch ops (cuBLAS GEMMs, SDPA)
    "compiled": (False, True, None),
    "autotune": (False, True, "max-autotune-no-cudagraphs"),  # inductor's Triton GEMM templates, epilogue fusion
}


def measure(model: Transformer, prompt: list[int], eos: tuple[int, ...], variant: str, steps: int) -> dict:
    fused, compiled, mode = VARIANTS[variant]

    def phase(what: str) -> None:  # progress on stdout: a run cut by its time limit shows where it was
        print(f"[{variant}] {time.strftime('%X')} {what}", flush=True)

    engine = Engine(model, eos_ids=eos, config=EngineConfig(max_len=len(prompt) + steps + 64, max_slots=1,
                                                            compile=compiled, compile_mode=mode, fused_kernels=fused))
    params = RequestSampling(temperature=1.0, top_k=50, max_new_tokens=steps + 32)
    engine.prefill([(0, 0)], [Request(prompt, params)])
    phase("prefilled; capturing")
    for _ in range(3):  # capture (and compile) outside the timings
        engine.decode_step(1).sum()
    torch.cuda.synchronize()
    phase("captured; timing the decode loop")
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.decode_step(1).sum()
    torch.cuda.synchronize()
    loop_ms = (time.perf_counter() - t0) * 1e3 / steps
    tk = engine.state.decode_tk(1, engine.state.active_hi() + 1)
    graphs = engine.graphs
    assert graphs is not None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graphs.run(1, tk, engine.state.mode)
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / steps
    phase(f"loop {loop_ms:.3f} ms/token, replay {replay_ms:.3f} ms; profiling")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # one eager step: what the graph holds
        engine.step(1, tk, engine.state.mode)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    replays = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the kernels inside the replayed graph, timed
        for _ in range(replays):
            graphs.run(1, tk, engine.state.mode)
        torch.cuda.synchronize()
    return {"variant": variant, "loop_ms_per_token": loop_ms, "replay_ms": replay_ms,
            "tokens_per_s": 1e3 / loop_ms, "kernels_per_step": kernels,
            "replay_kernels": kernel_table(prof, replays)}


CATEGORIES = (  # first match wins; by substrings of the kernel name
    ("ours: fused layer kernels", ("_qkv_rope_kernel", "_attention_kernel", "_linear_residual", "_gate_up_kernel")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas", "splitk")),
    ("attention", ("fmha", "flash", "attention", "efficient")),
    ("triton (fused)", ("triton",)),
    ("index / copy", ("index", "copy", "gather", "scatter", "cat", "roll")),
    ("reduce / norm / softmax", ("reduce", "norm", "softmax", "topk", "sort", "argmax", "scan")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_table(prof: profile, steps: int) -> list[dict]:
    """Kernels of `steps` replays grouped by category: count and GPU microseconds per step, plus the top names."""
    groups: dict[str, dict] = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.count == 0:
            continue
        name = e.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        g = groups.setdefault(cat, {"category": cat, "count": 0.0, "us": 0.0, "top": []})
        us = e.device_time_total / steps
        g["count"] += e.count / steps
        g["us"] += us
        g["top"].append((us, e.count / steps, e.key[:90]))
    for g in groups.values():
        g["top"] = sorted(g["top"], reverse=True)[:4]
    return sorted(groups.values(), key=lambda g: -g["us"])


def main() -> None:
    faulthandler.enable()  # a crash in a native library prints where it happened instead of exiting silently
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default="fused,plain,compiled", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default="bench/results/decode_profile_h200.md")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile needs CUDA")
    model, tok = load_gguf(smollm2_gguf_path(), torch.device("cuda"), torch.bfloat16)
    prompt = tok.encode("Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.")
    rows: list[dict] = []
    for v in args.variants.split(","):  # the table is rewritten after each variant: a cut run keeps its rows
        t0 = time.perf_counter()
        rows.append(measure(model, prompt, tuple(tok.eos_ids), v, args.steps))
        rows[-1]["setup_s"] = time.perf_counter() - t0  # capture + compile (+ autotuning)
        text = render(rows)
        Path(args.out).write_text(text)
        Path(args.json_out or str(Path(args.out).with_suffix(".json"))).write_text(json.dumps(rows, indent=1))
    print(text)


def render(rows: list[dict]) -> str:
    lines = [f"Batch-1 decode, SmolLM2-135M bf16, {torch.cuda.get_device_name(0)}, torch {torch.__version__}", "",
             "| step | decode loop ms/token | graph replay ms (GPU) | tok/s | kernels per step (eager) | setup s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['loop_ms_per_token']:.3f} | {r['replay_ms']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['kernels_per_step']} | {r['setup_s']:.0f} |" for r in rows]
    for r in rows:
        lines += ["", f"Kernels inside one replayed step ({r['variant']}), per step:", "",
                  "| category | kernels | GPU us | top kernels (us, count) |", "|---|---|---|---|"]
        lines += [f"| {g['category']} | {g['count']:.0f} | {g['us']:.0f} | "
                  + "; ".join(f"{n} ({us:.0f}, {c:.0f})" for us, c, n in g["top"]) + " |" for g in r["replay_kernels"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
