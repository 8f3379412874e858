"""Rollouts at reasoning-RL lengths: the row KV layout against the paged one at the same KV memory, one table.

    python bench/rollout_long.py --models qwen2.5-7b --max-len 16384 --out bench/results/rollout_long_h200.md
    python bench/rollout_long.py --quick          # CPU, a tiny model: a smoke test of the whole script

Per model (random bf16 weights at the real shape, built on the GPU) and layout (rows of max_len columns; pages of
each `--page-sizes`): `--requests` requests of `--prompt-len` tokens whose new-token counts follow a long tail
(exponential with mean max_new / `--tail-mean-div`, capped at max_new, the longest few at the cap), forced per request
(no EOS: every layout decodes exactly the same tokens), greedy. Reported: the rows the KV memory holds (rows: slots;
paged: the peak of active sequences reached), rollout seconds, tokens/s, preemptions, the KV memory lost to
fragmentation at the pool's fullest (pages held less columns in use), and the roofline: the seconds the decode steps
would take at the GPU's bandwidth reading, per step, every weight once and the K/V columns each row attends (summed
per sequence, the same whatever the schedule), and the share of it reached (prefill not counted in the roofline).
Then decode alone at batch `--decode-batch` with contexts `--decode-contexts` (rows set to that length directly,
their K/V left as allocated: speed does not depend on its values), against the same roofline.

Each row of the table is written as soon as it is measured; `--append` adds a run's rows to those of earlier runs
(the same `--json-out`), so one table can come from several runs that each fit a time limit:

    python bench/rollout_long.py --models qwen2.5-7b --max-len 16384 --decode-contexts '' --json-out J --out M
    python bench/rollout_long.py --models qwen2.5-1.5b --max-len 32768 --decode-contexts '' --append --json-out J ...
    python bench/rollout_long.py --models qwen2.5-7b --no-rollout --append --json-out J --out M

The KV memory is `--kv-gb`, or what the device has free after the weights less the engine's working memory
(model/memory_plan.py), for every layout alike. The markdown table (`--out`) and JSON (`--json-out`) are rewritten
after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.tlt.bench_decode import named_args
from worker.tlt.decoding.kv_cache import bytes_per_token
from worker.tlt.model.args import ModelArgs, preset
from worker.tlt.model.memory_plan import working_bytes
from worker.tlt.model.random_device import random_on_device
from worker.tlt.model.roofline import gpu_bandwidth, weight_bytes
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling


def tail_lengths(n: int, max_new: int, mean_div: float, seed: int) -> list[int]:
    """New-token counts with a long tail: exponential of mean max_new / mean_div, at least 16, capped at max_new."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.exponential(max_new / mean_div, n).astype(np.int64), 16, max_new).tolist()


def requests_for(n: int, prompt_len: int, max_new: int, mean_div: float, vocab: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (n, prompt_len), generator=g).tolist()
    return [Request(p, RequestSampling(temperature=0.0, max_new_tokens=k))
            for p, k in zip(prompts, tail_lengths(n, max_new, mean_div, seed), strict=True)]


def kv_read_bytes(args: ModelArgs, reqs: list[Request], dtype_bytes: int) -> int:
    """K/V bytes the decode steps of these forced lengths read: the step emitting token j of a sequence attends its
    prompt and j earlier tokens."""
    per_col = bytes_per_token(args, torch.bfloat16) * dtype_bytes // 2
    cols = sum(len(r.prompt) * (r.params.max_new_tokens - 1) + (r.params.max_new_tokens - 1) * r.params.max_new_tokens
               // 2 for r in reqs)
    return cols * per_col


def engine_config(a: argparse.Namespace, max_len: int, kv_bytes: int, bpt: int, page: int | None,
                  slots_cap: int) -> EngineConfig:
    common: dict[str, Any] = dict(max_len=max_len, attn_bucket=a.attn_bucket, fused_max_seqs=a.fused_max_seqs,
                                  cuda_graphs=not a.quick, sync_every=a.sync_every, prefill_tokens=a.prefill_tokens)
    t = -(-(max_len + 3) // 64) * 64  # the engine's columns per row (plain decoding's headroom, rounded)
    if page is None:
        return EngineConfig(max_slots=max(1, min(kv_bytes // (t * bpt), slots_cap)), **common)
    return EngineConfig(max_slots=slots_cap, page_size=page, kv_pages=max(2, kv_bytes // (page * bpt)), **common)


def rollout_row(a: argparse.Namespace, model: Transformer, name: str, max_len: int, page: int | None,
                kv_bytes: int, bw: float) -> dict[str, Any]:
    args = model.args
    reqs = requests_for(a.requests, a.prompt_len, max_len - a.prompt_len, a.tail_mean_div, args.vocab_size, a.seed)
    dtype_bytes = model.head_weight.element_size()
    bpt = bytes_per_token(args, model.head_weight.dtype)
    cfg = engine_config(a, max_len, kv_bytes, bpt, page, min(a.requests, a.max_slots))
    engine = Engine(model, eos_ids=(), config=cfg)
    frag = FragmentationProbe(engine)
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    decode_steps = [s for s in out.steps if s.kind == "decode"]
    roof = (len(decode_steps) * weight_bytes(args, dtype_bytes) + kv_read_bytes(args, reqs, dtype_bytes)) / bw
    want = [r.params.max_new_tokens for r in reqs]
    assert [len(s.tokens) for s in out.sequences] == want, "forced lengths not decoded"
    row = {"model": name, "max_len": max_len, "layout": "rows" if page is None else f"paged {page}",
           "kv_gib": engine.cache.nbytes / 2**30, "rows_held": engine.slots,
           "concurrency": max((s.active for s in decode_steps), default=0), "seconds": secs, "tokens": out.tokens,
           "tok_s": out.tokens / secs, "preemptions": engine.preemptions, "fragmentation": frag.worst,
           "decode_steps": len(decode_steps), "roofline_s": roof, "roofline_share": roof / secs}
    del engine
    release()
    return row


class FragmentationProbe:
    """The share of the KV pool's held columns not in use (the lookahead and each row's last partial page), taken
    when the most pages are held, sampled at every sync of the engine."""

    def __init__(self, engine: Engine) -> None:
        self.worst, self._peak = 0.0, 0
        pool = engine.state.pages
        if pool is None:
            return
        state, sync = engine.state, engine.sync

        def probed(*args: Any, **kw: Any) -> None:
            used = pool.usable - pool.free
            if used >= self._peak and used:
                n = state.n_active
                live = int(np.minimum(state.row_hi[:n], pool.held[:n] * pool.page_size).sum())
                self._peak, self.worst = used, max(0.0, 1.0 - live / (used * pool.page_size))
            sync(*args, **kw)

        engine.sync = probed  # type: ignore[method-assign]


def decode_row(a: argparse.Namespace, model: Transformer, name: str, ctx: int, page: int | None,
               bw: float) -> dict[str, Any]:
    """Plain decode of `--decode-batch` rows already `ctx` long: tokens/s over `--decode-steps` graphed steps."""
    args, batch, steps = model.args, a.decode_batch, a.decode_steps
    bpt = bytes_per_token(args, model.head_weight.dtype)
    max_len = ctx + steps + 16
    kv = batch * (max_len + 64) * bpt
    cfg = engine_config(a, max_len, kv + (page or 0) * bpt * (batch + 2), bpt, page, batch)
    engine = Engine(model, eos_ids=(), config=cfg)
    s, st = engine.state, engine.state.rows
    sampling = RequestSampling(temperature=0.0, max_new_tokens=steps + 8)
    st.lens[:batch], st.prompt_len[:batch], st.max_new[:batch] = ctx, ctx, steps + 8
    st.n_gen[:batch], st.temp[:batch], st.done[:batch] = 1, 0.0, False
    s.histories = {i: [[0] * ctx] for i in range(batch)}
    s.row_seq, s.row_sampling = [(i, 0) for i in range(batch)], [sampling] * batch
    s.row_hi[:batch], s.row_cap[:batch], s.row_plen[:batch] = ctx, ctx + steps + 8, ctx
    s.n_active = batch
    if s.pages is not None:
        for r in range(batch):
            assert s.pages.grow(r, ctx + steps + 8)
        s.flush_table()
    s.rows_changed()
    bucket = s.bucket(batch)
    for _ in range(3):  # capture and warm up
        engine.decode_step(bucket)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.decode_step(bucket)
    sync()
    per_step = (time.perf_counter() - t0) / steps
    dtype_bytes = model.head_weight.element_size()
    roof_step = (weight_bytes(args, dtype_bytes) + batch * ctx * bpt) / bw
    del engine
    release()
    return {"model": name, "layout": "rows" if page is None else f"paged {page}", "batch": batch, "context": ctx,
            "ms_step": per_step * 1e3, "tok_s": batch / per_step, "roofline_tok_s": batch / roof_step,
            "roofline_share": roof_step / per_step}


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kv_budget(a: argparse.Namespace, args: ModelArgs, device: torch.device) -> int:
    if a.kv_gb is not None:
        return int(a.kv_gb * 2**30)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.9) - working_bytes(args, a.max_slots, a.prefill_tokens, 2)


def markdown(head: str, rollouts: list[dict[str, Any]], decodes: list[dict[str, Any]]) -> str:
    lines = [head, "", "| model | max len | layout | KV GiB | rows held | concurrency | rollout s | tokens | tok/s | "
             "preempted | fragmentation | roofline s | of roofline |", "|" + "---|" * 13]
    for r in rollouts:
        lines.append(f"| {r['model']} | {r['max_len']} | {r['layout']} | {r['kv_gib']:.1f} | {r['rows_held']} | "
                     f"{r['concurrency']} | {r['seconds']:.1f} | {r['tokens']} | {r['tok_s']:.0f} | "
                     f"{r['preemptions']} | {100 * r['fragmentation']:.1f}% | {r['roofline_s']:.1f} | "
                     f"{100 * r['roofline_share']:.0f}% |")
    if decodes:
        lines += ["", "| model | layout | batch | context | ms/step | tok/s | roofline tok/s | of roofline |",
                  "|" + "---|" * 8]
        for d in decodes:
            lines.append(f"| {d['model']} | {d['layout']} | {d['batch']} | {d['context']} | {d['ms_step']:.2f} | "
                         f"{d['tok_s']:.0f} | {d['roofline_tok_s']:.0f} | {100 * d['roofline_share']:.0f}% |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-7b,qwen2.5-1.5b")
    ap.add_argument("--max-len", default="16384", help="max_len per model, comma-separated (one: every model)")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tail-mean-div", type=float, default=4.0, help="mean new tokens = max_new / this")
    ap.add_argument("--page-sizes", default="64", help="paged layouts to run beside rows ('' for rows only)")
    ap.add_argument("--no-rows", action="store_true", help="skip the row layout")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV memory of every layout (default: the free memory)")
    ap.add_argument("--max-slots", type=int, default=1024, help="the paged engine's rows (concurrency cap)")
    ap.add_argument("--attn-bucket", type=int, default=2048, help="decode graphs per this many attended columns")
    ap.add_argument("--fused-max-seqs", type=int, default=1024)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--no-rollout", action="store_true", help="decode rows only")
    ap.add_argument("--append", action="store_true", help="add to the rows already in --json-out (one table from "
                    "several runs, each within a time limit)")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--decode-contexts", default="2048,8192,16384", help="'' for none")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--decode-models", default="qwen2.5-7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="markdown table path")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: a tiny model, short lengths")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.quick:
        a.models, a.decode_models, a.max_len = "tiny-llama", "tiny-llama", "96"
        a.requests, a.prompt_len, a.page_sizes, a.decode_contexts = 8, 8, "16", "40"
        a.decode_batch, a.decode_steps, a.kv_gb, a.attn_bucket = 2, 2, a.kv_gb or 0.0002, 64
    device = torch.device("cpu" if a.quick else "cuda")
    dtype = torch.float32 if a.quick else torch.bfloat16
    bw, bw_src = (100e9, "nominal (CPU smoke)") if a.quick else gpu_bandwidth(device)
    names = a.models.split(",")
    lens = [int(x) for x in a.max_len.split(",")]
    lens = lens * len(names) if len(lens) == 1 else lens
    pages: list[int | None] = ([] if a.no_rows else [None]) + [int(p) for p in a.page_sizes.split(",") if p]
    head = (f"{'CPU' if a.quick else torch.cuda.get_device_name(device)}, bandwidth {bw / 1e12:.2f} TB/s ({bw_src}); "
            f"{a.requests} requests, prompt {a.prompt_len}, new tokens exponential (mean max/{a.tail_mean_div:g}, "
            f"capped), forced; greedy")
    rollouts: list[dict[str, Any]] = []
    decodes: list[dict[str, Any]] = []
    if a.append and a.json_out and Path(a.json_out).exists():
        old = json.loads(Path(a.json_out).read_text())
        rollouts, decodes = old["rollouts"], old["decode"]

    def write() -> None:
        text = markdown(head, rollouts, decodes)
        print(text, flush=True)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(text)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps({"head": head, "rollouts": rollouts, "decode": decodes}, indent=1))

    for name, max_len in zip(names, lens, strict=True):
        args = preset(name) if a.quick else named_args(name)
        model = random_on_device(args, device, dtype, max_seq_len=max(max_len, 16384) + 256)
        budget = kv_budget(a, args, device) if not a.quick else int(a.kv_gb * 2**30)
        for page in pages if not a.no_rollout else []:
            rollouts.append(rollout_row(a, model, name, max_len, page, budget, bw))
            write()
        if name in a.decode_models.split(","):
            for ctx in [int(c) for c in a.decode_contexts.split(",") if c]:
                for page in pages:
                    decodes.append(decode_row(a, model, name, ctx, page, bw))
                    write()
        del model
        release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
