"""The rollout as the trainer calls it, built around the rollout engine (worker/tlt/rollout/engine.py).

    rollout = make_rollout(spec, model, tokenizer, device)
    trajs, sd_metrics = rollout(prompts, n=8, greedy=False)
    rollout.generator            # the engine's torch.Generator (checkpointed for exact resume)

Colocated weight sync: the engine is built on the very `Transformer` the trainer updates (optimizer steps write the
parameters in place, so even captured CUDA graphs keep pointing at the live weights); `on_weights_updated` has
nothing to copy and only exists for engines that cache derived state.

Speculative decoding (`rollout.speculative`, `drafter.kind`; job_spec_translate.py `speculation` decides, this module builds):
- `off`: plain decoding.
- `on` + `eagle1` / `eagle3`: the adaptive drafter (speculative/drafter/online.py `OnlineDrafter`): the engine drafts with its
  published weights and captures hidden states through its hook; the trainer's drafter hook spot-trains it after the
  update. EAGLE-3 builds the engine with `capture_layers` = its three feature layers (hook rows [N, 4H]).
- `on` + `ngram`: the model-free n-gram drafter over each sequence and its GRPO siblings (speculative/proposers/ngram.py).
  `on` drafts with one fixed arm (`AdaptiveSd.fixed`-style controller from the spec): a chain of `draft_depth`
  tokens, or a tree when `draft_topk > 1`, for either drafter; the engine verifies losslessly.
- `adaptive`: the engine asks `adaptive.AdaptiveSd` every decode step: SD on below `sd_on_below` active
  sequences (hysteresis `sd_patience`), the arm (drafter x depth x top-k x verify width, or plain decoding) chosen
  per batch-size bucket by the spec's bandit. Drafters: the n-gram drafter always (cold start, sees the GRPO
  siblings), plus the EAGLE drafter when `drafter.kind` is eagle1 or eagle3 (whose spot trainer also gets the engine's
  tail hook: bounded training steps between tail decode steps). The bandit keeps what it learned across RL steps.
  The rollout's metrics are the controller's (sd/on_fraction, sd/accept_len, sd/accept_rate_pos_k, sd/arm/<name>,
  perf/tokens_per_s_{full,tail,bucket/<b>}).
- `on` with `none` is not wired: it runs SD off and says so in the log. sd/on_fraction always reports
  what actually ran.
Finished responses reach the caller's `on_finish` through the engine's own `on_finish` callback (so rewards are
scored while the tail still decodes), or after generate() returns for an engine built without one
(`streams_finished=False`).
Validation rollouts (greedy) run `Engine.generate(..., plain=True)`: plain decoding with no hidden-state capture, so
they never feed the drafter's buffer nor the controller's bandit.
Memory for the update (`rollout.release_kv_for_update`): a training rollout ends by freeing the engine's KV
cache and its graphs (rollout/memory.py), so the GRPO update that follows has that memory; the next call (training
or validation) allocates it again first. Metrics of a training rollout: `perf/kv_released_gb` (freed at its end) and
`timing_s/kv_restore` (allocating it back at its start; the graphs' re-capture lands in `timing_s/gen`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.job_spec_translate import controller, drafter_config, engine_config, request_sampling, speculation
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.rollout_io import FinishCallback, Trajectory
from worker.tlt.rollout.adaptive_loop import TailHook
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import (
    GenerationOutput,
    Request,
    RequestSampling,
    SequenceResult,
)
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramConfig, NGramProposer
from worker.tlt.speculative.proposers.protocol import Proposer

if TYPE_CHECKING:
    from worker.tlt.speculative.drafter.online import OnlineDrafter

log = logging.getLogger(__name__)


def sd_metrics(out: GenerationOutput) -> dict[str, float]:
    """sd/* metrics of one generate(): the adaptive controller's summary when it ran (speculative/control/sd_metrics.py names),
    else the share of tokens emitted by speculative steps and the mean tokens per verify."""
    if out.sd_metrics:
        return dict(out.sd_metrics)
    emitted = sum(s.emitted for s in out.steps if s.kind != "prefill")
    spec = [s for s in out.steps if s.kind == "spec"]
    spec_emitted = sum(s.emitted for s in spec)
    decode_steps = sum(s.kind != "prefill" for s in out.steps)
    m = {"sd/on_fraction": spec_emitted / emitted if emitted else 0.0,
         "sd/spec_step_fraction": len(spec) / decode_steps if decode_steps else 0.0}
    if spec:
        rows = sum(s.active for s in spec)
        m["sd/accept_len"] = spec_emitted / rows if rows else 0.0  # emitted tokens per sequence per verify
        m["sd/accepted_draft_tokens"] = float(sum(s.accepted for s in spec))
    return m


class RolloutEngine(Protocol):
    """What `EngineRollout` needs of an engine (rollout/engine.py `Engine`)."""

    @property
    def gen(self) -> torch.Generator: ...

    def generate(self, requests: Sequence[Request], on_finish: Callable[[SequenceResult], None] | None = None, *,
                 plain: bool = False) -> GenerationOutput: ...

    def release_memory(self) -> int: ...

    def restore_memory(self) -> None: ...


class EngineRollout:
    """`Rollout` over an `Engine`: prompts x n samples -> Trajectories grouped by prompt."""

    def __init__(self, engine: RolloutEngine, tokenizer: TokenizerLike, sampling: RequestSampling,
                 release_kv: bool = False, drafter: OnlineDrafter | None = None, controller: AdaptiveSd | None = None,
                 streams_finished: bool = True) -> None:
        """sampling: the training rollouts' settings (n and greedy are per call); release_kv: free the engine's KV
        cache after training rollouts (rollout.release_kv_for_update); controller: the one the engine plans with;
        streams_finished: whether the engine calls `generate(..., on_finish=)` as each sequence finishes (ours
        does; an engine that cannot has every response handed over after generate returns)."""
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.controller = controller
        self.drafter = drafter  # also the trainer's DrafterHook when set
        self.rollouts = 0  # training rollouts so far (the drafter buffer's step numbers)
        self.release_kv = release_kv
        self.streams_finished = streams_finished

    @property
    def generator(self) -> torch.Generator:
        return self.engine.gen

    @property
    def sd_controller(self) -> AdaptiveSd | None:
        return self.controller

    def __call__(
        self, prompts: Sequence[RenderedPrompt], n: int, greedy: bool, on_finish: FinishCallback | None = None
    ) -> tuple[list[Trajectory], dict[str, float]]:
        params = replace(self.sampling.greedy() if greedy else self.sampling, n=n)
        requests = [Request(list(p.ids), params) for p in prompts]

        def trajectory(s: SequenceResult) -> Trajectory:
            return Trajectory(prompts[s.request], tuple(s.tokens), tuple(s.logprobs), s.finish_reason)

        def engine_on_finish(s: SequenceResult) -> None:
            assert on_finish is not None
            on_finish(s.request * n + s.sample, trajectory(s))

        stream = engine_on_finish if on_finish is not None and self.streams_finished else None
        t0 = time.perf_counter()
        if self.release_kv:  # released by the previous training rollout: allocated again before generating
            self.engine.restore_memory()
        restore_s = time.perf_counter() - t0
        if greedy:  # validation: plain decoding, nothing captured, the bandit untouched
            out = self.engine.generate(requests, stream, plain=True)
        else:
            self.rollouts += 1
            if self.drafter is not None:
                self.drafter.begin_rollout(self.rollouts)
            out = self.engine.generate(requests, stream)
            if self.drafter is not None:
                self.drafter.observe_rollout(out)
        trajs = [trajectory(s) for s in out.sequences]  # ordered by (request, sample)
        if on_finish is not None and stream is None:  # an engine without the callback: hand them over now
            for i, t in enumerate(trajs):
                on_finish(i, t)
        metrics = sd_metrics(out)
        if self.release_kv and not greedy:  # the policy update comes next: hand it the cache's memory
            metrics["perf/kv_released_gb"] = self.engine.release_memory() / 2**30
            metrics["timing_s/kv_restore"] = restore_s
        return trajs, metrics

    def on_weights_updated(self) -> None:
        """Colocated: the engine runs the trained module itself, so there is nothing to copy."""


def tail_trainer(drafter: OnlineDrafter) -> TailHook:
    """The engine's tail hook for the drafter: spot-train steps until the budget the engine grants runs out (a step
    is never cut, so one may overrun; the engine charges it to its credit)."""

    def hook(budget_s: float) -> int:
        deadline = time.perf_counter() + budget_s
        return drafter.train_in_tail(lambda: time.perf_counter() >= deadline, max_steps=1)

    return hook


def make_rollout(spec: JobSpec, model: Transformer, tokenizer: TokenizerLike, device: torch.device,
                 tail_training: bool = True) -> EngineRollout:
    """The trainer's rollout over an engine built from the spec (job_spec_translate.py translates every setting).
    tail_training: whether the engine spot-trains the online drafter between its tail steps (off for a rank of a
    data-parallel job: each rank would train its own copy and the copies diverge; multigpu/harvest.py trains it)."""
    sd = speculation(spec)
    if sd.warning is not None:
        log.warning(sd.warning)
    drafter: OnlineDrafter | None = None
    if sd.learned:  # the learned, spot-trained drafter
        from worker.tlt.speculative.drafter.online import OnlineDrafter  # imported only by jobs that train a drafter

        drafter = OnlineDrafter(drafter_config(spec), model)
    proposers: dict[str, Proposer] = {}
    for kind in sd.drafters:
        proposers[kind] = drafter.proposer if kind == "eagle" and drafter is not None else NGramProposer(NGramConfig())
    ctl = controller(spec, sd.drafters) if sd.controlled else None
    tail_hook = tail_trainer(drafter) if drafter is not None and sd.tail_training and tail_training else None
    config = engine_config(spec, model, drafter.capture_layers if drafter is not None else ())
    engine = Engine(model, eos_ids=tokenizer.eos_ids, config=config, controller=ctl, proposers=proposers,
                    hidden_hook=drafter.hidden_hook if drafter is not None else None, tail_hook=tail_hook)
    if device.type == "cuda":  # capture every CUDA graph now, not inside the first step's timed rollout
        engine.warmup(engine.slots, config.max_len, params=replace(request_sampling(spec), max_new_tokens=1))
    return EngineRollout(engine, tokenizer, request_sampling(spec), spec.rollout.release_kv_for_update, drafter, ctl)
