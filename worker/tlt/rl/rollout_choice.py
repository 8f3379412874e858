"""The one place a job's rollout backend is chosen (`rollout.backend`): our engine (rl/engine_adapter.py) or vLLM
(worker/tlt/rollout_vllm/, imported only by jobs that ask for it).

    rollout = build_rollout(spec, model, tokenizer, device)     # rollout.drafter: the trainer's DrafterHook or None
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.tlt.config import JobSpec
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.engine_adapter import EngineRollout, make_rollout

if TYPE_CHECKING:
    from worker.tlt.rollout_vllm.rollout import VllmRollout


def build_rollout(spec: JobSpec, model: Transformer, tokenizer: TokenizerLike, device: torch.device
                  ) -> EngineRollout | VllmRollout:
    if spec.rollout.backend == "vllm":
        from worker.tlt.rollout_vllm.rollout import make_vllm_rollout

        return make_vllm_rollout(spec, model, tokenizer, device)
    return make_rollout(spec, model, tokenizer, device)
