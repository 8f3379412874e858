"""The `drafter` job type: warm up a drafter for a model from a prompt dataset, then export it.

Each round (`spec.max_steps` rounds) the target generates one response per prompt for `prompts_per_step` prompts with
the rollout engine (plain decoding, the spec's temperature / top-p / top-k and max_completion_length); the engine's
hidden hook fills the buffer (EAGLE-1: the final-norm hidden, no extra forward). EAGLE-3 needs the hidden states
entering three target layers, which the engine hook does not report, so for it the responses are re-read by one
teacher-forced target forward per round. Then the spot trainer runs `drafter.max_train_steps_per_rl_step` steps.
Every round's rows stay in the buffer (up to its budget): the target does not move. Metrics per round:
drafter/{loss,acc,steps,buffer_rows}, timing_s/{gen,drafter}; at the end the drafter is exported in its own
form (EAGLE-3 when `drafter.kind == "eagle3"`, else EAGLE-1) under `out_dir` and reported as a `drafter` artifact.

    warmup(spec, target, tokenizer, prompts, reporter, out_dir=Path("runs/x/drafter"))
Run the tests: `python -m pytest tests/drafter/test_drafter_warmup.py -q`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from worker.tlt.config import JobSpec
from worker.tlt.job_spec_translate import drafter_config, request_sampling, warmup_engine_config
from worker.tlt.model.load import resolve_dtype
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.reporting import Reporter
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import Request
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.speculative.drafter.export import export_drafter
from worker.tlt.speculative.drafter.model import EagleDrafter
from worker.tlt.speculative.drafter.online import build_drafter
from worker.tlt.speculative.drafter.spot_trainer import SpotTrainer, SpotTrainerConfig

log = logging.getLogger(__name__)


def capture_eagle3_rows(buffer: HiddenStateBuffer, target: Transformer, drafter: EagleDrafter,
                        prompts: Sequence[list[int]], responses: Sequence[list[int]]) -> None:
    """Teacher-forced features for EAGLE-3 into the buffer: per sequence (its index as the sequence id), tokens and
    rows [N, 3H + H] from the last prompt position through the response (the engine hook reports the final hidden
    only, so each response is re-read by one target forward)."""
    dev = target.head_weight.device
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            ids = torch.tensor([p + r], device=dev)
            _, h, cap = target.forward_hidden(ids, layers=drafter.feature_layers, compute_logits=False)
            rows = torch.cat([drafter.features(h, cap), h], dim=-1)[0, len(p) - 1:]
            toks = ids[0, len(p) - 1:]
            buffer.capture(torch.full((toks.shape[0],), i, dtype=torch.int64), toks, rows)


def warmup(
    spec: JobSpec,
    target: Transformer,
    tokenizer: TokenizerLike,
    prompts: Sequence[list[int]],  # chat-templated prompt token ids
    reporter: Reporter,
    out_dir: Path | str = Path("drafter"),  # where the exported drafter goes
    eos_ids: Sequence[int] | None = None,  # default: the tokenizer's `eos_ids` / the model's
) -> Path:
    if not prompts:
        raise ValueError("warm-up needs at least one prompt")
    dev = target.head_weight.device
    cfg = drafter_config(spec)
    drafter = build_drafter(cfg, target)
    width = drafter.feature_dim + (drafter.args.dim if drafter.cfg.kind == "eagle3" else 0)
    # the target is frozen here, so every round's responses stay valid training rows (an RL step keeps two: its
    # policy moves); the ring's budget bounds them. More responses and steps raised the H200 chain accept length
    # 2.28 -> 2.48 (2,048 -> 7,168 responses, 6,000 -> 24,000 steps: bench/results/drafter_recipes_h200.md)
    buffer = HiddenStateBuffer(width, int(cfg.buffer_gb * 2**30), device=dev,
                               dtype=resolve_dtype(None, dev), keep_steps=spec.max_steps)
    trainer = SpotTrainer(drafter, buffer, SpotTrainerConfig(learning_rate=cfg.learning_rate, seed=cfg.seed))
    capture = EngineCapture(buffer)
    eos = tuple(eos_ids if eos_ids is not None else getattr(tokenizer, "eos_ids", target.args.eos_token_ids))
    alg = spec.algorithm
    engine = Engine(target, eos_ids=eos, config=warmup_engine_config(spec, target),
                    hidden_hook=capture if drafter.cfg.kind == "eagle1" else None)
    params = request_sampling(spec)
    n = alg.prompts_per_step
    for rnd in range(spec.max_steps):
        if reporter.should_stop():
            reporter.log(f"drafter warm-up cancelled at round {rnd}")
            break
        batch = [list(prompts[(rnd * n + i) % len(prompts)]) for i in range(n)]
        buffer.begin_step(rnd)
        capture.reset()
        t0 = time.perf_counter()
        out = engine.generate([Request(p, params) for p in batch])
        if drafter.cfg.kind == "eagle3":
            capture_eagle3_rows(buffer, target, drafter, batch, [s.tokens for s in out.sequences])
            if rnd == 0 and drafter.draft_vocab_size < drafter.args.vocab_size:
                drafter.set_draft_vocab(buffer.token_counts(drafter.args.vocab_size))
        t_gen = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.train(lambda: reporter.should_stop(), cfg.max_train_steps_per_rl_step)
        m = trainer.metrics()
        m.update({"timing_s/gen": t_gen, "timing_s/drafter": time.perf_counter() - t1,
                  "drafter/buffer_rows": float(len(buffer)),
                  "perf/tokens_per_s": out.tokens / max(out.seconds, 1e-9)})
        reporter.metrics(rnd, m)
        log.info("drafter warm-up round %d: %s", rnd, m)
    out_path = Path(out_dir)
    export_drafter(drafter, out_path, spec.drafter.export_kind)
    reporter.artifact("drafter", out_path, step=trainer.steps)
    reporter.log(f"drafter exported to {out_path} ({drafter.cfg.kind}, {trainer.steps} steps)")
    return out_path
