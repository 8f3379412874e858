"""The rollout as the trainer calls it, built around the rollout engine (worker/tlt/rollout/engine.py).

    rollout = make_rollout(spec, model, tokenizer, device)
    trajs, sd_metrics = rollout(prompts, n=8, greedy=False)
    rollout.generator            # the engine's torch.Generator (checkpointed for exact resume)

Colocated weight sync: the engine is built on the very `Transformer` the trainer updates (optimizer steps write the
parameters in place, so even captured CUDA graphs keep pointing at the live weights); `on_weights_updated` has
nothing to copy and only exists for engines that cache derived state.

Speculative decoding (`rollout.speculative`, `drafter.kind`):
- `off`: plain decoding.
- `on` + `eagle1`: the adaptive drafter (drafter/online.py `OnlineDrafter`): the engine drafts with its published
  weights and captures hidden states through its hook; the trainer's drafter hook spot-trains it after the update.
- `on` + `ngram`: the model-free n-gram drafter over each sequence and its GRPO siblings (spec/ngram.py).
  Drafts are a chain of `draft_depth` tokens, or a tree when `draft_topk > 1`; the engine verifies losslessly.
- `adaptive` (switch by batch size + bandit, issue 4) is not wired into this engine yet: it runs SD off and says
  so in the log; `on` with `eagle3` / `none` likewise. sd/on_fraction always reports what actually ran.
Validation rollouts (greedy) run plain decoding with the hook detached, so they never feed the drafter's buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.rollout_io import Trajectory
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.kv_cache import slots_for_budget
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, SamplingParams, SpecConfig
from worker.tlt.spec.ngram import NGramConfig, NGramProposer
from worker.tlt.spec.proposer import Proposer

if TYPE_CHECKING:
    from worker.tlt.drafter.online import OnlineDrafter

log = logging.getLogger(__name__)


def sd_metrics(out: GenerationOutput) -> dict[str, float]:
    """sd/* metrics of one generate(): share of tokens emitted by speculative steps, mean tokens per verify."""
    emitted = sum(s.emitted for s in out.steps if s.kind != "prefill")
    spec = [s for s in out.steps if s.kind == "spec"]
    spec_emitted = sum(s.emitted for s in spec)
    m = {"sd/on_fraction": spec_emitted / emitted if emitted else 0.0}
    if spec:
        rows = sum(s.active for s in spec)
        m["sd/accept_len"] = spec_emitted / rows if rows else 0.0  # emitted tokens per sequence per verify
        m["sd/accepted_draft_tokens"] = float(sum(s.accepted for s in spec))
    return m


class EngineRollout:
    """`RolloutFn` over an `Engine`: prompts x n samples -> Trajectories grouped by prompt."""

    def __init__(self, engine: Engine, tokenizer: TokenizerLike, spec: JobSpec,
                 drafter: OnlineDrafter | None = None) -> None:
        self.engine, self.tokenizer, self.algo = engine, tokenizer, spec.algorithm
        self.drafter = drafter  # also the trainer's DrafterHook when set
        self.rollouts = 0  # training rollouts so far (the drafter buffer's step numbers)

    @property
    def generator(self) -> torch.Generator:
        return self.engine.gen

    def __call__(
        self, prompts: Sequence[RenderedPrompt], n: int, greedy: bool
    ) -> tuple[list[Trajectory], dict[str, float]]:
        a = self.algo
        params = SamplingParams(
            temperature=0.0 if greedy else a.temperature, top_p=a.top_p, top_k=a.top_k,
            max_new_tokens=a.max_completion_length, n=n,
        )
        requests = [Request(list(p.ids), params) for p in prompts]
        if greedy:  # validation: plain decoding, nothing captured
            proposer, hook = self.engine.proposer, self.engine.hidden_hook
            self.engine.proposer, self.engine.hidden_hook = None, None
            try:
                out = self.engine.generate(requests)
            finally:
                self.engine.proposer, self.engine.hidden_hook = proposer, hook
        else:
            self.rollouts += 1
            if self.drafter is not None:
                self.drafter.begin_rollout(self.rollouts)
            out = self.engine.generate(requests)
            if self.drafter is not None:
                self.drafter.observe_rollout(out)
        trajs = [
            Trajectory(prompts[s.request], tuple(s.tokens), tuple(s.logprobs), s.finish_reason)
            for s in out.sequences  # ordered by (request, sample)
        ]
        return trajs, sd_metrics(out)

    def on_weights_updated(self) -> None:
        """Colocated: the engine runs the trained module itself, so there is nothing to copy."""


def make_rollout(spec: JobSpec, model: Transformer, tokenizer: TokenizerLike, device: torch.device) -> EngineRollout:
    algo, ro = spec.algorithm, spec.rollout
    max_len = spec.dataset.max_prompt_length + algo.max_completion_length
    dtype = model.head_weight.dtype
    # every sequence of a step resident at once, within the KV budget (validation batches queue behind them)
    slots = min(algo.prompts_per_step * algo.num_generations, slots_for_budget(model.args, max_len + 80,
                                                                                ro.kv_cache_gb, dtype))
    config = EngineConfig(
        max_len=max_len, max_slots=max(slots, 1), kv_cache_gb=ro.kv_cache_gb, cuda_graphs=ro.cuda_graphs,
        seed=ro.seed + spec.seed,
    )
    spec_cfg = SpecConfig(mode="off")
    proposer: Proposer | None = None
    drafter: OnlineDrafter | None = None
    hook = None
    kind = spec.drafter.kind
    if ro.speculative == "on" and kind in ("eagle1", "ngram"):
        tree = ro.draft_topk > 1
        spec_cfg = SpecConfig(mode="on", method="tree" if tree else "chain", depth=ro.draft_depth,
                              topk=ro.draft_topk, verify_tokens=max(ro.verify_tokens, 2))
        if kind == "eagle1":
            from worker.tlt.drafter.online import OnlineDrafter  # imported only by jobs that train a drafter

            drafter = OnlineDrafter(spec, model)
            proposer, hook = drafter.proposer, drafter.hidden_hook
        else:
            proposer = NGramProposer(NGramConfig(topk=ro.draft_topk))
    elif ro.speculative != "off":
        log.warning("rollout.speculative=%s with drafter.kind=%s is not wired into the trainer's engine yet; "
                    "running SD off", ro.speculative, kind)
    engine = Engine(model, eos_ids=tokenizer.eos_ids, config=config, spec=spec_cfg, proposer=proposer,
                    hidden_hook=hook)
    return EngineRollout(engine, tokenizer, spec, drafter)
