"""Admission of what a job will allocate, sized at submit against the registered workers (backend/admission.py runs
it after the queue and GPU checks): a spec that would exhaust every worker's memory, or whose prompts can never fit,
is a 422 with the reason instead of a worker that allocates terabytes or trains on nothing.

- device memory (GPU for a GPU job, host RAM for a CPU job): the drafter's hidden-state buffer (`drafter.buffer_gb`,
  learned drafters only) plus the KV cache (`rollout.kv_cache_gb`; on CPU its default, on GPU planned from what is
  free when the job starts, so not counted);
- host memory: the rollout batch a step keeps (prompts_per_step x num_generations sequences of up to
  max_prompt_length + max_completion_length tokens, ROLLOUT_HOST_BYTES_PER_TOKEN each), on top of the device memory
  for a CPU job;
- the system prompt against `dataset.max_prompt_length`: every prompt carries it, so one that alone needs more tokens
  than that leaves no prompt to train on. Its fewest possible tokens are its UTF-8 bytes over the longest token of
  the model's tokenizer (built-in models: worker/tlt/builtin_models.py; other models: GENERIC_MAX_TOKEN_BYTES).
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.persistence.models import Worker
from worker.tlt.builtin_models import BUILTIN_MODELS
from worker.tlt.config import CPU_KV_CACHE_GB, JobSpec

GB = 1024**3
# Host bytes a rollout keeps per token until the update has used it: the token id and its rollout, recomputed and
# reference log-probs, mask and advantage as tensors, and the Python lists the reward and sample paths build (an
# int in a list alone costs 36 bytes): a deliberate upper estimate.
ROLLOUT_HOST_BYTES_PER_TOKEN = 64
# Longest token assumed for a model that is not built in (its tokenizer is read only by the worker). Long tokens are
# runs of whitespace (SmolLM2's longest is 81 bytes); a larger bound only refuses fewer system prompts.
GENERIC_MAX_TOKEN_BYTES = 256
LEARNED_DRAFTERS = ("eagle1", "eagle3")


class SizeRefused(ValueError):
    """`loc` under body.spec and the reason (admission turns it into its Refused)."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = loc, msg


def rollout_host_gb(spec: JobSpec) -> float:
    a = spec.algorithm
    tokens = a.prompts_per_step * a.num_generations * (spec.dataset.max_prompt_length + a.max_completion_length)
    return tokens * ROLLOUT_HOST_BYTES_PER_TOKEN / GB


def device_gb(spec: JobSpec) -> float:
    """Drafter buffer + KV cache on the job's device (GPU memory per GPU, or host RAM for a CPU job)."""
    buffer = spec.drafter.buffer_gb if spec.drafter.kind in LEARNED_DRAFTERS else 0.0
    kv = spec.rollout.kv_cache_gb
    if kv is None:
        kv = 0.0 if spec.resources.gpus > 0 else CPU_KV_CACHE_GB
    return buffer + kv


def check_system_prompt(spec: JobSpec) -> None:
    prompt = spec.dataset.system_prompt
    if not prompt:
        return
    builtin = spec.model.builtin
    per_token = BUILTIN_MODELS[builtin].max_token_bytes if builtin is not None else GENERIC_MAX_TOKEN_BYTES
    fewest = -(-len(prompt.encode("utf-8", "surrogatepass")) // per_token)
    if fewest > spec.dataset.max_prompt_length:
        raise SizeRefused(("dataset", "system_prompt"),
                          f"the system prompt alone is at least {fewest} tokens, more than max_prompt_length "
                          f"({spec.dataset.max_prompt_length}): no prompt would fit; shorten it or raise the limit")


def check_memory(candidates: Sequence[Worker], spec: JobSpec) -> None:
    """Some worker that could take the job (its queue, enough GPUs) has the memory for it."""
    on_gpu = spec.resources.gpus > 0
    device, host = device_gb(spec), rollout_host_gb(spec)
    if not on_gpu:
        host, device = host + device, 0.0

    def fits(w: Worker) -> bool:
        return (not on_gpu or device <= w.gpu_memory_gb) and host <= w.host_memory_gb

    if any(fits(w) for w in candidates):
        return
    if on_gpu and device > max(w.gpu_memory_gb for w in candidates):
        raise SizeRefused(("drafter", "buffer_gb"),
                          f"drafter.buffer_gb + rollout.kv_cache_gb = {device:g} GB exceeds the GPU memory of every "
                          f"worker that could run the job (at most {max(w.gpu_memory_gb for w in candidates):.1f} GB)")
    most = max(w.host_memory_gb for w in candidates)
    where = "the rollout batch" if on_gpu else "the rollout batch, drafter buffer and KV cache"
    rollout_alone_too_big = on_gpu or rollout_host_gb(spec) > most
    loc = ("algorithm", "prompts_per_step") if rollout_alone_too_big else ("drafter", "buffer_gb")
    raise SizeRefused(loc, f"{where} need about {host:.1f} GB of host memory (prompts_per_step x num_generations x "
                      f"(max_prompt_length + max_completion_length) tokens at {ROLLOUT_HOST_BYTES_PER_TOKEN} bytes"
                      f"{'' if on_gpu else ', plus drafter.buffer_gb and the KV cache'}); every worker that could "
                      f"run the job has at most {most:.1f} GB")
