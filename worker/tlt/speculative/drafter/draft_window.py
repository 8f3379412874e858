"""`DraftWindow`: the graphed chain draft's inputs kept on the device while the engine's rows stay.

Without it every speculative step rebuilt the drafter's context on the host: FeatureRing.pack (the last W history
tokens and ring cells of each row), one upload, one feature gather, and, after verification, the hidden-state hook
wrote the kept rows into the ring (index building, an upload and index_copy). On an H200 at batch 1 that host work
was ~0.5 ms of a 2.0 ms step while the GPU waited.

Here each graph row b owns two rings of `span` columns on the device: history tokens by history index and target
features by feature index (index i at column i mod span), with the row's history length and feature count. The
captured chain draft reads its W context entries from them (`inputs`: gathers inside the graph), and after each
verification `advance` appends the step's emitted tokens and the features of its kept nodes (fixed shapes: every
node is written, nodes past a row's emitted count land on columns of indices not reached yet, which the step that
reaches them rewrites; span >= W + nodes keeps them clear of the W columns read). The host mirrors only the
lengths and counts (`mirror`, from the step's one read), which tell whether the window still holds a context's
rows: rows that changed, or histories that grew by any other step (plain decoding), load it again from the
FeatureRing (`load`). Features the window saw but the ring did not are written back first (`flush_into`), so the
ring stays the truth for every other reader.

The values are those FeatureRing.pack + gather would give: the token window ends at the history length, the
feature window at the feature count, m = min(count, W, length - 1) valid entries (tests/drafter/test_drafter_window.py).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.tlt.decoding.uploads import to_device_no_sync
from worker.tlt.speculative.drafter.feature_ring import FeatureRing
from worker.tlt.speculative.proposers.protocol import DraftContext


class DraftWindow:
    def __init__(self, rows: int, context: int, feature_dim: int, device: torch.device, span: int | None = None) -> None:
        self.context = context  # W: entries a draft reads
        self.span = span or context + max(context, 32)  # ring columns per row: W + the most nodes one advance writes
        self.tokens = torch.zeros(rows, self.span, dtype=torch.int64, device=device)  # [G, span]
        self.features = torch.zeros(rows, self.span, feature_dim, device=device)  # [G, span, F] float32
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=device)  # [G] history length
        self.counts = torch.zeros(rows, dtype=torch.int64, device=device)  # [G] features written
        self._cols = torch.arange(context, device=device) - context  # [W] column c is index end - W + c
        self._steps = torch.arange(self.span - context, device=device)  # node i of an advance
        self.ctx: DraftContext | None = None  # the context whose rows 0..B-1 the window holds
        self.host_lengths: list[int] = []  # mirrors of `lengths` / `counts` for rows 0..B-1
        self.host_counts: list[int] = []

    def holds(self, ctx: DraftContext) -> bool:
        """Whether rows 0..B-1 are this context's, as it stands now (its histories grew only by `advance`)."""
        return self.ctx is ctx and self.host_lengths == [len(h) for h in ctx.histories]

    def inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> context tokens [R, W] (0 before the history's start), features [R, W, F], valid entries m [R], history
        lengths [R] of rows 0..R-1: the chain draft's inputs. Device ops only (captured with the draft)."""
        length, count = self.lengths[:rows, None], self.counts[:rows, None]
        at = length + self._cols  # [R, W] history index of each column
        toks = self.tokens[:rows].gather(1, at % self.span).masked_fill(at < 0, 0)
        cells = ((count + self._cols) % self.span)[..., None].expand(-1, -1, self.features.shape[2])
        feats = self.features[:rows].gather(1, cells)
        m = torch.minimum(count[:, 0], length[:, 0] - 1).clamp(0, self.context)
        return toks, feats, m, length[:, 0]

    def load(self, ctx: DraftContext, toks: torch.Tensor, feats: torch.Tensor, counts: list[int]) -> None:
        """Rows 0..B-1 from a host pack of `ctx`: toks [B, W] (right-aligned at the history length), feats [B, W, F]
        (right-aligned at the feature count), counts [B] the features written per row (FeatureRing.counts)."""
        b = toks.shape[0]
        lengths = [len(h) for h in ctx.histories]
        both = to_device_no_sync(np.array([lengths, counts], dtype=np.int64), toks.device)
        self.lengths[:b], self.counts[:b] = both[0], both[1]
        self.tokens[:b].scatter_(1, (both[0, :, None] + self._cols) % self.span, toks)
        cells = ((both[1, :, None] + self._cols) % self.span)[..., None].expand(-1, -1, feats.shape[2])
        self.features[:b].scatter_(1, cells, feats.to(self.features.dtype))
        self.ctx, self.host_lengths, self.host_counts = ctx, lengths, list(counts)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor) -> None:
        """After a verification of rows 0..B-1 (device only, no sync): tokens [>=B, K] the emitted tokens in order,
        hidden [>=B, >=K, >=F] the hook rows of the verified nodes (root first), emitted [>=B] how many of each
        row's tokens, and so of its nodes' features, count."""
        b, k = len(self.host_lengths), tokens.shape[1]
        if k > self._steps.numel():
            raise ValueError(f"{k} nodes per advance: the window's span keeps {self._steps.numel()}")
        step = self._steps[:k]
        self.tokens[:b].scatter_(1, (self.lengths[:b, None] + step) % self.span, tokens[:b])
        f = self.features.shape[2]
        cells = ((self.counts[:b, None] + step) % self.span)[..., None].expand(-1, -1, f)
        self.features[:b].scatter_(1, cells, hidden[:b, :k, :f].to(self.features.dtype))
        n = emitted[:b]
        self.lengths[:b] += n
        self.counts[:b] += n

    def mirror(self, emitted: list[int]) -> None:
        """The host side of `advance`, once the step's emitted counts are read."""
        for b, n in enumerate(emitted[: len(self.host_lengths)]):
            self.host_lengths[b] += n
            self.host_counts[b] += n

    def flush_into(self, ring: FeatureRing) -> None:
        """Write the features the window added back into the ring (FeatureRing.absorb) and let go of the context."""
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            b = len(self.host_counts)
            ring.absorb(ring.slots(ctx), self.host_counts, self.features[:b])
