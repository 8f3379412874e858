"""The one translation from a job spec into the typed configs of the parts that run it: the engine's
`EngineConfig`, the requests' `RequestSampling`, the SD controller (`AdaptiveSd`) and the online drafter's
`OnlineDrafterConfig`, and which drafters the rollout engine gets (`Speculation`). The engine, the controller and the
drafter never read the job spec themselves; the loss reads `spec.algorithm` (AlgorithmConfig) as is.

    cfg = engine_config(spec, model, capture_layers=())     # KV budget (planned on CUDA), slots, graphs, seed
    cfg = warmup_engine_config(spec, model)                 # the same for a drafter warm-up job's engine
    sampling = request_sampling(spec, n=8, greedy=False)    # temperature / top_p / top_k / max_new_tokens
    sd = speculation(spec)                                  # drafters, controller or not, tail training
    ctl = controller(spec, sd.drafters)                     # off / one fixed arm / adaptive
    od_cfg = drafter_config(spec)                           # EAGLE-1 / EAGLE-3 spot-trained drafter

Run the tests: `python -m pytest tests/adaptive/test_adaptive_engine_trainer.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.tlt.config import CPU_KV_CACHE_GB, JobSpec
from worker.tlt.decoding.kv_cache import pages_for_budget, slots_for_budget
from worker.tlt.model.args import ModelArgs
from worker.tlt.model.memory_plan import plan_kv, plan_pages
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.deepspeed_update import plan_for
from worker.tlt.rollout.types import EngineConfig, RequestSampling
from worker.tlt.speculative.arm import DrafterKind
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.step_costs import StepCostConfig
from worker.tlt.speculative.drafter.online_config import OnlineDrafterConfig

KV_SLACK = 80  # KV columns per row past prompt + completion when sizing the slots (verify headroom)


def max_len(spec: JobSpec) -> int:
    """Prompt + completion tokens per sequence."""
    return spec.dataset.max_prompt_length + spec.algorithm.max_completion_length


def kv_budget(spec: JobSpec, args: ModelArgs, dtype: torch.dtype, free_bytes: int | None,
              sequences: int | None = None) -> tuple[int, float]:
    """(sequences resident at once, KV budget in GB), at most `sequences` (default every sequence of an RL step):
    an explicit `rollout.kv_cache_gb` wins; unset, the plan of `free_bytes` (model/memory_plan.py) when given (CUDA),
    else CPU_KV_CACHE_GB (CPU)."""
    ro = spec.rollout
    want = want_rows(spec) if sequences is None else max(sequences, 1)
    cols = max_len(spec) + KV_SLACK
    if ro.kv_cache_gb is None and free_bytes is not None:
        try:
            plan = plan_kv(args, cols, free_bytes=free_bytes, dtype_bytes=dtype.itemsize, max_batch=want,
                           max_slots=want)
        except ValueError as e:
            raise ValueError(f"rollout.kv_cache_gb unset: {e} (free memory counted after the policy update's peak "
                             "unless rollout.release_kv_for_update; or set rollout.kv_cache_gb)") from e
        return plan.slots, plan.cache_bytes / 2**30
    gb = CPU_KV_CACHE_GB if ro.kv_cache_gb is None else ro.kv_cache_gb
    return max(min(want, slots_for_budget(args, cols, gb, dtype)), 1), gb


def free_for_kv(spec: JobSpec, model: Transformer, device: torch.device) -> int:
    """The device's free memory now, less the update's planned peak when the cache stays during the update (its
    optimizer states are allocated at the first step, after the cache; counted whole, so conservatively)."""
    free, _ = torch.cuda.mem_get_info(device)
    keep = 0.0 if spec.rollout.release_kv_for_update else plan_for(spec, model, device).gpu_bytes
    return int(free - keep)


def engine_config(spec: JobSpec, model: Transformer, capture_layers: tuple[int, ...] = ()) -> EngineConfig:
    """Every sequence of an RL step resident at once, within the KV budget (validation batches queue behind them)."""
    return _engine_config(spec, model, capture_layers, want_rows(spec), beside_update=True)


def warmup_engine_config(spec: JobSpec, model: Transformer) -> EngineConfig:
    """The drafter warm-up's engine (`type: drafter` jobs, speculative/drafter/warmup.py): one response for each of a round's
    `prompts_per_step` prompts resident at once; the target is frozen, so no policy update shares the memory."""
    return _engine_config(spec, model, (), max(spec.algorithm.prompts_per_step, 1), beside_update=False)


def _engine_config(spec: JobSpec, model: Transformer, capture_layers: tuple[int, ...], sequences: int,
                   beside_update: bool) -> EngineConfig:
    ro, device = spec.rollout, model.head_weight.device
    planned = ro.kv_cache_gb is None and device.type == "cuda"
    free = None
    if planned:
        free = free_for_kv(spec, model, device) if beside_update else int(torch.cuda.mem_get_info(device)[0])
    slots, gb = kv_budget(spec, model.args, model.head_weight.dtype, free, sequences)
    if ro.kv_page_size is not None:  # paged: the pool from the KV memory, every sequence a row
        return EngineConfig(max_len=max_len(spec), max_slots=sequences, page_size=ro.kv_page_size,
                            kv_pages=kv_pages(spec, model, gb, free, sequences), cuda_graphs=ro.cuda_graphs,
                            fused_kernels=ro.fused_kernels, seed=ro.seed + spec.seed, capture_layers=capture_layers)
    return EngineConfig(max_len=max_len(spec), max_slots=slots, kv_cache_gb=gb, cuda_graphs=ro.cuda_graphs,
                        fused_kernels=ro.fused_kernels, seed=ro.seed + spec.seed, capture_layers=capture_layers)


def want_rows(spec: JobSpec) -> int:
    """Every sequence of an RL step at once."""
    return max(spec.algorithm.prompts_per_step * spec.algorithm.num_generations, 1)


def kv_pages(spec: JobSpec, model: Transformer, gb: float, free_bytes: int | None, sequences: int) -> int:
    """The paged layout's pool: pages of `rollout.kv_page_size` in the planned free memory `free_bytes` (CUDA,
    kv_cache_gb unset) for `sequences` rows, else in `gb` GiB."""
    page, dtype = spec.rollout.kv_page_size, model.head_weight.dtype
    assert page is not None
    if free_bytes is not None:
        return plan_pages(model.args, page, max_len(spec) + KV_SLACK, dtype_bytes=dtype.itemsize,
                          max_batch=sequences, free_bytes=free_bytes)
    return pages_for_budget(model.args, page, gb, dtype)


def request_sampling(spec: JobSpec, n: int = 1, greedy: bool = False) -> RequestSampling:
    """The rollout's sampling settings (greedy: the validation rollouts' temperature 0)."""
    a = spec.algorithm
    sampling = RequestSampling(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                               max_new_tokens=a.max_completion_length, n=n)
    return sampling.greedy() if greedy else sampling


@dataclass(frozen=True)
class Speculation:
    """What `rollout.speculative` x `drafter.kind` put in the rollout engine: its drafters (in the order the
    controller's arms table lists them), whether a controller plans its steps, whether the online drafter trains in
    the engine's tail, and a warning for a combination that is not wired."""

    drafters: tuple[DrafterKind, ...]  # "eagle": the online EAGLE drafter (drafter_config); "ngram": the n-gram one
    controlled: bool  # False: plain decoding with no controller (and no per-bucket metrics)
    tail_training: bool  # the online drafter spot-trains between the engine's tail steps
    warning: str | None = None

    @property
    def learned(self) -> bool:
        """Whether the job builds and trains the online EAGLE drafter."""
        return "eagle" in self.drafters


def speculation(spec: JobSpec) -> Speculation:
    """The rollout's speculative decoding from the spec (rl/engine_adapter.py make_rollout builds it):
    - adaptive: the n-gram drafter always (cold start, sees the GRPO siblings), plus the online EAGLE drafter for
      eagle1 / eagle3, which then trains in the tail; the controller's bandit chooses among them per bucket;
    - on with eagle1 / eagle3 / ngram: that one drafter with the spec's fixed arm;
    - off: no drafter, a controller pinned off (the same per-bucket and tail metrics as SD runs);
    - on with none: not wired, plain decoding, with a warning."""
    mode, kind = spec.rollout.speculative, spec.drafter.kind
    learned = kind in ("eagle1", "eagle3")
    if mode == "adaptive":
        warning = None if learned or kind == "ngram" else \
            f"drafter.kind={kind} has no engine drafter; adaptive SD runs with the n-gram drafter only"
        return Speculation(("ngram", "eagle") if learned else ("ngram",), True, learned, warning)
    if mode == "on" and (learned or kind == "ngram"):
        return Speculation(("eagle",) if learned else ("ngram",), True, False)
    if mode == "off":
        return Speculation((), True, False)
    return Speculation((), False, False, f"rollout.speculative={mode} with drafter.kind={kind} is not wired into "
                                         "the trainer's engine yet; running SD off")


def controller(spec: JobSpec, drafters: Sequence[DrafterKind]) -> AdaptiveSd:
    """The SD controller of `rollout.speculative` over the drafters the engine has (none: pinned off), switched by
    the active batch or by measured step costs (`rollout.sd_switch`)."""
    gpu = spec.resources.gpus > 0
    costs = None
    if spec.rollout.sd_switch == "step_costs" and drafters:  # with no drafter there is no SD step to time
        # on CPU nothing compiles and a probe costs a few plain steps: each batch bucket gets the probes of a verdict
        costs = StepCostConfig() if gpu else StepCostConfig(free_probes=StepCostConfig.probe_steps)
    # CUDA graphs are captured at an arm's first use on a GPU only; on CPU that step is a measurement like any other
    return AdaptiveSd.from_spec(spec.rollout, drafters=drafters, step_costs=costs, captures=gpu)


def drafter_config(spec: JobSpec) -> OnlineDrafterConfig:
    """The online drafter's settings (drafter.kind eagle1 / eagle3; the tail it trains in is the rollout's)."""
    d = spec.drafter
    if d.kind not in ("eagle1", "eagle3"):
        raise ValueError(f"an online drafter is eagle1 or eagle3, not {d.kind}")
    return OnlineDrafterConfig(kind=d.kind, warm_start_dir=d.warm_start_dir, learning_rate=d.learning_rate,
                               buffer_gb=d.buffer_gb, max_train_steps_per_rl_step=d.max_train_steps_per_rl_step,
                               train_after_update=d.train_after_update,
                               draft_vocab_size=d.draft_vocab_size, tail_below=spec.rollout.sd_on_below,
                               seed=spec.seed)
