"""Measure EAGLE drafter training recipes on a real model: the target's own GSM8K responses, a drafter trained on them
per recipe (`RECIPES`: EAGLE-1 teacher forcing, feature noise, training-time test; EAGLE-3 on teacher-forced rows of
the same responses; same steps, same seed), then accept length, acceptance per draft position and tail tokens/s of
chain / tree speculative decoding against SD off (small batches = the rollout's tail).

    python -m worker.tlt.speculative.drafter.measure --device cuda --recipes eagle1,eagle1-ttt3 --out results.json  # SmolLM2
    python -m worker.tlt.speculative.drafter.measure --device cpu --model tiny-llama --train-prompts 8 --train-steps 20 \
        --new-tokens 32 --eval-prompts 2                                         # smoke run
Per recipe and evaluation arm it prints one row: accept length (tokens emitted per sequence per verify), the
conditional acceptance rate of each chain position (P(position k accepted | k-1 accepted): where a chain decays),
tokens/s against SD off; `--export DIR` writes the drafter with the longest chain accept length (its own form).
`--checkpoints` evaluates each recipe after several step counts too (accept length against training budget).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.tlt.config import DatasetSource, ModelSource
from worker.tlt.data.dataset import load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.model.load import load_model, resolve_dtype
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import NO_SD, Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.export import export_drafter
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.drafter.spot_trainer import SpotTrainer, SpotTrainerConfig
from worker.tlt.speculative.drafter.warmup import capture_eagle3_rows

log = logging.getLogger(__name__)

ARMS: dict[str, Arm] = {  # name -> the one arm the engine runs at every step
    "off": NO_SD,
    "chain k=6": chain_arm("eagle", 6),
    "tree d=6 k=4 v=32": tree_arm("eagle", 6, 4, 32),
}


def run_arm(target: Transformer, drafter: EagleDrafter | None, prompts: list[list[int]], params: RequestSampling,
            arm: str, eos: tuple[int, ...], max_len: int, context: int = 64,
            proposer: EagleProposer | None = None, time_propose: bool = True) -> dict[str, Any]:
    """One decoding arm over `prompts` (one batch). `proposer`: reuse one (and its captured chain graphs) instead
    of building one around `drafter`. `time_propose`: synchronise around each propose to time it (propose_ms; the
    syncs cost the step its CPU/GPU overlap, so leave it off for tokens/s)."""
    shape = ARMS[arm]
    prop = None
    if shape.is_sd:
        if proposer is None:
            assert drafter is not None
            proposer = EagleProposer(drafter, EagleProposerConfig(context=context))
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
                                                          capture_layers=layers),
                 controller=AdaptiveSd.fixed(shape) if prop is not None else None,
                 proposers={"eagle": prop} if prop is not None else None,
                 hidden_hook=prop.observe if prop is not None else None)
    try:
        eng.warmup(len(prompts), max_len, params=params)  # CUDA graphs of every batch bucket and arm shape (no-op on CPU)
        eng.generate([Request(prompts[0], RequestSampling(temperature=0.0, max_new_tokens=8))])  # warm-up (allocator)
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
            "step_ms": 1e3 * secs / max(len(dec), 1), "propose_ms": 1e3 * spent[0] / n_spec,
            "spec_rows": rows, "accepted_pos": position_sums(spec_steps, "accepted_pos"),
            "drafted_pos": position_sums(spec_steps, "drafted_pos")}


def position_sums(steps: list[Any], field: str) -> list[int]:
    """Per draft position k = 1.., the sum over steps of StepStats.accepted_pos / drafted_pos (rows with position k
    accepted / drafted)."""
    sums: list[int] = []
    for s in steps:
        for k, c in enumerate(getattr(s, field)):
            if k == len(sums):
                sums.append(0)
            sums[k] += c
    return sums


def conditional_rates(r: dict[str, Any]) -> list[float]:
    """P(position k accepted | position k-1 accepted) per k (position 0 = the root, always 'accepted'): a chain
    with a constant rate a has accept length (1 - a^(d+1)) / (1 - a) at depth d."""
    prev, rates = float(r["spec_rows"]), []
    for a, d in zip(r["accepted_pos"], r["drafted_pos"], strict=True):
        rates.append(a / prev if prev and d else 0.0)
        prev = float(a)
    return rates


def accept_len_at(r: dict[str, Any], depth: int) -> float:
    """Accept length a chain of `depth` drafts would have had in this run (its first `depth` positions behave as
    they did here): 1 (the recovered / bonus token) + accepted positions 1..depth per row."""
    rows = r["spec_rows"]
    return 1.0 + sum(r["accepted_pos"][:depth]) / rows if rows else 1.0


# ------------------------------------------------------------------------------------------------------ recipes
RECIPES: dict[str, EagleConfig] = {  # drafter training recipes, same steps and seed each
    "eagle1": EagleConfig(),  # teacher forcing on the target's features (TLT, EAGLE-1 without noise)
    "eagle1-noise": EagleConfig(feature_noise=0.1),  # + EAGLE-1's uniform feature noise U(-0.1, 0.1)
    "eagle1-ttt2": EagleConfig(ttt_steps=2),  # + training-time test: a second step fed its own predicted feature
    "eagle1-ttt3": EagleConfig(ttt_steps=3),  # + a third unrolled step (EAGLE-3's recipe, EAGLE-1's layer)
    "eagle3": EagleConfig(kind="eagle3"),  # EAGLE-3's features (target layers 2, L//2, L-3), own head (full vocab)
    "eagle3-ttt3": EagleConfig(kind="eagle3", ttt_steps=3),  # + EAGLE-3's three-step training-time test
}

FINAL_STEPS = 200  # training loss / accuracy are reported over the last this many steps


@dataclass
class Responses:
    """The target's responses to the training prompts, and the training buffer of each drafter kind."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # response token ids per prompt
    counts: torch.Tensor  # [V] response-token counts per id (draft vocabularies come from these)
    gen_s: float
    buffers: dict[str, HiddenStateBuffer]  # drafter kind -> buffer ("eagle3" made on first use)


def generate_responses(target: Transformer, prompts: list[list[int]], params: RequestSampling,
                       eos: tuple[int, ...], max_len: int, gb: float, chunk: int = 2048) -> Responses:
    """The target's responses to `prompts`, `chunk` prompts per engine (its KV cache holds one chunk); the engine's
    hidden hook fills the EAGLE-1 buffer (response rows)."""
    dev = target.head_weight.device
    buf = HiddenStateBuffer(target.args.dim, int(gb * 2**30), device=dev, dtype=resolve_dtype(None, dev))
    capture = EngineCapture(buf)
    gen = Engine(target, eos_ids=eos, config=EngineConfig(max_len=max_len, max_slots=min(len(prompts), chunk)),
                 hidden_hook=capture)
    t0 = time.perf_counter()
    seqs = []
    for i in range(0, len(prompts), chunk):
        capture.reset()  # generate() numbers requests from 0 again: a new id range
        seqs += gen.generate([Request(p, params) for p in prompts[i: i + chunk]]).sequences
    secs = time.perf_counter() - t0
    toks = torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64)
    counts = torch.bincount(toks, minlength=target.args.vocab_size)[: target.args.vocab_size]
    log.info("responses: %d tokens in %.1f s, buffer %d rows", toks.numel(), secs, len(buf))
    return Responses(prompts, [list(s.tokens) for s in seqs], counts, secs, {"eagle1": buf})


def buffer_for(target: Transformer, resp: Responses, kind: str, gb: float) -> HiddenStateBuffer:
    """The buffer a drafter of `kind` trains on. EAGLE-3's rows (3 target layers' inputs + the final hidden) are
    teacher-forced (warmup.capture_eagle3_rows), in a budget 4x the EAGLE-1 one (rows 4x as wide: the same rows fit)."""
    if kind not in resp.buffers:
        template = EagleDrafter(target, EagleConfig(kind="eagle3"))
        dev = target.head_weight.device
        buf = HiddenStateBuffer(template.feature_dim + target.args.dim, int(4 * gb * 2**30), device=dev,
                                dtype=resolve_dtype(None, dev))
        capture_eagle3_rows(buf, target, template, resp.prompts, resp.tokens)
        resp.buffers[kind] = buf
    return resp.buffers[kind]


def train_recipe(target: Transformer, resp: Responses, cfg: EagleConfig, a: argparse.Namespace,
                 checkpoints: list[int] | None = None) -> Iterator[tuple[EagleDrafter, dict[str, Any]]]:
    """A fresh drafter (seed 0) trained on the buffer, yielded at each of `checkpoints` (total steps, increasing;
    None: [--train-steps]) with its training figures there: drafter/loss and drafter/acc averaged over the
    FINAL_STEPS steps before it, the steps and the training seconds so far."""
    torch.manual_seed(0)
    drafter = EagleDrafter(target, cfg).to(target.head_weight.device)
    buf = buffer_for(target, resp, cfg.kind, a.buffer_gb)
    tr = SpotTrainer(drafter, buf, SpotTrainerConfig(batch_size=a.batch, window=a.window, learning_rate=a.lr))
    done, spent = 0, 0.0
    for until in checkpoints or [a.train_steps]:
        final = min(FINAL_STEPS, until - done)
        t0 = time.perf_counter()
        tr.train(lambda: False, until - done - final)
        tr.metrics()  # resets the running averages
        tr.train(lambda: False, final)
        fig = tr.metrics()
        spent += time.perf_counter() - t0
        done = until
        yield drafter, {**fig, "steps": until, "train_s": spent}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--gguf", default="", help="a GGUF file instead of --model (e.g. the SmolLM2 file, copied)")
    ap.add_argument("--recipes", default="eagle1,eagle1-ttt3", help=f"comma-separated, of {', '.join(RECIPES)}")
    ap.add_argument("--train-prompts", type=int, default=256)
    ap.add_argument("--train-new-tokens", type=int, default=0, help="training responses' max length (0: --new-tokens)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=1500)
    ap.add_argument("--checkpoints", default="", help="comma-separated step counts (< --train-steps) at which each "
                    "recipe is evaluated too: accept length against training budget")
    ap.add_argument("--gen-chunk", type=int, default=2048, help="training prompts decoded per engine (KV cache)")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts decoded at once (the tail)")
    ap.add_argument("--arms", default="chain k=6", help=f"comma-separated, of {', '.join(a for a in ARMS if a != 'off')}")
    ap.add_argument("--draft-vocab", default="0", help="comma-separated draft vocabulary sizes (0: all tokens)")
    ap.add_argument("--batch", type=int, default=16, help="training windows per step")
    ap.add_argument("--window", type=int, default=128, help="rows per training window")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--buffer-gb", type=float, default=2.0)
    ap.add_argument("--top-k", type=int, default=0, help="responses sample from the top-k tokens (0: all; HF: 50)")
    ap.add_argument("--temperatures", default="1.0", help="comma-separated evaluation temperatures")
    ap.add_argument("--export", default="", help="export the recipe with the longest chain accept length here")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    checkpoints = sorted({int(c) for c in a.checkpoints.split(",")} | {a.train_steps}) if a.checkpoints else None
    if checkpoints and not 0 < checkpoints[0] <= checkpoints[-1] == a.train_steps:
        ap.error(f"--checkpoints must be step counts in 1..--train-steps ({a.train_steps}), got {a.checkpoints}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dev = torch.device(a.device)
    source = ModelSource(gguf=a.gguf) if a.gguf else ModelSource(builtin=a.model)
    target, tok = load_model(source, dev)
    eos = tuple(getattr(tok, "eos_ids", target.args.eos_token_ids))
    train_rows, val_rows = split_examples(load_examples(DatasetSource()), 64)
    sysmsg = DatasetSource().system_prompt
    train_p = [list(p.ids) for p in render_examples(train_rows[: a.train_prompts], tok, sysmsg, 384)]
    eval_p = [list(p.ids) for p in render_examples(val_rows[: a.eval_prompts], tok, sysmsg, 384)]
    train_new = a.train_new_tokens or a.new_tokens
    max_len = max(len(p) for p in train_p + eval_p) + max(train_new, a.new_tokens) + 8
    params = RequestSampling(temperature=1.0, top_k=a.top_k, max_new_tokens=train_new)  # RL rollouts: T=1
    resp = generate_responses(target, train_p, params, eos, max_len, a.buffer_gb, a.gen_chunk)
    vocabs = [int(v) for v in a.draft_vocab.split(",")]
    arms = [x.strip() for x in a.arms.split(",")]
    evals = {float(t): RequestSampling(temperature=float(t), top_k=a.top_k, max_new_tokens=a.new_tokens)
             for t in a.temperatures.split(",")}
    offs = {}
    for temp, ev in evals.items():
        offs[temp] = run_arm(target, None, eval_p, ev, "off", eos, max_len)
        offs[temp].update(recipe="-", draft_vocab=0, temperature=temp)
    results: list[dict[str, Any]] = list(offs.values())
    best: tuple[float, dict[str, torch.Tensor], EagleConfig] | None = None  # (chain accept, weights, cfg)
    for name in (x.strip() for x in a.recipes.split(",")):
        for drafter, fig in train_recipe(target, resp, RECIPES[name], a, checkpoints):
            log.info("%s: %s", name, fig)
            serve = EagleDrafter(target, drafter.cfg).to(dev, target.head_weight.dtype)  # the engine's copy
            serve.load_state_dict(drafter.state_dict())
            for temp, ev in evals.items():
                for arm in arms:
                    for nv in vocabs:
                        if nv and (ARMS[arm].topk != 1 or serve.cfg.kind != "eagle1" or nv >= target.args.vocab_size):
                            continue  # draft vocabularies: EAGLE-1 chains (EAGLE-3 drafts over its own head)
                        prop = EagleProposer(serve, EagleProposerConfig())
                        if nv:
                            prop.set_draft_vocab(torch.topk(resp.counts.float(), nv).indices)
                        r = run_arm(target, None, eval_p, ev, arm, eos, max_len, proposer=prop, time_propose=False)
                        r.update(recipe=name, draft_vocab=nv, temperature=temp, train=fig,
                                 speedup=r["tokens_per_s"] / offs[temp]["tokens_per_s"])
                        results.append(r)
                        log.info("%s", r)
                        if arm.startswith("chain") and not nv and (best is None or r["accept_len"] > best[0]):
                            best = (r["accept_len"], {k: v.clone() for k, v in drafter.state_dict().items()},
                                    drafter.cfg)
    print(f"{'T':>4} {'recipe':<14}{'steps':>7} {'decoding':<20}{'vocab':>6}{'acc':>6}{'accept':>8}{'@d4':>6}"
          f"  {'P(k | k-1), k = 1..':<36}{'tok/s':>9}{'vs off':>8}")
    for r in results:
        rates = " ".join(f"{x:.2f}" for x in conditional_rates(r)) if r["arm"] != "off" else ""
        acc = f"{r['train']['drafter/acc']:.3f}" if "train" in r else "-"
        steps = r["train"]["steps"] if "train" in r else "-"
        print(f"{r['temperature']:>4.1f} {r['recipe']:<14}{steps:>7} {r['arm']:<20}{r['draft_vocab']:>6}{acc:>6}"
              f"{r['accept_len']:>8.2f}{accept_len_at(r, 4):>6.2f}  {rates:<36}{r['tokens_per_s']:>9.0f}"
              f"{r.get('speedup', 1.0):>8.2f}")
    if a.export and best is not None:
        keep = EagleDrafter(target, best[2]).to(dev)
        keep.load_state_dict(best[1])
        export_drafter(keep, a.export)
        log.info("exported the drafter of chain accept length %.2f to %s", best[0], a.export)
    summary = {"results": results, "gen_s": resp.gen_s, "settings": vars(a),
               "buffer_rows": {k: len(b) for k, b in resp.buffers.items()}}
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
