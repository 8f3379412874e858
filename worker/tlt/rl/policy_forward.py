"""The policy update's forward as one module call: token ids [b, S] and the flat positions of the response tokens
[n] in -> logits [n, V] at those positions.

    fwd = ResponseLogits(model)
    logits = fwd(mb.input_ids, at)      # or through DeepSpeed's engine, which wraps `fwd`

Why a module and not `model.forward_hidden` + `model.logits_from_hidden` called from the trainer: DeepSpeed's
ZeRO-3 gathers a module's partitioned weights in hooks around module calls, so the whole forward, the (possibly
tied) head included, must happen inside one call of a module DeepSpeed wraps; the head weight is registered as an
external parameter of this wrapper (rl/deepspeed_update.py). The head and the softmax run on response positions
only (prompts are often most of a sequence).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.tlt.model.transformer import Transformer


class ResponseLogits(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [b, S], [n] -> [n, V]
        _, h, _ = self.model.forward_hidden(input_ids, compute_logits=False)  # [b, S, H]
        b, s = input_ids.shape
        return self.model.logits_from_hidden(h.reshape(b * s, -1).index_select(0, at))
