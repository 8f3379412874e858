"""Measure the EAGLE-1 drafter on a real model: warm up from the target's own GSM8K responses, then accept length and
tail tokens/s of chain / tree speculative decoding against SD off (small batches = the rollout's tail).

    python -m worker.tlt.drafter.measure --device cuda --out results.json      # SmolLM2-135M-Instruct + GSM8K
    python -m worker.tlt.drafter.measure --device cpu --model tiny-llama --train-prompts 8 --train-steps 20 \
        --new-tokens 32 --eval-prompts 2                                         # smoke run
Prints one table row per (drafter state, decoding) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from worker.tlt.config import DatasetSource, ModelSource
from worker.tlt.data.dataset import load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.drafter.proposer import EagleProposer, EagleProposerConfig
from worker.tlt.drafter.train import SpotTrainer, SpotTrainerConfig
from worker.tlt.model.load import load_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams, SpecConfig

log = logging.getLogger(__name__)

ARMS: dict[str, tuple[SpecConfig, int]] = {  # name -> (engine spec, proposer top-k)
    "off": (SpecConfig(mode="off"), 1),
    "chain k=6": (SpecConfig(mode="on", method="chain", depth=6), 1),
    "tree d=6 k=4 v=32": (SpecConfig(mode="on", method="tree", depth=6, topk=4, verify_tokens=32), 4),
}


def run_arm(target: Transformer, drafter: EagleDrafter | None, prompts: list[list[int]], params: SamplingParams,
            arm: str, eos: tuple[int, ...], max_len: int, context: int = 64,
            proposer: EagleProposer | None = None, time_propose: bool = True) -> dict[str, Any]:
    """One decoding arm over `prompts` (one batch). `proposer`: reuse one (and its captured chain graphs) instead
    of building one around `drafter`. `time_propose`: synchronise around each propose to time it (propose_ms; the
    syncs cost the step its CPU/GPU overlap, so leave it off for tokens/s)."""
    spec, topk = ARMS[arm]
    prop = None
    if spec.mode == "on":
        if proposer is None:
            assert drafter is not None
            proposer = EagleProposer(drafter, EagleProposerConfig(topk=topk, context=context))
        prop = proposer
    spent = [0.0]
    if prop is not None and time_propose:  # time the drafting part of each speculative step (synchronised)
        inner = prop.propose

        def timed(ctx: Any) -> Any:
            if target.head_weight.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = inner(ctx)
            if target.head_weight.is_cuda:
                torch.cuda.synchronize()
            spent[0] += time.perf_counter() - t0
            return r

        prop.propose = timed  # type: ignore[method-assign]
    layers = prop.drafter.feature_layers if prop is not None else ()  # EAGLE-3 drafts from 3 target layers
    eng = Engine(target, eos_ids=eos, config=EngineConfig(max_len=max_len, max_slots=len(prompts),
                                                          capture_layers=layers), spec=spec,
                 proposer=prop, hidden_hook=prop.observe if prop is not None else None)
    try:
        eng.warmup(len(prompts), max_len, params=params)  # CUDA graphs of every batch bucket and arm shape (no-op on CPU)
        eng.generate([Request(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=8))])  # warm-up (allocator)
        spent[0] = 0.0
        out = eng.generate([Request(p, params) for p in prompts])
    finally:
        if prop is not None and time_propose:
            del prop.propose  # back to the method (a reused proposer is timed once per call)
    dec = [s for s in out.steps if s.kind != "prefill"]
    emitted = sum(s.emitted for s in dec)
    secs = sum(s.seconds for s in dec)
    spec_steps = [s for s in dec if s.kind == "spec"]
    rows = sum(s.active for s in spec_steps)
    n_spec = max(len(spec_steps), 1)
    return {"arm": arm, "tokens": emitted, "tokens_per_s": emitted / max(secs, 1e-9),
            "accept_len": sum(s.emitted for s in spec_steps) / rows if rows else 1.0,
            "step_ms": 1e3 * secs / max(len(dec), 1), "propose_ms": 1e3 * spent[0] / n_spec}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--gguf", default="", help="a GGUF file instead of --model (e.g. the SmolLM2 file, copied)")
    ap.add_argument("--train-prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=1500)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="training windows per step")
    ap.add_argument("--window", type=int, default=128, help="rows per training window")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ttt", type=int, default=1, help="unrolled training steps (training-time test)")
    ap.add_argument("--noise", type=float, default=0.0, help="uniform feature noise half-width in training")
    ap.add_argument("--temperatures", default="1.0,0.0", help="comma-separated evaluation temperatures")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dev = torch.device(a.device)
    source = ModelSource(gguf=a.gguf) if a.gguf else ModelSource(builtin=a.model)
    target, tok = load_model(source, dev)
    eos = tuple(getattr(tok, "eos_ids", target.args.eos_token_ids))
    train_rows, val_rows = split_examples(load_examples(DatasetSource()), 64)
    sysmsg = DatasetSource().system_prompt
    train_p = [list(p.ids) for p in render_examples(train_rows[: a.train_prompts], tok, sysmsg, 384)]
    eval_p = [list(p.ids) for p in render_examples(val_rows[: a.eval_prompts], tok, sysmsg, 384)]
    max_len = max(len(p) for p in train_p + eval_p) + a.new_tokens + 8
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens)  # RL rollouts sample at T=1

    drafter = EagleDrafter(target, EagleConfig(ttt_steps=a.ttt, feature_noise=a.noise)).to(dev)
    untrained = EagleDrafter(target, EagleConfig()).to(dev)
    untrained.load_state_dict(drafter.state_dict())
    buf = HiddenStateBuffer(drafter.feature_dim, 2 * 2**30, device=dev,
                            dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cap = EngineCapture(buf)
    gen = Engine(target, eos_ids=eos, config=EngineConfig(max_len=max_len, max_slots=len(train_p)), hidden_hook=cap)
    t0 = time.perf_counter()
    out = gen.generate([Request(p, params) for p in train_p])
    t_gen = time.perf_counter() - t0
    log.info("warm-up rollout: %d tokens in %.1f s, buffer %d rows", out.tokens, t_gen, len(buf))
    tr = SpotTrainer(drafter, buf, SpotTrainerConfig(batch_size=a.batch, window=a.window, learning_rate=a.lr))
    t0 = time.perf_counter()
    tr.train(lambda: False, a.train_steps)
    m = tr.metrics()
    log.info("spot training: %s in %.1f s", m, time.perf_counter() - t0)

    results: list[dict[str, Any]] = []
    for temp in (float(t) for t in a.temperatures.split(",")):
        ev = SamplingParams(temperature=temp, max_new_tokens=a.new_tokens)
        for label, d in (("untrained", untrained), (f"warm-up {a.train_steps} steps", drafter)):
            for arm in ARMS:
                if arm == "off" and label == "untrained":
                    continue
                r = run_arm(target, d, eval_p, ev, arm, eos, max_len)
                r.update(drafter=label, batch=len(eval_p), temperature=temp)
                results.append(r)
                log.info("%s", r)
    print(f"{'T':>4} {'drafter':<24}{'decoding':<20}{'accept_len':>11}{'tok/s':>10}{'vs off':>8}{'step ms':>9}"
          f"{'draft ms':>9}")
    for r in results:
        base = next(x["tokens_per_s"] for x in results if x["arm"] == "off" and x["temperature"] == r["temperature"])
        r["speedup"] = r["tokens_per_s"] / base
        print(f"{r['temperature']:>4.1f} {r['drafter']:<24}{r['arm']:<20}{r['accept_len']:>11.2f}"
              f"{r['tokens_per_s']:>10.1f}{r['speedup']:>8.2f}{r['step_ms']:>9.1f}{r['propose_ms']:>9.1f}")
    summary = {"results": results, "train": {**m, "gen_s": t_gen, "buffer_rows": len(buf)}}
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
