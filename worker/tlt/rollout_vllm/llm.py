"""`VllmEngine`: one in-process `vllm.LLM` colocated with the trainer, and the only module that imports vLLM (inside
its functions: the project's environment need not have it).

    eng = VllmEngine(VllmSettings(...), policy_dir, drafter_dir=None)   # loads the exported policy (and drafter)
    outs = eng.generate(prompt_ids, SamplingParams-like kwargs)        # RequestOutput per prompt
    eng.load_policy(named_tensors)      # in place, no files: vLLM's layerwise reload; prefix cache reset
    eng.load_drafter(named_tensors)     # the same into the speculative model (EAGLE / EAGLE-3 export names)
    eng.sleep() / eng.wake(tags)        # sleep mode (CUDA): KV cache freed, weights offloaded for the update

How it is driven, as verl's vllm_rollout and TRL's `vllm_mode="colocate"` drive it: the engine core runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on the single-process executor ("uni"), so `collective_rpc` calls the
worker directly and the weights pass by reference. With tensor parallelism vLLM starts one worker process per GPU
("mp"): the same calls pickle the tensors to each worker, which shards them as it loads.
The prefix cache holds KV computed with the old weights, so every policy load resets it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# set before vLLM is imported (it reads them once): the engine core in this process, callables for collective_rpc
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

# vLLM's spec-decoding counters (Prometheus names) -> ours
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}

Named = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class VllmSettings:
    """What the LLM is built with (rollout_vllm/settings.py translates a job spec)."""

    dtype: str  # "float32" | "bfloat16" | "float16": the trainer's
    max_model_len: int  # prompt + completion (+ draft lookahead)
    seed: int
    tensor_parallel: int = 1
    enforce_eager: bool = True  # no CUDA graphs / torch.compile (always on CPU)
    kv_cache_bytes: int | None = None  # None = vLLM's own share of GPU memory (gpu_memory_utilization)
    gpu_memory_utilization: float = 0.3  # of the GPU, when kv_cache_bytes is None (the trainer holds the rest)
    sleep_mode: bool = False  # enable_sleep_mode (CUDA only)
    speculative: dict[str, Any] | None = None  # {"method": "eagle" | "eagle3", "num_speculative_tokens": k}


def _load_into(worker: Any, draft: bool, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Runs on each vLLM worker: checkpoint-named weights into the served model (or its speculative model) in place,
    through vLLM's layerwise reload (the model's own `load_weights` between restoring the checkpoint layout and
    re-processing it: on CPU the loaded layers are repacked, so a bare `load_weights` cannot run twice). The drafter's
    copies of modules it shares with the target (embedding, head) are left to the target's load."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    target = worker.get_model()
    model = worker.get_draft_model() if draft else target
    if model is None:
        raise RuntimeError("vLLM has no draft model to load drafter weights into")
    vcfg = worker.vllm_config
    config = vcfg.speculative_config.draft_model_config if draft else vcfg.model_config
    if draft:
        ours = {id(m) for m in target.modules()}
        shared = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and id(m) in ours}
        weights = [(n, t) for n, t in weights if n.rsplit(".", 2)[-2] not in shared]
    with set_current_vllm_config(vcfg), torch.no_grad():
        initialize_layerwise_reload(model)
        loaded = model.load_weights(iter(weights))
        finalize_layerwise_reload(model, config)
    if loaded is None:  # vLLM's EAGLE-3 loader reports no names: those it was handed (and loaded, or it raises)
        return sorted(n for n, _ in weights)
    return sorted(loaded)  # the served model's parameters that were written


class VllmEngine:
    def __init__(self, settings: VllmSettings, policy_dir: str, drafter_dir: str | None = None) -> None:
        from vllm import LLM

        self.settings = settings
        spec = dict(settings.speculative, model=drafter_dir) if settings.speculative else None
        if spec is not None and drafter_dir is None:
            raise ValueError("speculative decoding through vLLM needs the exported drafter's directory")
        kwargs: dict[str, Any] = {}
        if settings.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        self.llm = LLM(
            model=policy_dir, skip_tokenizer_init=True, dtype=settings.dtype, max_model_len=settings.max_model_len,
            seed=settings.seed, tensor_parallel_size=settings.tensor_parallel,
            distributed_executor_backend="uni" if settings.tensor_parallel == 1 else "mp",
            enforce_eager=settings.enforce_eager, enable_sleep_mode=settings.sleep_mode,
            logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p, as our engine reports them
            disable_log_stats=spec is None, speculative_config=spec, **kwargs)
        self.sleeping: set[str] = set()  # vLLM memory tags released by sleep() and not woken yet

    def generate(self, prompts: Sequence[Sequence[int]], temperature: float, top_p: float, top_k: int,
                 max_tokens: int, n: int, seed: int, stop_token_ids: Sequence[int]) -> list[Any]:
        """n samples per prompt (children seeded seed, seed+1, ...): vLLM's RequestOutputs in prompt order, each
        with the sampled token's log-prob per position (processed distribution) and its finish reason."""
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=seed, stop_token_ids=list(stop_token_ids), logprobs=0, detokenize=False)
        return list(self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False))

    def load_policy(self, weights: Named) -> list[str]:
        """The trainer's weights (HF names) into vLLM's model in place; the prefix cache (old KV) dropped. Returns
        the names of vLLM's parameters written (the first worker's)."""
        self.wake(("weights",))  # the KV cache stays released until the next rollout
        loaded = self.llm.collective_rpc(_load_into, args=(False, list(weights)))[0]
        self.llm.reset_prefix_cache()
        return loaded

    def load_drafter(self, weights: Named) -> list[str]:
        """The drafter's weights (our export's names) into vLLM's speculative model in place; returns the names of
        its parameters written (vLLM's EAGLE-3 loader reports none: then the names it loaded from)."""
        self.wake(("weights",))
        return self.llm.collective_rpc(_load_into, args=(True, list(weights)))[0]

    def sleep(self) -> None:
        """Release the KV cache and offload the weights to host memory for the policy update (sleep level 1)."""
        if self.settings.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """These memory tags back on the GPU (all of them before a rollout)."""
        waking = sorted(self.sleeping.intersection(tags))
        if waking:
            self.llm.wake_up(tags=waking)
            self.sleeping -= set(waking)

    def spec_counts(self) -> dict[str, int]:
        """vLLM's cumulative spec-decoding counters (summed over label sets; 0 without SD)."""
        counts = dict.fromkeys(SPEC_COUNTERS.values(), 0)
        if self.settings.speculative is None:
            return counts
        for metric in self.llm.get_metrics():
            if metric.name in SPEC_COUNTERS:
                counts[SPEC_COUNTERS[metric.name]] += int(metric.value)
        return counts

    def close(self) -> None:
        """Drop the engine (its memory goes back when nothing else holds it)."""
        self.llm = None
