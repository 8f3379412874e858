"""TLT on a widened target: SmolLM2-135M-Instruct embedded exactly in a 7B-class architecture (model/widen.py), so
SmolLM2's real acceptance lengths meet a 7B-class step cost. One process, one table:

    PYTHONPATH=. python bench/tlt_widened.py --out bench/results/tlt_widened_h200.md --json-out ...   # H200
    PYTHONPATH=. python bench/tlt_widened.py --device cpu --model smollm2-135m-instruct@test --quick --out /tmp/t.md

1. Lossless: greedy decoding with SD on (n-gram chain drafts) gives plain greedy's tokens on the widened target.
2. Drafter: the `drafter` warm-up job (worker/tlt/speculative/drafter/warmup.py, EAGLE-1 at the wide hidden width) on the
   widened target, then loaded into the rollout engine's EAGLE proposer.
3. Long-tail rollout (--prompts x --samples GSM8K, <= --max-new-tokens, T=1): SD off vs TLT (adaptive: n-gram +
   EAGLE arms, SD switched by measured step costs below --sd-below active); seconds, tail tokens/s (< 32 active)
   and the accept length of each arm. Every mode gets the same untimed warm-up (bench.warm_up).
4. SmolLM2-135M itself (where SD cannot pay): the same two modes, so TLT must stay >= 0.98x SD off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from worker.tlt.bench import BenchReporter, chat_prompts, fmt, gsm8k_questions, ratio, summarize, warm_up
from worker.tlt.config import JobSpec, ModelSource, RolloutConfig
from worker.tlt.kernels.settings import configure, current
from worker.tlt.model.load import load_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.model.widen import parse_name, plan
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import DrafterKind, chain_arm
from worker.tlt.speculative.control.arm_buckets import ONE_GPU_BUCKETS
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.step_costs import StepCostConfig
from worker.tlt.speculative.control.switch import SwitchConfig
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.export import load_exported
from worker.tlt.speculative.drafter.warmup import warmup
from worker.tlt.speculative.proposers.ngram import NGramProposer

TAIL = 32  # "tail" = fewer active sequences than this (TLT's threshold, the metric's definition)
# --fused: the decode / verify forward in the fused Triton kernels (auto: where they run) or in torch (cuBLAS, SDPA)
FUSED = {"auto": None, "on": True, "off": False}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def identical(model: Transformer, tok: Any, prompts: list[list[int]], new: int, fused: str) -> dict:
    """Greedy plain vs greedy SD on (n-gram chain of 4): identical tokens, sequence by sequence. The large-model
    forward's GEMMs run at one fixed M for this (KernelConfig.gemm_pad_rows: every call's rows, verify included), so a
    row's logits do not depend on the call it is in."""
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=new)) for p in prompts]
    max_len = max(len(p) for p in prompts) + new
    previous = configure(replace(current(), gemm_pad_rows=len(prompts) * 5))  # rows x (chain of 4 + its root)
    try:
        outs = [greedy_run(model, tok, reqs, max_len, fused, sd) for sd in ("off", "on")]
    finally:
        configure(previous)
    plain, spec_out = outs
    same_tok = total = same_seq = 0
    for a, b in zip(plain.sequences, spec_out.sequences, strict=True):
        n = min(len(a.tokens), len(b.tokens))
        first = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), n)  # tokens up to the first divergence
        same_tok += first
        total += len(a.tokens)
        same_seq += a.tokens == b.tokens
    spec_steps = [s for s in spec_out.steps if s.kind == "spec"]
    rows = sum(s.active for s in spec_steps)
    return {"sequences": len(prompts), "identical_sequences": same_seq, "tokens": total,
            "identical_prefix_fraction": same_tok / max(total, 1),
            "sd_accept_len": sum(s.emitted for s in spec_steps) / rows if rows else None}


def greedy_run(model: Transformer, tok: Any, reqs: list[Request], max_len: int, fused: str, sd: str) -> Any:
    eng = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=max_len, max_slots=len(reqs),
                                                                  fused_kernels=FUSED[fused]),
                 controller=AdaptiveSd.fixed(chain_arm("ngram", 4)) if sd == "on" else None,
                 proposers={"ngram": NGramProposer()})
    warm_up(eng, reqs, max_len)
    return eng.generate(reqs)


def train_drafter(model: Transformer, tok: Any, name: str, prompts: list[list[int]], a: argparse.Namespace,
                  out_dir: Path) -> tuple[EagleProposer, dict]:
    """The `drafter` job's warm-up on `model` (the prompts are disjoint from the rollout's); its export loaded back."""
    spec = JobSpec.model_validate({
        "type": "drafter", "model": {"builtin": name}, "max_steps": a.warmup_rounds, "seed": a.seed,
        "algorithm": {"prompts_per_step": a.warmup_prompts, "max_completion_length": a.warmup_new_tokens,
                      "temperature": a.temperature, "top_k": a.top_k},
        "drafter": {"kind": "eagle1", "max_train_steps_per_rl_step": a.warmup_steps},
        "rollout": {"cuda_graphs": model.head_weight.is_cuda},
    })
    rep = BenchReporter()
    t0 = time.perf_counter()
    path = warmup(spec, model, tok, prompts, rep, out_dir=out_dir)
    seconds = time.perf_counter() - t0
    drafter = load_exported(path, model, dtype=model.head_weight.dtype)
    last = rep.steps[-1] if rep.steps else {}
    info = {"seconds": seconds, "rounds": a.warmup_rounds, "prompts_per_round": a.warmup_prompts,
            "max_new_tokens": a.warmup_new_tokens, "train_steps": a.warmup_rounds * a.warmup_steps,
            "rows": last.get("drafter/buffer_rows"), "acc": last.get("drafter/acc"),
            "gen_s": sum(s.get("timing_s/gen", 0.0) for s in rep.steps),
            "train_s": sum(s.get("timing_s/drafter", 0.0) for s in rep.steps)}
    return EagleProposer(drafter, EagleProposerConfig()), info


def rollout(model: Transformer, tok: Any, prompts: list[list[int]], a: argparse.Namespace, mode: str,
            eagle: EagleProposer | None, max_new: int) -> dict:
    """One timed rollout: `off` (SD pinned off, metrics only) or `tlt` (adaptive, step-cost switch)."""
    max_len = max(len(p) for p in prompts) + max_new
    if mode == "off":
        ctl = AdaptiveSd(SwitchConfig(mode="off", on_below=TAIL), None, scheme=ONE_GPU_BUCKETS)
    else:
        kinds: list[DrafterKind] = ["ngram", "eagle"] if eagle is not None else ["ngram"]
        ctl = AdaptiveSd.from_spec(RolloutConfig(speculative="adaptive", sd_on_below=TAIL, seed=a.seed), kinds,
                                   step_costs=StepCostConfig(), sd_below=a.sd_below)
    proposers: dict[str, Any] = {"ngram": NGramProposer()}
    if eagle is not None and mode != "off":
        proposers["eagle"] = eagle
    eng = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=max_len, max_slots=len(prompts) * a.samples,
                                                                  seed=a.seed, fused_kernels=FUSED[a.fused]),
                 controller=ctl, proposers=proposers,
                 hidden_hook=eagle.observe if eagle is not None and mode != "off" else None)
    params = RequestSampling(temperature=a.temperature, top_k=a.top_k, max_new_tokens=max_new, n=a.samples)
    reqs = [Request(p, params) for p in prompts]
    warm_s = warm_up(eng, reqs, max_len)
    sync(eng.device)
    t0 = time.perf_counter()
    out = eng.generate(reqs)
    sync(eng.device)
    res = summarize(out, time.perf_counter() - t0)
    res.update(mode=mode, warmup_s=warm_s, sd_metrics=out.sd_metrics, buckets=out.sd_buckets, arms=arm_stats(out))
    if ctl.costs is not None:
        res["step_costs"] = ctl.costs.summary()
    return res


def arm_stats(out: Any) -> dict[str, dict]:
    """Per arm: speculative steps, accept length (tokens emitted per sequence per step), and the median and mean ms
    per step (the mean carries an arm's first uses, which capture its graphs; the median is a warm step)."""
    acc: dict[str, list[float]] = {}
    seconds: dict[str, list[float]] = {}
    for s in out.steps:
        if s.kind == "spec" and s.arm:
            a = acc.setdefault(s.arm, [0, 0, 0])
            a[0] += 1
            a[1] += s.emitted
            a[2] += s.active
            seconds.setdefault(s.arm, []).append(s.seconds)
    return {k: {"steps": int(v[0]), "accept_len": v[1] / max(v[2], 1),
                "ms_per_step": 1e3 * statistics.median(seconds[k]),
                "ms_per_step_mean": 1e3 * statistics.fmean(seconds[k])} for k, v in sorted(acc.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct@qwen2.5-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--sd-below", type=int, default=65, help="TLT: SD considered below this many active sequences")
    ap.add_argument("--identical-prompts", type=int, default=16)
    ap.add_argument("--identical-new-tokens", type=int, default=256)
    ap.add_argument("--warmup-rounds", type=int, default=4, help="drafter warm-up rounds; 0 = n-gram drafts only")
    ap.add_argument("--warmup-prompts", type=int, default=128)
    ap.add_argument("--warmup-new-tokens", type=int, default=512)
    ap.add_argument("--warmup-steps", type=int, default=400, help="drafter training steps per warm-up round")
    ap.add_argument("--small-max-new-tokens", type=int, default=1024, help="the SmolLM2-135M rows; 0 = skip")
    ap.add_argument("--fused", choices=list(FUSED), default="auto", help="rollout engines' forward (both modes)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/tlt_widened_h200.md")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.samples, a.max_new_tokens, a.identical_prompts, a.identical_new_tokens = 2, 2, 12, 2, 8
        a.warmup_rounds, a.warmup_prompts, a.warmup_new_tokens, a.warmup_steps, a.small_max_new_tokens = 1, 2, 8, 2, 8
        a.dtype = "float32"
    torch.manual_seed(a.seed)
    wd = plan(parse_name(a.model))
    t0 = time.perf_counter()
    model, tok = load_model(ModelSource(builtin=a.model, dtype=a.dtype), a.device)
    dev = model.head_weight.device
    res: dict[str, Any] = {"model": a.model, "describe": wd.describe(), "load_s": time.perf_counter() - t0,
                           "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
                           "torch": torch.__version__, "args": vars(a)}
    out = Path(a.out)

    def save() -> None:  # rewritten after every part, so a run cut short keeps its finished rows
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(res, a))
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(res, indent=1))

    qs = gsm8k_questions("gsm8k", a.prompts + max(a.identical_prompts, 0) + a.warmup_prompts * a.warmup_rounds)
    roll_p = chat_prompts(tok, qs[: a.prompts])
    rest = chat_prompts(tok, qs[a.prompts:])
    if a.identical_prompts > 0:
        res["identical"] = identical(model, tok, rest[: a.identical_prompts], a.identical_new_tokens, a.fused)
        print("identical:", json.dumps(res["identical"]), flush=True)
        save()
    eagle = None
    if a.warmup_rounds > 0:
        with tempfile.TemporaryDirectory() as d:
            eagle, res["drafter"] = train_drafter(model, tok, a.model, rest[a.identical_prompts:], a, Path(d) / "drafter")
        print("drafter:", json.dumps(res["drafter"]), flush=True)
        save()
    res["rollout"] = {}
    for mode in ("off", "tlt"):
        res["rollout"][mode] = rollout(model, tok, roll_p, a, mode, eagle, a.max_new_tokens)
        print(f"rollout {mode}:", json.dumps({k: v for k, v in res["rollout"][mode].items() if k != "buckets"}),
              flush=True)
        save()
    del model, eagle
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if a.small_max_new_tokens:
        small, stok = load_model(ModelSource(builtin="smollm2-135m-instruct", dtype=a.dtype), a.device)
        res["small"] = {m: rollout(small, stok, roll_p, a, m, None, a.small_max_new_tokens) for m in ("off", "tlt")}
        print("smollm2:", json.dumps({m: r["seconds"] for m, r in res["small"].items()}), flush=True)
        save()
    sys.stdout.write(render(res, a))
    return 0


def render(res: dict, a: argparse.Namespace) -> str:
    lines = [f"TLT on widened SmolLM2 at {res['model'].split('@')[1]} cost — {res['device']}, torch {res['torch']}, "
             f"{a.dtype}, GSM8K prompts, T={a.temperature}, top-k {a.top_k}, forward: fused kernels {a.fused}", "",
             f"Target: {res['describe']}; it computes SmolLM2-135M-Instruct's function with the wide architecture's "
             f"tensor shapes (model/widen.py). `python bench/tlt_widened.py` (raw: the JSON beside this file).", ""]
    idt = res.get("identical")
    if idt:
        lines += [f"- Lossless (bf16, greedy, {idt['sequences']} prompts x <= {a.identical_new_tokens} new tokens, "
                  f"n-gram chain of 4): {idt['identical_sequences']} of {idt['sequences']} sequences identical to "
                  f"plain greedy; {idt['identical_prefix_fraction']:.3f} of tokens before the first divergence; "
                  f"accept length {fmt(idt['sd_accept_len'])}."]
    dr = res.get("drafter")
    if dr:
        lines += [f"- Drafter: warm-up job, EAGLE-1 at the wide hidden width, {dr['rounds']} rounds x "
                  f"{dr['prompts_per_round']} prompts (<= {dr['max_new_tokens']} new), {dr['train_steps']} training "
                  f"steps, {fmt(dr['rows'], 0)} rows, acc {fmt(dr['acc'])}; {dr['seconds']:.0f} s "
                  f"(generation {dr['gen_s']:.0f} s, training {dr['train_s']:.0f} s)."]
    lines += ["", "| measure | SD off | TLT | TLT / SD off |", "|---|---|---|---|"]
    for key, label, cap in (("rollout", f"widened, rollout {a.prompts}x{a.samples}", a.max_new_tokens),
                            ("small", f"SmolLM2-135M, rollout {a.prompts}x{a.samples}", a.small_max_new_tokens)):
        runs = res.get(key, {})
        off, tlt = runs.get("off"), runs.get("tlt")
        if off is None:
            continue
        t = tlt or {}
        lines.append(f"| {label}, <= {cap} new: seconds | {fmt(off['seconds'])} | {fmt(t.get('seconds'))} "
                     f"| {ratio(off['seconds'], t.get('seconds'))} |")
        lines.append(f"| {label}: tokens (mean / max length) | {off['tokens']:,} ({off['len_mean']:.0f} / "
                     f"{off['len_max']:.0f}) | " + (f"{t['tokens']:,} ({t['len_mean']:.0f} / {t['len_max']:.0f})"
                                                    if t else "—") + " | — |")
        lines.append(f"| {label}: tokens/s | {fmt(off['tokens_per_s'])} | {fmt(t.get('tokens_per_s'))} "
                     f"| {ratio(t.get('tokens_per_s'), off['tokens_per_s'])} |")
        om, tm = off.get("sd_metrics", {}), t.get("sd_metrics", {})
        lines.append(f"| {label}: tail tok/s (< {TAIL} active) | {fmt(om.get('perf/tokens_per_s_tail'))} "
                     f"| {fmt(tm.get('perf/tokens_per_s_tail'))} "
                     f"| {ratio(tm.get('perf/tokens_per_s_tail'), om.get('perf/tokens_per_s_tail'))} |")
        if t:
            arms = "; ".join(f"{k}: {v['steps']} steps, accept {v['accept_len']:.2f}, {v['ms_per_step']:.2f} ms"
                             f" (mean {v.get('ms_per_step_mean', v['ms_per_step']):.2f})"
                             for k, v in t.get("arms", {}).items()) or "no SD step"
            lines.append(f"| {label}: TLT arms (speculative steps, accept length, median ms per step (mean)) | — | {arms} | — |")
            lines.append(f"| {label}: SD-on fraction of steps, accept length | — "
                         f"| {fmt(tm.get('sd/on_fraction'))}, {fmt(tm.get('sd/accept_len'))} | — |")
            gains = ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in t.get("step_costs", {}).items()
                              if k.startswith("sd/gain/"))
            lines.append(f"| {label}: measured SD gain per bucket (SD tok/s per sequence / plain's) | — "
                         f"| {gains or '—'} | — |")
            for b in t.get("buckets", []):
                ob: dict = next((x for x in off.get("buckets", []) if x["bucket"] == b["bucket"]), {})
                lines.append(f"| {label}: tok/s per sequence, {b['bucket']} active ({b['sd_on_steps']} of {b['steps']}"
                             f" steps SD on) | {fmt(ob.get('seq_tokens_per_s'))} | {fmt(b.get('seq_tokens_per_s'))} "
                             f"| {ratio(b.get('seq_tokens_per_s'), ob.get('seq_tokens_per_s'))} |")
        lines.append(f"| {label}: untimed warm-up (graphs + prefill), s | {fmt(off['warmup_s'])} "
                     f"| {fmt(t.get('warmup_s'))} | — |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
