"""The drafter interface: what the engine tells a drafter each speculative step, and what it gets back.

The engine builds one `DraftContext` for its active batch and calls `proposer.propose(ctx)` every speculative step,
reusing the same object while the batch's rows stay (its histories are the engine's token lists, which grow in place;
a drafter may cache per context object, e.g. the rows' slots or settings);
the returned `DraftProposal` (decoding/draft_types.py) goes, with the target's verify forward, to the verifier
(speculative/verify/verifier.py). Drafters: the n-gram drafter (ngram.py), the small-model drafter (small_model.py)
and the EAGLE drafter (speculative/drafter/eagle_proposer.py) implement `Proposer`; they share nothing else with the
verifier.

Rules a proposal must follow (the verifier relies on them):
- row b's root (node 0) is `ctx.histories[b][-1]`;
- at most `ctx.topk` children per node (1: a chain);
- at most `ctx.max_nodes` nodes per row (root included) and tree depth at most `ctx.max_depth`;
- a tree with `draft_probs` must have drawn each node's children sequentially without replacement from that node's
  `draft_probs` row (a chain: one draw per node); deterministic drafts (`draft_probs=None`) may be any tokens chosen
  without looking at the target's outputs of this step;
- tensors on `ctx.device`.

Run the tests: `python -m pytest tests/spec -q`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.sampling import DraftFilters, RowSampling


@dataclass(frozen=True)
class DraftContext:
    """The active batch as a drafter sees it (row b = the b-th active sequence of the engine's batch)."""

    histories: Sequence[Sequence[int]]  # [B] prompt + emitted tokens of each sequence; the last one is the root
    prompt_lens: Sequence[int]  # [B] number of prompt tokens at the start of each history
    group_ids: Sequence[int]  # [B] GRPO group of each sequence (same prompt = same group)
    sample_ids: Sequence[int]  # [B] index of the sequence within its group (0..n-1); (group, sample) is its identity
    max_nodes: int  # verify budget per row, root included (the arm's verify tokens)
    max_depth: int  # longest chain / deepest tree level to draft
    topk: int = 1  # children per node the arm allows: 1 drafts a chain, > 1 a tree (the verifier's branching bound)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the proposal's tensors go
    # group id -> histories of ALL sequences of that group so far (active and finished), indexed by sample id, so
    # groups[group_ids[b]][sample_ids[b]] is histories[b]; the engine passes references to its own growing token
    # lists (no copy) and drafters index them incrementally. None: only the active histories are known.
    groups: Mapping[int, Sequence[Sequence[int]]] | None = None
    sampling: RowSampling | None = None  # the target's per-row settings, for drafters that sample
    filters: DraftFilters = DraftFilters()  # what the host knows of `sampling`
    # (stream keys [B], emitted counts [B]): the rows' RowState.key and n_gen (live views), so that a drafter that
    # samples draws draft d of a row from that row's own stream (kernels.draft_noise); None: its generator
    streams: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden: torch.Tensor | None = None  # [B, T, H] target hidden states at each row's last T positions (EAGLE)
    hidden_lens: torch.Tensor | None = None  # [B] int64 valid positions in `hidden` (right-aligned)

    @property
    def batch_size(self) -> int:
        return len(self.histories)

    def roots(self) -> torch.Tensor:  # [B] int64 last emitted token of each row
        return torch.tensor([h[-1] for h in self.histories], dtype=torch.int64, device=self.device)


class Proposer(Protocol):
    """A drafter, as the engine drives it. Implementations: ngram.NGramProposer, small_model's SmallModelProposer,
    speculative/drafter/eagle_proposer.EagleProposer. `DrafterBase` gives the optional steps a default."""

    def propose(self, ctx: DraftContext) -> DraftProposal:
        """Draft a chain (ctx.topk == 1) or a tree of at most ctx.topk children per node per active sequence, within
        ctx.max_nodes / ctx.max_depth."""
        ...

    def reset(self) -> None:
        """Forget per-rollout state (caches, indexes); called by the engine when a rollout ends."""
        ...

    def capture(self, batches: Sequence[int], depth: int, filters: DraftFilters) -> int:
        """Capture the graphs a chain draft of `depth` tokens will replay at these batch sizes, for rows whose
        sampling filters are `filters` (DraftContext.filters), ahead of a timed rollout -> how many were captured."""
        ...

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor) -> bool:
        """After the verification of this proposer's last chain draft, before the host reads the result (device
        work only): tokens [>=B, K] emitted per row, hidden [>=B, >=K, F] hook rows of the verified nodes, emitted
        [>=B]. True when the proposer took the step's features itself; the engine then runs the step's hook inside
        `advanced(emitted counts)`."""
        ...

    def advanced(self, emitted: list[int]) -> AbstractContextManager[None]:
        """Once the emitted counts are on the host (only after `advance` returned True): inside the block, the hook
        rows of this step are ones the proposer already holds."""
        ...

    def release(self) -> int:
        """Free device memory the proposer keeps for the engine's cache layout (the engine's release_memory) ->
        bytes freed; it is allocated again on the next proposal."""
        ...


class DrafterBase:
    """Defaults for the optional steps of `Proposer`: no graphs to capture, no features taken from the verify step,
    nothing held that the engine's memory release should free."""

    def reset(self) -> None:
        return None

    def capture(self, batches: Sequence[int], depth: int, filters: DraftFilters) -> int:
        return 0

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor) -> bool:
        return False

    def advanced(self, emitted: list[int]) -> AbstractContextManager[None]:
        return nullcontext()

    def release(self) -> int:
        return 0


def empty_proposal(ctx: DraftContext) -> DraftProposal:
    """Root-only proposal: verification then emits exactly one token per row, i.e. plain decoding."""
    bsz = ctx.batch_size
    return DraftProposal(
        tokens=ctx.roots().view(bsz, 1),
        parents=torch.full((bsz, 1), -1, dtype=torch.int64, device=ctx.device),
        counts=torch.ones(bsz, dtype=torch.int64, device=ctx.device),
    )
