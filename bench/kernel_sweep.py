"""Launch-config sweep of the fused decode kernels (worker/tlt/kernels) on SmolLM2-135M shapes (random bf16 weights,
no model file): each kernel's candidate configs timed at M = 1 token, then the best one, the default rule's and the
torch equivalent (the model's own modules: F.linear, SDPA) at M = 1, 16, 64, 128 tokens, each token a decode
row over a cache context of 512 columns; then the whole fused layer (5 kernels) and the whole fused forward (30 layers
+ head) at M = 1 with the default configs vs the best ones. Times are CUDA-graph replays of 20 back-to-back launches
(what the decode graph sees), in us per launch. Prints ONE markdown table, then one `TUNED[...] = ...` line per
kernel, ready to paste into worker/tlt/kernels/common.py.

    python bench/kernel_sweep.py --out bench/results/kernel_sweep_h200.md \
        --json-out bench/results/kernel_sweep_h200.json

Search (about 150 s in all with Triton's compiles; --budget-s, default 120, bounds it): stage 1 times every tile
shape (BLOCK_N x BLOCK_K, BLOCK_K <= next pow2(K), tiles of at most 16K weights; qkv_rope: BLOCK_N = 16/32/64 output
rows of a head per program; attention: BLOCK_N x column split 64/128/256 or none) at 4 warps / 2 stages; stage 2
times warps 2/4/8 x stages 1/2/3 for the --top-tiles best tiles until the kernel's share of the budget is spent.
`--dry-run` runs on CPU in Triton's interpreter (tiny model, fp32, 1 config per kernel, no timing): what
tests/kernels/test_kernel_sweep.py runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

MS = (1, 16, 64, 128)  # tokens per call (decode rows)
LAUNCHES = 20  # back-to-back launches per captured graph
REPLAYS = 10
KERNELS = ("qkv_rope", "attention", "o_proj", "norm_gate_up", "down", "head")
TABLE_KERNEL = {"o_proj": "linear_residual", "down": "linear_residual", "head": "linear_residual"}  # TUNED's names


@dataclass
class Setup:
    """The model, one layer's inputs at each M and the cache (every row at context `ctx`)."""

    model: Any  # worker.tlt.model.transformer.Transformer
    ctx: int
    ms: tuple[int, ...]
    cache: Any  # KVCache with max(ms) slots
    device: torch.device


def build(dry: bool, ctx: int) -> Setup:
    from worker.tlt.decoding.kv_cache import KVCache
    from worker.tlt.model.args import preset
    from worker.tlt.model.load import random_model

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    args = preset("tiny-llama") if dry else preset("smollm2-135m")
    model = random_model(args, seed=0, device=device, dtype=dtype, std=0.05).eval()
    t = ctx + 64
    model.init_rope(device, t)
    ms = (1, 3) if dry else MS
    cache = KVCache.allocate(args, max(ms), t, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    for x in (*cache.k, *cache.v):
        x.copy_(torch.randn(x.shape, generator=g).to(dtype))
    return Setup(model, ctx, ms, cache, device)


def shape_of(st: Setup, kernel: str) -> tuple[int, int]:
    """(N, K): the key of the kernel's TUNED entry."""
    a = st.model.args
    return {"qkv_rope": ((a.n_heads + 2 * a.n_kv_heads) * a.hd, a.dim), "attention": (a.n_heads // a.n_kv_heads, a.hd),
            "o_proj": (a.dim, a.n_heads * a.hd), "norm_gate_up": (a.intermediate_size, a.dim),
            "down": (a.dim, a.intermediate_size), "head": (a.vocab_size, a.dim)}[kernel]


def candidates(st: Setup, kernel: str, top_tiles: int, measured: dict[Any, float]) -> tuple[list[Any], list[Any]]:
    """(stage 1, stage 2) candidates; stage 2 depends on stage 1's timings `measured` (config -> us)."""
    from worker.tlt.kernels.common import Config

    n, k = shape_of(st, kernel)
    kmax = 1 << (k - 1).bit_length()
    if kernel == "attention":  # (column block, split): chunks of whole blocks, or no split (0)
        stage1 = [Config(bn, k, 4, 2, split=sp) for bn in (16, 32, 64, 128) for sp in (0, 64, 128, 256)
                  if sp == 0 or sp >= bn]
    elif kernel == "qkv_rope":  # output rows of a head per program x K tile; the two weight tiles <= 16K weights
        hd = st.model.args.hd
        stage1 = [Config(bn, bk, 4, 2) for bn in (16, 32, 64) for bk in (64, 128, 256, 512)
                  if bn <= hd and bk <= kmax and 2 * bn * bk <= 16384]
    else:
        stage1 = [Config(bn, bk, 4, 2) for bn in (16, 32, 64) for bk in (64, 128, 256, 512)
                  if bk <= kmax and bn * bk <= 16384 and bn <= max(16, 1 << (n - 1).bit_length())]
    best = sorted((c for c in stage1 if c in measured), key=lambda c: measured[c])[:top_tiles]
    stage2 = [replace(c, num_warps=w, num_stages=s) for c in best for w, s in itertools.product((2, 4, 8), (1, 2, 3))
              if (w, s) != (4, 2)]
    return stage1, stage2


def kernel_call(st: Setup, kernel: str, m: int, cfg: Any) -> Callable[[], Any]:
    """One fused-kernel launch on fixed inputs of m tokens (cfg None: config_for's choice)."""
    from worker.tlt.kernels.attention import cache_attention
    from worker.tlt.kernels.linear import linear_residual, norm_gate_up
    from worker.tlt.kernels.qkv_rope import qkv_rope_cache

    model, a = st.model, st.model.args
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    x, pos, mask, q, u = layer_inputs(st, m)
    ck, cv = st.cache.k[0], st.cache.v[0]
    calls: dict[str, Callable[[], Any]] = {
        "qkv_rope": lambda: qkv_rope_cache(x, layer.input_layernorm.weight, att.qkv_proj.weight, att.qkv_proj.bias,
                                           None, None, model.rope_cos, model.rope_sin, pos, pos, ck, cv, s=1, row0=0,
                                           n_heads=a.n_heads, eps=a.norm_eps, config=cfg),
        "attention": lambda: cache_attention(q, ck, cv, mask, pos, row0=0, config=cfg),
        "o_proj": lambda: linear_residual(q, att.o_proj.weight, x, config=cfg),
        "norm_gate_up": lambda: norm_gate_up(x, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                                             a.norm_eps, config=cfg),
        "down": lambda: linear_residual(u, mlp.down_proj.weight, x, config=cfg),
        "head": lambda: linear_residual(x, model.head_weight, None, config=cfg),
    }
    return calls[kernel]


def torch_call(st: Setup, kernel: str, m: int) -> Callable[[], Any]:
    """The torch ops the model runs for the same step (Attention.forward's cached path, MLP, the head)."""
    from worker.tlt.model.transformer import apply_rope

    model, a = st.model, st.model.args
    layer = model.model.layers[0]
    att, mlp = layer.self_attn, layer.mlp
    x, pos, mask, q, u = layer_inputs(st, m)
    ck, cv = st.cache.k[0], st.cache.v[0]
    g, d = a.n_heads // a.n_kv_heads, a.hd
    # [M, 1, 1, D] in the model dtype, as forward_hidden casts them
    cos, sin = (model.rope_cos[pos][:, None, None].to(x.dtype), model.rope_sin[pos][:, None, None].to(x.dtype))
    add_mask = torch.zeros(m, 1, g, st.ctx, device=st.device, dtype=x.dtype).masked_fill(~mask[:, :, None], -torch.inf)
    rows = torch.arange(m, device=st.device)

    def qkv() -> torch.Tensor:
        qkv_ = att.qkv_proj(layer.input_layernorm(x[:, None])).view(m, 1, -1, d)
        qk, v = qkv_.split((a.n_heads + a.n_kv_heads, a.n_kv_heads), dim=2)
        qk = apply_rope(qk, cos, sin)
        ck[rows[:, None], :, pos[:, None]] = qk[:, :, a.n_heads:]
        cv[rows[:, None], :, pos[:, None]] = v
        return qk

    def attention() -> torch.Tensor:
        qg = q.view(m, a.n_kv_heads, g, d)
        return F.scaled_dot_product_attention(qg, ck[:m, :, :st.ctx], cv[:m, :, :st.ctx], attn_mask=add_mask)

    def gate_up() -> torch.Tensor:
        gate, up = mlp.gate_up_proj(layer.post_attention_layernorm(x)).chunk(2, dim=-1)
        return F.silu(gate) * up

    calls: dict[str, Callable[[], Any]] = {
        "qkv_rope": qkv, "attention": attention, "o_proj": lambda: x + att.o_proj(q), "norm_gate_up": gate_up,
        "down": lambda: x + mlp.down_proj(u), "head": lambda: F.linear(x, model.head_weight),
    }
    return calls[kernel]


_INPUTS: dict[int, tuple[torch.Tensor, ...]] = {}


def layer_inputs(st: Setup, m: int) -> tuple[torch.Tensor, ...]:
    """(x [M, H], pos [M] = ctx - 1, mask [M, 1, ctx] all true, q [M, Hq*D], u [M, I]), made once per M."""
    if m not in _INPUTS:
        a, w = st.model.args, st.model.head_weight
        g = torch.Generator(device="cpu").manual_seed(m)
        pos = torch.full((m,), st.ctx - 1, dtype=torch.int64, device=st.device)
        mask = torch.ones(m, 1, st.ctx, dtype=torch.bool, device=st.device)
        x, q, u = (torch.randn(m, n, generator=g).to(device=st.device, dtype=w.dtype)
                   for n in (a.dim, a.n_heads * a.hd, a.intermediate_size))
        _INPUTS[m] = (x, pos, mask, q, u)
    return _INPUTS[m]


def time_us(fn: Callable[[], Any], dry: bool) -> float:
    """us per call: a CUDA graph of LAUNCHES back-to-back calls, replayed REPLAYS times (dry: one eager call, 0)."""
    if dry:
        fn()  # compiles: the dry run only checks that every config builds
        return 0.0
    from worker.tlt.kernels import tuning

    return tuning.time_us(fn, launches=LAUNCHES, replays=REPLAYS)


def sweep_kernel(st: Setup, kernel: str, a: argparse.Namespace, deadline: float, t0: float) -> dict[str, Any]:
    """Stage 1, then stage 2 until `deadline` (perf_counter), then best / default / torch at every M."""
    from worker.tlt.kernels.common import default_config

    n, k = shape_of(st, kernel)
    default = default_config(TABLE_KERNEL.get(kernel, kernel), n, k)  # the rule, whatever TUNED holds now
    measured: dict[Any, float] = {}
    skipped = 0
    stage1, _ = candidates(st, kernel, a.top_tiles, measured)
    if a.dry_run:
        stage1 = [default]
    for cfg in stage1:
        measured[cfg] = time_us(kernel_call(st, kernel, 1, cfg), a.dry_run)
    if not a.dry_run:
        for cfg in candidates(st, kernel, a.top_tiles, measured)[1]:
            if time.perf_counter() > deadline:
                skipped += 1
                continue
            measured[cfg] = time_us(kernel_call(st, kernel, 1, cfg), a.dry_run)
    best = min(measured, key=lambda c: measured[c])
    row: dict[str, Any] = {"kernel": kernel, "table": TABLE_KERNEL.get(kernel, kernel), "n": n, "k": k,
                           "best": asdict(best), "default": asdict(default), "skipped": skipped,
                           "candidates": [{**asdict(c), "us_m1": us} for c, us in measured.items()]}
    for name, make in (("best_us", lambda m: kernel_call(st, kernel, m, best)),
                       ("default_us", lambda m: kernel_call(st, kernel, m, default)),
                       ("torch_us", lambda m: torch_call(st, kernel, m))):
        row[name] = {m: time_us(make(m), a.dry_run) for m in st.ms}
    # the config the engine gets: the 1-token winner, unless the default rule is faster summed over all token counts
    # (a config only fast at 1 token would slow the rollout's larger batches; both are timed at every M)
    keep_best = sum(row["best_us"].values()) <= sum(row["default_us"].values())
    row["chosen"] = row["best"] if keep_best else row["default"]
    spent = time.perf_counter() - t0
    print(f"[sweep] {kernel}: {len(measured)} configs ({skipped} skipped), best {best}, {spent:.0f} s", file=sys.stderr,
          flush=True)
    return row


def chained(calls: list[Callable[[], Any]]) -> Callable[[], None]:
    def run() -> None:
        for c in calls:
            c()
    return run


def whole(st: Setup, rows: list[dict[str, Any]], dry: bool) -> dict[str, float]:
    """The fused layer (5 kernels) and forward (all layers + head) at M = 1, default vs best configs, and torch."""
    from worker.tlt.kernels import tuning
    from worker.tlt.kernels.common import Config
    from worker.tlt.kernels.forward import fused_forward_hidden

    model = st.model
    x, pos, mask, _, _ = layer_inputs(st, 1)
    ids, pos2 = torch.zeros(1, 1, dtype=torch.int64, device=st.device), pos[:, None]

    chain = ("qkv_rope", "attention", "o_proj", "norm_gate_up", "down")
    out: dict[str, float] = {}
    best = {(r["table"], r["n"], r["k"]): Config(**r["chosen"]) for r in rows}
    served = tuning.table(torch.cuda.get_device_name(st.device)).configs if st.device.type == "cuda" else {}
    for label, table in (("default", {}), ("best", best)):
        saved = dict(served)
        served.clear()
        served.update(table)
        try:
            calls = [kernel_call(st, kname, 1, None) for kname in chain]  # config_for reads the table at each launch
            out[f"layer_{label}_us"] = time_us(chained(calls), dry)
            out[f"forward_{label}_us"] = time_us(
                lambda: fused_forward_hidden(model, ids, pos2, st.cache, attn_mask=mask), dry)
        finally:
            served.clear()
            served.update(saved)
    tcalls = [torch_call(st, kname, 1) for kname in chain]
    out["layer_torch_us"] = time_us(chained(tcalls), dry)
    with torch.no_grad():
        out["forward_torch_us"] = time_us(lambda: model.forward_hidden(ids, pos2, st.cache, write_idx=pos2,
                                                                        attn_mask=mask), dry)
    return out


def cfg_text(c: dict[str, int]) -> str:
    split = f", split={c['split']}" if c.get("split") else ""  # attention's column chunks (0: not split)
    return f"Config({c['block_n']}, {c['block_k']}, num_warps={c['num_warps']}, num_stages={c['num_stages']}{split})"


def render(st: Setup, rows: list[dict[str, Any]], tot: dict[str, float], elapsed: float) -> str:
    dev = torch.cuda.get_device_name(0) if st.device.type == "cuda" else "CPU (dry run: Triton interpreter, no timing)"
    a = st.model.args
    ms = st.ms
    lines = [f"Fused decode kernels, {a.n_layers} layers H {a.dim}, {a.n_heads}/{a.n_kv_heads} heads D {a.hd}, "
             f"I {a.intermediate_size}, V {a.vocab_size}, {st.model.head_weight.dtype}, context {st.ctx}, {dev}, "
             f"sweep {elapsed:.0f} s; us per launch (CUDA graph of {LAUNCHES})", "",
             "| kernel | (N, K) | variant | config | " + " | ".join(f"M={m}" for m in ms) + " |",
             "|---|---|---|---|" + "---|" * len(ms)]
    for r in rows:
        for variant, cfg, key in (("best", cfg_text(r["best"]), "best_us"), ("default", cfg_text(r["default"]),
                                  "default_us"), ("torch", "the model's torch ops", "torch_us")):
            us = " | ".join(f"{r[key][m]:.1f}" for m in ms)
            lines.append(f"| {r['kernel']} | ({r['n']}, {r['k']}) | {variant} | {cfg} | {us} |")
    blank = " | ".join("" for _ in ms[1:])
    for what in ("layer", "forward"):
        name = "layer (5 kernels)" if what == "layer" else f"forward ({a.n_layers} layers + head)"  # best = chosen
        for variant in ("best", "default", "torch"):
            lines.append(f"| {name} | - | {variant} | - | {tot[f'{what}_{variant}_us']:.1f} | {blank} |")
    fwd = tot["forward_best_us"]
    lines += ["", f"Fused forward at M=1 with the chosen configs: {fwd:.1f} us = at most "
              f"{1e6 / fwd if fwd > 0 else 0:.0f} tok/s (forward only, no sampling).", ""]
    lines += [f"TUNED[({r['table']!r}, {r['n']}, {r['k']})] = {cfg_text(r['chosen'])}  # {r['kernel']}"
              + ("" if r["chosen"] == r["best"] else " (the default rule: faster summed over all M)") for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/kernel_sweep_h200.md")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--ctx", type=int, default=512, help="cache columns each decode row attends")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="seconds after which stage 2 starts no more candidates (shared equally by the kernels)")
    ap.add_argument("--top-tiles", type=int, default=2, help="tiles of stage 1 whose warps / stages stage 2 sweeps")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes, no timing")
    ap.add_argument("--write-tuned", action="store_true",
                    help="add the best configs to ~/.cache/tlt/kernels/<GPU>.json (what the engine reads)")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (decorated)
        a.ctx = min(a.ctx, 40)
    elif not torch.cuda.is_available():
        raise SystemExit("kernel_sweep needs CUDA (or --dry-run)")
    t0 = time.perf_counter()
    deadline = t0 + a.budget_s
    st = build(a.dry_run, a.ctx)
    _INPUTS.clear()
    from worker.tlt.kernels import settings, tuning

    # measure the default rule as it is: no first-use tuning, no seeds or cached configs served
    previous = settings.configure(settings.KernelConfig(tune=False, cache_dir=Path(a.out).parent / "kernel_sweep_cache"))
    if not a.dry_run:
        tuning.table(torch.cuda.get_device_name(0)).configs.clear()
    with torch.no_grad():
        names = a.kernels.split(",")
        rows = []
        for i, kname in enumerate(names):  # each kernel's stage 2 gets an equal share of the time left
            now = time.perf_counter()
            rows.append(sweep_kernel(st, kname, a, now + max(0.0, deadline - now) / (len(names) - i), t0))

        tot = whole(st, rows, a.dry_run)
    text = render(st, rows, tot, time.perf_counter() - t0)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    res = {"device": text.splitlines()[0], "ctx": st.ctx, "ms": list(st.ms), "kernels": rows, "whole": tot,
           "seconds": time.perf_counter() - t0}
    Path(a.json_out or str(Path(a.out).with_suffix(".json"))).write_text(json.dumps(res, indent=1))
    if a.write_tuned and not a.dry_run:
        from worker.tlt.kernels.common import Config

        settings.configure(previous)  # the engine's tuning directory
        tab = tuning.table(torch.cuda.get_device_name(0))
        tab.configs.update({(r["table"], r["n"], r["k"]): Config(**r["chosen"]) for r in rows})
        print(f"tuned configs -> {tab.save()}")
    settings.configure(previous)
    tuning.forget()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
