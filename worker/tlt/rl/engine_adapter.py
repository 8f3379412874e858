"""The rollout as the trainer calls it, built around the rollout engine (worker/tlt/rollout/engine.py).

    rollout = make_rollout(spec, model, tokenizer, device)
    trajs, sd_metrics = rollout(prompts, n=8, greedy=False)
    rollout.generator            # the engine's torch.Generator (checkpointed for exact resume)

Colocated weight sync: the engine is built on the very `Transformer` the trainer updates (optimizer steps write the
parameters in place, so even captured CUDA graphs keep pointing at the live weights); `on_weights_updated` has
nothing to copy and only exists for engines that cache derived state.

Speculative decoding: `rollout.speculative: off` runs plain decoding. `on` / `adaptive` need a drafter from the
drafter / adaptive-engine packages; until one is wired in here the rollout runs with SD off and logs it once
(sd/on_fraction reports 0, honestly).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.rollout_io import Trajectory
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.kv_cache import slots_for_budget
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, SamplingParams, SpecConfig

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

    def __init__(self, engine: Engine, tokenizer: TokenizerLike, spec: JobSpec) -> None:
        self.engine, self.tokenizer, self.algo = engine, tokenizer, spec.algorithm

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
        out = self.engine.generate([Request(list(p.ids), params) for p in prompts])
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
    if ro.speculative != "off":
        log.warning("rollout.speculative=%s: no drafter is wired into the trainer's engine yet; running SD off",
                    ro.speculative)
    engine = Engine(model, eos_ids=tokenizer.eos_ids, config=config, spec=SpecConfig(mode="off"))
    return EngineRollout(engine, tokenizer, spec)
