"""The one translation from a job spec into the typed configs of the parts that run it: the engine's
`EngineConfig`, the requests' `RequestSampling`, the SD controller (`AdaptiveSd`) and the online drafter's
`OnlineDrafterConfig`. The engine, the controller and the drafter never read the job spec themselves; the loss reads
`spec.algorithm` (AlgorithmConfig) as is.

    cfg = engine_config(spec, model, capture_layers=())     # KV budget, slots, graphs, kernels, seed
    sampling = request_sampling(spec, n=8, greedy=False)    # temperature / top_p / top_k / max_new_tokens
    ctl = controller(spec, drafters=["ngram", "eagle"])     # off / one fixed arm / adaptive
    od_cfg = drafter_config(spec)                           # EAGLE-1 / EAGLE-3 spot-trained drafter

Run the tests: `python -m pytest tests/adaptive/test_adaptive_engine_trainer.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.tlt.adaptive.arms import DrafterKind
from worker.tlt.adaptive.controller import AdaptiveSd
from worker.tlt.adaptive.step_costs import StepCostConfig
from worker.tlt.config import JobSpec
from worker.tlt.decoding.kv_cache import slots_for_budget
from worker.tlt.drafter.online_config import OnlineDrafterConfig
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.types import EngineConfig, RequestSampling

KV_SLACK = 80  # KV columns per row past prompt + completion when sizing the slots (verify headroom)


def max_len(spec: JobSpec) -> int:
    """Prompt + completion tokens per sequence."""
    return spec.dataset.max_prompt_length + spec.algorithm.max_completion_length


def engine_config(spec: JobSpec, model: Transformer, capture_layers: tuple[int, ...] = ()) -> EngineConfig:
    """Every sequence of an RL step resident at once, within the KV budget (validation batches queue behind them)."""
    algo, ro = spec.algorithm, spec.rollout
    n = max_len(spec)
    fit = slots_for_budget(model.args, n + KV_SLACK, ro.kv_cache_gb, model.head_weight.dtype)
    return EngineConfig(max_len=n, max_slots=max(min(algo.prompts_per_step * algo.num_generations, fit), 1),
                        kv_cache_gb=ro.kv_cache_gb, cuda_graphs=ro.cuda_graphs, fused_kernels=ro.fused_kernels,
                        seed=ro.seed + spec.seed, capture_layers=capture_layers)


def request_sampling(spec: JobSpec, n: int = 1, greedy: bool = False) -> RequestSampling:
    """The rollout's sampling settings (greedy: the validation rollouts' temperature 0)."""
    a = spec.algorithm
    return RequestSampling(temperature=0.0 if greedy else a.temperature, top_p=a.top_p, top_k=a.top_k,
                           max_new_tokens=a.max_completion_length, n=n)


def controller(spec: JobSpec, drafters: Sequence[DrafterKind]) -> AdaptiveSd:
    """The SD controller of `rollout.speculative` over the drafters the engine has (none: pinned off), switched by
    the active batch or by measured step costs (`rollout.sd_switch`)."""
    costs = StepCostConfig() if spec.rollout.sd_switch == "step_costs" else None
    return AdaptiveSd.from_spec(spec.rollout, drafters=drafters, step_costs=costs)


def drafter_config(spec: JobSpec) -> OnlineDrafterConfig:
    """The online drafter's settings (drafter.kind eagle1 / eagle3; the tail it trains in is the rollout's)."""
    d = spec.drafter
    if d.kind not in ("eagle1", "eagle3"):
        raise ValueError(f"an online drafter is eagle1 or eagle3, not {d.kind}")
    return OnlineDrafterConfig(kind=d.kind, warm_start_dir=d.warm_start_dir, learning_rate=d.learning_rate,
                               buffer_gb=d.buffer_gb, max_train_steps_per_rl_step=d.max_train_steps_per_rl_step,
                               draft_vocab_size=d.draft_vocab_size, tail_below=spec.rollout.sd_on_below,
                               seed=spec.seed)
