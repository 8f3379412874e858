"""The frame both cached forwards share (kernels/forward.py's fused kernels, kernels/gemm_forward.py's GEMMs): the
call flattened as the kernels read it, the embedding, the hidden states captured entering the asked layers, and the
logits at the asked positions. What differs between the two is the layer stack and the head: `CachedForward`'s two
fields. Tests: `python -m pytest tests/kernels/test_kernels_forward.py tests/kernels/test_kernels_gemm_forward.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.tlt.model.transformer import LayerCache, Transformer


@dataclass(frozen=True)
class CachedCall:
    """One cached forward call as its kernels read it: B * S = M tokens."""

    b: int
    s: int
    row0: int  # the batch's first cache row
    pos: torch.Tensor  # [M] RoPE positions
    widx: torch.Tensor  # [M] cache column of each token (default: the positions)
    mask: torch.Tensor  # [B, S, Tk] bool, contiguous
    table: torch.Tensor  # the cache's block table
    eps: float  # the model's RMSNorm epsilon
    layers: tuple[int, ...]  # the layers whose entering hidden state is captured
    captured: dict[int, torch.Tensor]  # {i: hidden entering layer i} [B, S, H], filled by `capture`

    def capture(self, i: int, x: torch.Tensor) -> None:
        """Keep x [M, H] (the hidden state entering layer i) where layer i was asked for."""
        if i in self.layers:
            self.captured[i] = x.view(self.b, self.s, -1)


# (model, embedded tokens [M, H], call, cache) -> final-norm hidden [M, H] or [B, S, H]
LayerStack = Callable[[Transformer, torch.Tensor, CachedCall, LayerCache], torch.Tensor]
# (final-norm hidden rows [R, H], head weight [V, H]) -> logits [R, V]
Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CachedForward:
    """`Transformer.forward_hidden` with a cache, its layers run by `stack` and its head by `head`."""

    stack: LayerStack
    head: Head

    @torch.no_grad()
    def __call__(
        self,
        model: Transformer,
        input_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S] RoPE positions
        cache: LayerCache,
        *,
        cache_rows: slice | None = None,  # cache rows of this batch (default 0..B-1)
        write_idx: torch.Tensor | None = None,  # [B, S] cache column of each token (default = positions)
        attn_mask: torch.Tensor,  # [B, S, Tk] bool
        logits_at: torch.Tensor | None = None,  # [B, K]
        layers: tuple[int, ...] = (),
        compute_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """(logits, final-norm hidden [B, S, H], {i: hidden entering layer i}) as model.forward_hidden with a cache."""
        b, s = input_ids.shape
        hdim = model.args.dim
        call = CachedCall(b, s, *flat_call(positions, cache_rows, write_idx, attn_mask), table=cache.block_table,
                          eps=model.args.norm_eps, layers=layers, captured={})
        x = model.model.embed_tokens(input_ids).reshape(b * s, hdim)
        hidden = self.stack(model, x, call, cache).view(b, s, hdim)
        if not compute_logits:
            return hidden.new_empty(0), hidden, call.captured
        hl = hidden if logits_at is None else hidden.gather(1, logits_at[..., None].expand(-1, -1, hdim))
        logits = self.head(hl.reshape(-1, hdim), model.head_weight)
        return logits.view(*hl.shape[:-1], -1), hidden, call.captured


def flat_call(positions: torch.Tensor, cache_rows: slice | None, write_idx: torch.Tensor | None,
              attn_mask: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cached forward's inputs as its kernels read them: (first cache row, RoPE positions [M], write columns [M]
    (default: the positions), mask [B, S, Tk] contiguous), M = B * S tokens."""
    row0 = cache_rows.start if cache_rows is not None and cache_rows.start is not None else 0
    pos = positions.reshape(-1).contiguous()
    widx = pos if write_idx is None else write_idx.reshape(-1).contiguous()
    return row0, pos, widx, attn_mask.contiguous()
