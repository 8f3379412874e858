"""`tlt bench decode`: decode speed of the engine at a model's real shape, against the memory-bandwidth limit and
HF's static cache in the same process.

    tlt bench decode --model shape:qwen2.5-7b --batch 1,8,64 --peer hf-static --verify
    tlt bench decode --model smollm2-135m-instruct --batch 1 --json

`--model shape:NAME` builds random bf16 weights of a named real architecture (model/args.py SHAPES, or a preset such
as smollm2-135m) on the GPU, no
download (model/random_device.py); any other name loads as `tlt bench` does (builtin, HF dir, .gguf). Each batch
decodes `--max-new-tokens` tokens per row from random prompts of `--prompt-len` tokens (EOS ignored, T=1, top-k 50,
prefill counted, best of two timed runs after graph capture) and prints tokens_per_s, step_ms, replay_ms (GPU time of
one graphed step), roofline_tokens_per_s (weight + KV bytes per step over the GPU's bandwidth, model/roofline.py, at
the mean context) and pct_roofline. `--forward torch` runs the torch forward instead of the fused kernels (`both`:
each). `--no-pdl`, `--no-prefetch`, `--no-tune`, `--cublas-where-faster` set the kernels' KernelConfig for the run.
`--peer hf-static` adds HF transformers' `generate` with a static cache (compiled as transformers does by
default) at the same shape, batch and lengths. `--verify` adds the cost of a chain verify: the cached forward of
k+1 = 8 tokens per row over one of 1 token, both CUDA-graph replays, at batch 1, 2, 4 and 8.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from worker.tlt.bench import bench_decode, make_engine, model_source
from worker.tlt.kernels.settings import KernelConfig, configure
from worker.tlt.kernels.tuning import time_us
from worker.tlt.model.args import SHAPES, ModelArgs, preset
from worker.tlt.model.load import load_model
from worker.tlt.model.random_device import random_on_device
from worker.tlt.model.roofline import gpu_bandwidth, roofline_tokens_per_s
from worker.tlt.model.tokenizer import ByteTokenizer, TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine

log = logging.getLogger(__name__)
VERIFY_BATCHES = (1, 2, 4, 8)
VERIFY_TOKENS = 8  # k + 1: a chain of 7 drafts and its root


def parse_batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--batch needs integers >= 1, got {text!r}")
    return out


def named_args(name: str) -> ModelArgs:
    """A real architecture (SHAPES) or a preset (e.g. smollm2-135m) by name."""
    return SHAPES[name] if name in SHAPES else preset(name)


def build(name: str, device: torch.device, dtype: torch.dtype, max_len: int) -> tuple[Transformer, TokenizerLike]:
    """`shape:NAME` -> random weights on the device; anything else -> load_model."""
    if name.startswith("shape:"):
        args = named_args(name.removeprefix("shape:"))
        return random_on_device(args, device, dtype, max_seq_len=max_len + 16), ByteTokenizer(args.vocab_size)
    model, tok = load_model(model_source(name), device, dtype)
    return model, tok


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_us(fn: Callable[[], object], device: torch.device) -> float:
    """Microseconds per call: CUDA-graph replays on CUDA (kernels/tuning.time_us), wall time elsewhere (smoke runs)."""
    if device.type == "cuda":
        return time_us(fn)
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return 1e6 * (time.perf_counter() - t0) / 3


def forward_call(engine: Engine, batch: int, tokens: int, context: int) -> Callable[[], object]:
    """The engine's cached forward over `tokens` tokens per row of `batch` rows past `context`, as a closure."""
    cols = torch.arange(engine.cache.max_len, device=engine.device)
    ids = torch.zeros(batch, tokens, dtype=torch.int64, device=engine.device)  # [B, S]
    pos = context + torch.arange(tokens, device=engine.device).expand(batch, tokens)  # [B, S]
    mask = cols[: context + tokens][None, None, :] <= pos[:, :, None]  # [B, S, Tk]

    def call() -> object:
        with torch.no_grad():
            return engine.step.forward_hidden(ids, pos, engine.cache, write_idx=pos, attn_mask=mask)

    return call


def forward_us(engine: Engine, batch: int, tokens: int, context: int) -> float:
    """Microseconds of the engine's cached forward over `tokens` tokens per row of `batch` rows past `context`."""
    return gpu_us(forward_call(engine, batch, tokens, context), engine.device)


def verify_cost(model: Transformer, context: int, batches: tuple[int, ...] = VERIFY_BATCHES,
                tokens: int = VERIFY_TOKENS, fused: bool | None = None) -> list[dict[str, Any]]:
    """Per batch: GPU microseconds of the engine's cached forward over 1 and over `tokens` tokens per row at
    `context` cache columns (the verify forward of a chain of tokens - 1 drafts), and their ratio."""
    out = []
    tok = ByteTokenizer(max(model.args.vocab_size, 259))
    for b in batches:
        engine = make_engine(model, tok, context + tokens + 8, b, "off", 0, False, False, 0, fused=fused)
        one, many = forward_us(engine, b, 1, context), forward_us(engine, b, tokens, context)
        out.append({"batch": b, "tokens": tokens, "context": context, "forward_1_us": one,
                    f"forward_{tokens}_us": many, "verify_over_step": many / one})
        engine.release_memory()
        free()
    return out


def hf_static(args: ModelArgs, batch: int, prompt_len: int, max_new: int, device: torch.device, dtype: torch.dtype,
              top_k: int = 50, seed: int = 0) -> dict[str, Any]:
    """HF transformers' generate with a static KV cache at the same shape (random weights; transformers compiles the
    static-cache forward by default): tokens/s of the second of two identical runs, prefill included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**args.to_hf_config())
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.tensor(random_prompts(batch, prompt_len, args.vocab_size, seed), device=device)
    kw: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=True,
              top_k=top_k, temperature=1.0, cache_implementation="static", pad_token_id=0, eos_token_id=None)
    times = []
    for _ in range(2):  # the first run compiles
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, **kw)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    new = (out.shape[1] - prompt_len) * batch
    del hf
    free()
    return {"hf_static_tokens_per_s": new / times[-1], "hf_static_first_s": times[0]}


def kernel_config(a: argparse.Namespace) -> KernelConfig:
    return KernelConfig(pdl=not a.no_pdl, prefetch=not a.no_prefetch, tune=not a.no_tune,
                        cublas_where_faster=a.cublas_where_faster)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every requested measurement of one model -> {"model", "device", "bandwidth", "rows", "verify", "kernels"},
    under the KernelConfig of the flags (the previous one restored after)."""
    previous = configure(kernel_config(a))
    try:
        return measure(a)
    finally:
        configure(previous)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    max_len = a.prompt_len + a.max_new_tokens
    t0 = time.perf_counter()
    model, _ = build(a.model, device, dtype, max_len)
    tok = ByteTokenizer(max(model.args.vocab_size, 259))
    res: dict[str, Any] = {"model": a.model, "build_s": time.perf_counter() - t0, "rows": [], "verify": [],
                           "kernels": asdict(kernel_config(a))}
    on_cuda = device.type == "cuda"
    bw, source = gpu_bandwidth(device, a.bandwidth_tbps) if on_cuda else ((a.bandwidth_tbps or 1.0) * 1e12, "given")
    res.update(device=torch.cuda.get_device_name(device) if on_cuda else "cpu", bandwidth_tbps=bw / 1e12,
               bandwidth_source=source)
    context = a.prompt_len + a.max_new_tokens // 2  # mean cache columns read per step
    choices: dict[str, list[bool | None]] = {"fused": [None], "torch": [False], "both": [None, False]}
    forwards = choices[a.forward]
    for b in a.batch:
        prompts = random_prompts(b, a.prompt_len, model.args.vocab_size, a.seed + b)
        roof = roofline_tokens_per_s(model.args, b, context, bw, dtype_bytes=torch.finfo(dtype).bits // 8)
        for fused in forwards:
            r = bench_decode(model, tok, prompts, a.max_new_tokens, cuda_graphs=on_cuda, top_k=a.top_k, fused=fused)
            free()
            row = {"batch": b, "forward": r["kernel_configs"], "tokens_per_s": r["tokens_per_s"],
                   "step_ms": r["step_ms"], "replay_ms": r["replay_ms"], "roofline_tokens_per_s": roof,
                   "pct_roofline": 100.0 * r["tokens_per_s"] / roof, "prefill_s": r["prefill_s"],
                   "capture_s": r["capture_s"]}
            res["rows"].append(row)
            log.info("%s batch %d: %s", a.model, b, row)
        if a.peer == "hf-static" and b in a.peer_batch:
            try:
                res["rows"][-1].update(hf_static(model.args, b, a.prompt_len, a.max_new_tokens, device, dtype, a.top_k))
            except (RuntimeError, ValueError, ImportError) as e:  # the peer failing costs its column, not our rows
                log.warning("hf-static peer at batch %d failed: %s", b, e)
                res["rows"][-1]["hf_static_error"] = str(e)[:300]
                free()
    if a.verify:
        res["verify"] = [dict(v, forward="torch" if fused is False else "fused")
                         for fused in forwards for v in verify_cost(model, context, fused=fused)]
    del model
    free()
    return res


def table(results: list[dict[str, Any]]) -> str:
    """Markdown rows of several models' results (one header)."""
    head = ("| model | batch | forward | tok/s | ms/step | GPU ms/step | roofline tok/s | % roofline | HF static tok/s |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for res in results:
        for r in res["rows"]:
            hf = r.get("hf_static_tokens_per_s")
            replay = r["replay_ms"]
            lines.append(f"| {res['model']} | {r['batch']} | {r['forward']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['step_ms']:.2f} | {'-' if replay is None else f'{replay:.2f}'} | "
                         f"{r['roofline_tokens_per_s']:,.0f} | {r['pct_roofline']:.0f}% | "
                         f"{'-' if hf is None else f'{hf:,.0f}'} |")
    verify = [(res["model"], v) for res in results for v in res["verify"]]
    if verify:
        lines += ["", "| model | forward | batch | verify of 8 tokens / row (us) | step of 1 (us) | ratio |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {m} | {v.get('forward', 'fused')} | {v['batch']} | {v['forward_8_us']:.0f} | "
                  f"{v['forward_1_us']:.0f} | {v['verify_over_step']:.2f} |" for m, v in verify]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tlt bench decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="shape:NAME (random weights), builtin, HF dir")
    ap.add_argument("--batch", type=parse_batches, default=[1], help="comma-separated batch sizes, e.g. 1,8,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--forward", choices=["fused", "torch", "both"], default="fused",
                    help="fused: the engine's default (fused kernels where they run); torch: the torch forward")
    ap.add_argument("--peer", choices=["none", "hf-static"], default="none")
    ap.add_argument("--peer-batch", type=parse_batches, default=None, help="batches the peer runs (default: all)")
    ap.add_argument("--verify", action="store_true", help="verify-of-8-tokens cost at batch 1, 2, 4, 8")
    # kernel switches (kernels/settings.py KernelConfig), to measure what each part buys
    ap.add_argument("--no-pdl", action="store_true", help="fused kernels without programmatic dependent launch")
    ap.add_argument("--no-prefetch", action="store_true", help="fused kernels without L2 prefetch")
    ap.add_argument("--no-tune", action="store_true", help="no first-use tuning: seeded/cached configs or the rule")
    ap.add_argument("--cublas-where-faster", action="store_true",
                    help="cuBLAS for the linear shapes where tuning measured it faster (rows no longer batch-invariant)")
    ap.add_argument("--bandwidth-tbps", type=float, default=None, help="GPU bandwidth (default: datasheet/measured)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.prompt_len < 1 or a.max_new_tokens < 1:
        ap.error("--prompt-len and --max-new-tokens must be >= 1")
    if a.model.startswith("shape:"):
        try:
            named_args(a.model.removeprefix("shape:"))
        except KeyError as e:
            ap.error(str(e.args[0]))
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("tlt bench decode needs CUDA (pass --device cpu for a smoke test)")
    a.peer_batch = a.peer_batch or a.batch
    res = run(a)
    sys.stdout.write((json.dumps(res, default=str) if a.json else table([res]) + "\n\n" + json.dumps(res, indent=1, default=str)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
