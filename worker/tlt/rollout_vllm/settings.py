"""A job spec translated into the vLLM engine's settings (rollout_vllm/llm.py `VllmSettings`).

    settings = vllm_settings(spec, model, device)

- dtype: the trainer's weights' (fp32 on CPU, bf16 on GPU by default).
- max_model_len: prompt + completion, plus the draft lookahead with SD.
- KV cache: `rollout.kv_cache_gb` when set; unset, CPU_KV_CACHE_GB on CPU (as our engine) and on CUDA a share of
  the GPU (`COLOCATED_GPU_SHARE`, TRL's colocate default) since the trainer's weights and optimizer hold the rest.
- `rollout.cuda_graphs` false (and always on CPU): enforce_eager.
- `rollout.release_kv_for_update`: sleep mode (CUDA only; admission refuses it on CPU).
- `resources.tensor_parallel`: vLLM's tensor_parallel_size (GPU only).
- `rollout.speculative: on`: {"method": "eagle" | "eagle3", "num_speculative_tokens": draft_depth}.
"""

from __future__ import annotations

import torch

from worker.tlt.config import CPU_KV_CACHE_GB, JobSpec
from worker.tlt.job_spec_translate import max_len
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout_vllm.llm import VllmSettings

COLOCATED_GPU_SHARE = 0.3
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_METHODS = {"eagle1": "eagle", "eagle3": "eagle3"}


def vllm_settings(spec: JobSpec, model: Transformer, device: torch.device) -> VllmSettings:
    ro, cuda = spec.rollout, device.type == "cuda"
    speculative = None
    if ro.speculative == "on" and spec.drafter.kind in _METHODS:
        speculative = {"method": _METHODS[spec.drafter.kind], "num_speculative_tokens": ro.draft_depth}
    gb = ro.kv_cache_gb if ro.kv_cache_gb is not None else (None if cuda else CPU_KV_CACHE_GB)
    return VllmSettings(
        dtype=_DTYPES[model.head_weight.dtype],
        max_model_len=max_len(spec) + (ro.draft_depth + 1 if speculative else 0),
        seed=ro.seed + spec.seed,
        tensor_parallel=spec.resources.tensor_parallel,
        enforce_eager=not (cuda and ro.cuda_graphs),
        kv_cache_bytes=int(gb * 2**30) if gb is not None else None,
        gpu_memory_utilization=COLOCATED_GPU_SHARE,
        sleep_mode=cuda and ro.release_kv_for_update,
        speculative=speculative,
    )
