"""FeatureRing.observe (through EagleProposer.observe) keeps exactly the last `context` features of each sequence, whatever one call brings: a
call with more rows than the window (a long prefill) writes each ring cell once, so the ring's content does not hang
on which of several CUDA writers to one cell wins (once the graphed chain's root q differed from eager's by 0.008
on an H200 because the two proposers' rings had kept different stale features).

GPU: python -m pytest tests/drafter/test_drafter_observe.py -q -m gpu
"""

from __future__ import annotations

import copy

import pytest
import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.proposers.protocol import DraftContext


def _ring_of(p: EagleProposer, lengths: list[int]) -> torch.Tensor:  # [B, W, F] the features a draft reads
    b = len(lengths)
    ctx = DraftContext(histories=[[1] * n for n in lengths], prompt_lens=[1] * b, group_ids=list(range(b)),
                       sample_ids=[0] * b, max_nodes=2, max_depth=1, device=p.device)
    packed = torch.from_numpy(p._pack(ctx, b)).to(p.device)
    w = p.config.context
    return p.features.gather(packed[:, w: 2 * w])


def _observe_interleaved(p: EagleProposer, rows: tuple[int, int], f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call with rows of sequences 0 and 1 interleaved -> each sequence's features [n, F], in position order."""
    g = torch.Generator().manual_seed(0)
    h0, h1 = torch.randn(rows[0], f, generator=g), torch.randn(rows[1], f, generator=g)
    order = sorted([(i / rows[0], 0, i) for i in range(rows[0])] + [(i / rows[1], 1, i) for i in range(rows[1])])
    ids = [(s, 0) for _, s, _ in order]
    hidden = torch.stack([(h0 if s == 0 else h1)[i] for _, s, i in order]).to(p.device)
    p.observe(ids, torch.zeros(len(ids)), hidden)
    return h0, h1


def test_observe_writes_each_ring_cell_once_and_keeps_the_last_rows(tiny_target: Transformer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    p = EagleProposer(EagleDrafter(tiny_target, EagleConfig()), EagleProposerConfig(context=8))
    written: list[torch.Tensor] = []
    inner = torch.Tensor.index_copy_

    def spy(t, dim, index, src):  # type: ignore[no-untyped-def]
        written.append(index.cpu())
        return inner(t, dim, index, src)

    monkeypatch.setattr(torch.Tensor, "index_copy_", spy)
    h0, h1 = _observe_interleaved(p, (21, 5), p.drafter.feature_dim)  # 21 rows wrap an 8-row ring twice
    assert len(written) == 1 and written[0].unique().numel() == written[0].numel() == 8 + 5
    ring = _ring_of(p, [22, 6]).cpu()
    assert torch.equal(ring[0], h0[-8:]) and torch.equal(ring[1, -5:], h1)
    # later calls continue each ring where it stopped
    more = torch.randn(3, p.drafter.feature_dim)
    p.observe([(0, 0)] * 3, torch.zeros(3), more.to(p.device))
    assert torch.equal(_ring_of(p, [25, 6]).cpu()[0], torch.cat([h0[-5:], more]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_observe_on_cuda_is_deterministic(tiny_target: Transformer) -> None:
    """A prefill longer than the window, observed on the GPU again and again, leaves exactly its last rows (before
    the fix, duplicate ring cells in one index_copy_ let any of their writers win)."""
    dev = torch.device("cuda")
    d = EagleDrafter(copy.deepcopy(tiny_target).to(dev), EagleConfig()).to(dev)
    for _ in range(20):
        p = EagleProposer(d, EagleProposerConfig(context=16))
        h0, h1 = _observe_interleaved(p, (300, 40), d.feature_dim)
        ring = _ring_of(p, [301, 41]).cpu()
        assert torch.equal(ring[0], h0[-16:]) and torch.equal(ring[1], h1[-16:])
