"""The policy update's forward as one module call: token ids [b, S] and the flat positions of the response tokens
[n] in -> logits [n, V] at those positions.

    fwd = ResponseLogits(model)
    logits = fwd(mb.input_ids, at)      # or through DeepSpeed's engine, which wraps `fwd`

Why a module and not `model.forward_hidden` + `model.logits_from_hidden` called from the trainer: DeepSpeed's
ZeRO-3 gathers a module's partitioned weights in hooks around module calls, so the whole forward, the (possibly
tied) head included, must happen inside one call of a module DeepSpeed wraps; the head weight is registered as an
external parameter of this wrapper (rl/deepspeed_update.py). The head and the softmax run on response positions
only (prompts are often most of a sequence).

`capture` (optional, an `UpdateCapture`): the hidden states of the rows whose next token is a response token (the
prompt's last position and the fed response tokens), handed over detached with the tokens fed there: a drafter
trains on them when the rollout runs elsewhere (rollout_vllm/drafter.py), from this forward the update runs anyway.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.decode_step import hook_rows


class UpdateCapture(Protocol):
    layers: tuple[int, ...]  # also capture the hidden states entering these layers (EAGLE-3's features)

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> None:
        """tokens [n] fed at the captured positions, hidden [n, F] (cat(layer inputs, final-norm hidden), as the
        engine's hook rows), rows [n] the micro-batch row of each; positions in order within a row."""


class ResponseLogits(nn.Module):
    def __init__(self, model: Transformer, capture: UpdateCapture | None = None) -> None:
        super().__init__()
        self.model = model
        self.capture = capture

    def forward(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [b, S], [n] -> [n, V]
        layers = self.capture.layers if self.capture is not None else ()
        _, h, feats = self.model.forward_hidden(input_ids, compute_logits=False, layers=layers)  # [b, S, H]
        b, s = input_ids.shape
        rows = h.reshape(b * s, -1).index_select(0, at)
        if self.capture is not None:
            with torch.no_grad():
                picked = {i: f.reshape(b * s, -1).index_select(0, at) for i, f in feats.items()}
                self.capture(input_ids.reshape(-1).index_select(0, at), hook_rows(rows, picked, layers).detach(),
                             torch.div(at, s, rounding_mode="floor"))
        return self.model.logits_from_hidden(rows)
