"""Decode at real model shapes: `tlt bench decode` over several architectures in one process, one table.

    python bench/decode_shapes.py --out bench/results/decode_shapes_h200.md --json-out bench/results/decode_shapes_h200.json

Per model (random bf16 weights built on the GPU; SmolLM2-135M's shape included, speed being weight-agnostic) and
batch: the engine's tokens/s and ms per step (prefill counted, 256 new tokens after 64 prompt tokens, T=1, top-k 50),
the GPU time of one graphed step, the roofline (weight + KV bytes per step over the GPU's bandwidth) and the share of
it reached; `--forward both` adds the torch forward's row; HF's static-cache generate at `--peer-batch`; the verify
of 8 tokens per row over a 1-token step at batch 1-8 for `--verify-models`. The table is rewritten after every
model, so a run cut short keeps what it measured. Other flags go to every model's run (`--no-pdl`, `--no-prefetch`,
`--no-tune`, `--cublas-where-faster`: tlt bench decode's kernel switches). `--dry-run`: CPU, tiny shapes, a smoke test.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from worker.tlt.bench_decode import parser, run, table
from worker.tlt.model.roofline import measured_bandwidth

MODELS = "smollm2-135m,qwen2.5-1.5b,llama3.2-3b,qwen2.5-7b,llama3-8b,qwen3-8b"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/decode_shapes_h200.md")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--models", default=MODELS, help="comma-separated shape names")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--forward", choices=["fused", "torch", "both"], default="both")
    ap.add_argument("--peer-batch", default="1,8", help="batches HF's static cache runs ('' for none)")
    ap.add_argument("--verify-models", default="qwen2.5-7b,llama3-8b")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny presets, 4 new tokens")
    a, passed = ap.parse_known_args(argv)  # the rest goes to every model's `tlt bench decode` (e.g. --no-pdl)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # tuning reports its picks
    copy = ""
    if not a.dry_run:
        copy = f", device copy {measured_bandwidth(torch.device('cuda')) / 1e12:.2f} TB/s (read + written)"
    results = []
    t0 = time.perf_counter()
    for name in a.models.split(","):
        argv_one = ["--model", f"shape:{name}", "--batch", a.batch, "--forward", a.forward,
                    "--max-new-tokens", str(a.max_new_tokens)]
        if a.peer_batch:
            argv_one += ["--peer", "hf-static", "--peer-batch", a.peer_batch]
        if name in a.verify_models.split(","):
            argv_one.append("--verify")
        if a.dry_run:
            argv_one += ["--device", "cpu", "--dtype", "float32", "--max-new-tokens", "4", "--prompt-len", "5"]
        one = parser().parse_args(argv_one + passed)
        one.peer_batch = one.peer_batch or one.batch
        results.append(run(one))
        text = f"{results[0]['device']}, bandwidth {results[0]['bandwidth_tbps']:.2f} TB/s " \
               f"({results[0]['bandwidth_source']}){copy}; {time.perf_counter() - t0:.0f} s\n\n{table(results)}\n"
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        Path(a.json_out or str(Path(a.out).with_suffix(".json"))).write_text(json.dumps(results, indent=1, default=str))
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
