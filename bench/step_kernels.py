"""Where a cached forward's GPU time goes at a real shape: the kernels of one CUDA-graph replay (torch.profiler /
CUPTI), their summed time against the replay's time, per forward (fused kernels or torch ops), batch, tokens per row
(1: decode; 8: the verify of a chain of 7) and cache context.

    python bench/step_kernels.py --model shape:qwen2.5-7b --cases fused:1:1:192,torch:1:1:192,fused:8:8:192

A case is FORWARD:BATCH:TOKENS:CONTEXT. Prints, per case: replay us (CUDA events over 20 replays), kernel us (sum of
the kernels' durations in one replay), kernels per replay, and the kernels that take the most time. The gap between
replay and kernel time is launch latency and idle SMs between dependent kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.tlt.bench import make_engine  # noqa: E402
from worker.tlt.bench_decode import build, forward_call, free  # noqa: E402
from worker.tlt.kernels.tuning import time_us  # noqa: E402
from worker.tlt.model.tokenizer import ByteTokenizer  # noqa: E402

REPLAYS = 5


def parse_case(text: str) -> tuple[str, int, int, int]:
    fwd, b, s, ctx = text.split(":")
    if fwd not in ("fused", "torch"):
        raise argparse.ArgumentTypeError(f"forward must be fused or torch, got {fwd!r}")
    return fwd, int(b), int(s), int(ctx)


def profile_case(model: Any, fwd: str, batch: int, tokens: int, context: int, top: int) -> dict[str, Any]:
    tok = ByteTokenizer(max(model.args.vocab_size, 259))
    engine = make_engine(model, tok, context + tokens + 8, batch, "off", 0, True, False, 0, fused=fwd == "fused")
    call = forward_call(engine, batch, tokens, context)
    replay_us = time_us(call, launches=1, replays=20)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            per_name[e.name].append(e.time_range.elapsed_us())
    kernel_us = sum(sum(v) for v in per_name.values()) / REPLAYS
    n_kernels = sum(len(v) for v in per_name.values()) / REPLAYS
    rows = sorted(((sum(v) / REPLAYS, len(v) / REPLAYS, name) for name, v in per_name.items()), reverse=True)
    engine.release_memory()
    del graph, engine
    free()
    return {"forward": fwd, "batch": batch, "tokens": tokens, "context": context, "replay_us": replay_us,
            "kernel_us": kernel_us, "kernels": n_kernels,
            "top": [{"us": us, "count": c, "name": name[:90]} for us, c, name in rows[:top]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="shape:qwen2.5-7b")
    ap.add_argument("--cases", type=lambda t: [parse_case(c) for c in t.split(",")], required=True)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    max_ctx = max(c[3] + c[2] for c in a.cases) + 16
    model, _ = build(a.model, torch.device("cuda"), torch.bfloat16, max_ctx)
    results = []
    for fwd, b, s, ctx in a.cases:
        r = profile_case(model, fwd, b, s, ctx, a.top)
        results.append(r)
        print(f"== {a.model} {fwd} batch {b} tokens {s} context {ctx}: replay {r['replay_us']:.0f} us, kernels "
              f"{r['kernel_us']:.0f} us in {r['kernels']:.0f} launches (gap {r['replay_us'] - r['kernel_us']:.0f} us)")
        for t in r["top"]:
            print(f"   {t['us']:8.1f} us  x{t['count']:5.0f}  {t['name']}")
        sys.stdout.flush()
    if a.json_out:
        a.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
