"""The draft window (worker/tlt/speculative/drafter/draft_window.py): the graphed chain draft reads its context from device rings
the engine advances after each verification. Through whole engine runs (rows finishing, new rows admitted, the
context rebuilt) it must draft exactly what the host pack of the feature ring drafts at every step, leave the ring
holding the same features once it writes them back, and be reused between steps on the same rows. The CUDA graph is
replaced by eager replay so this runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.drafter.eager_graphs import record_eagerly
from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.draft_window import DraftWindow
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.proposers.protocol import DraftContext


def _prompts() -> list[list[int]]:
    return [[(11 * i + 5 * j) % 250 + 1 for j in range(4 + 3 * (i % 4))] for i in range(7)]


def _requests(temperature: float) -> list[Request]:
    return [Request(p, RequestSampling(temperature=temperature, max_new_tokens=20 + 9 * (i % 3)))
            for i, p in enumerate(_prompts())]


@pytest.mark.parametrize("context", [8, 16])
def test_window_drafts_what_the_ring_pack_drafts_through_an_engine_run(tiny_target: Transformer, context: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, 7 prompts in 4 slots (admissions and compactions rebuild the context), histories longer than the
    context (the rings wrap): at every speculative step the window's draft equals a twin proposer's that packs its
    feature ring on the host; the outputs equal plain decoding; the window is loaded far fewer times than it drafts;
    written back, the window's features are the twin's, cell for cell."""
    monkeypatch.setattr(EagleProposer, "_record", record_eagerly)
    drafter = EagleDrafter(tiny_target, EagleConfig())
    drafter.reset_parameters(std=0.1, seed=5)
    win = EagleProposer(drafter, EagleProposerConfig(context=context))
    monkeypatch.setattr(win, "_graphable", lambda bsz, ctx: True)
    twin = EagleProposer(drafter, EagleProposerConfig(context=context, cuda_graphs=False))
    loads = []
    real_load = DraftWindow.load
    monkeypatch.setattr(DraftWindow, "load", lambda self, *a: (loads.append(1), real_load(self, *a))[1])
    drafts = []
    flushed = 0
    real_propose = win.propose

    def propose(ctx):  # type: ignore[no-untyped-def]
        a: DraftProposal = real_propose(ctx)
        b = twin.propose(ctx)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.equal(a.counts, b.counts)
        drafts.append(a.tokens.shape[0])
        if len(drafts) in (10, 25):  # written back mid-run, the window's features are the twin's
            _assert_same_rings(win, twin, context)
            nonlocal flushed
            flushed += 1
        return a

    monkeypatch.setattr(win, "propose", propose)

    def hook(seq, toks, hidden):  # type: ignore[no-untyped-def]
        win.observe(seq, toks, hidden)  # skipped for the window's own steps
        twin.observe(seq, toks, hidden)

    cfg = EngineConfig(max_len=96, max_slots=4, cuda_graphs=False)
    eng = Engine(tiny_target, eos_ids=(257,), config=cfg, controller=AdaptiveSd.fixed(chain_arm("eagle", 4)),
                 proposers={"eagle": win}, hidden_hook=hook)
    out = eng.generate(_requests(0.0))
    ref = Engine(tiny_target, eos_ids=(257,), config=cfg).generate(_requests(0.0))
    assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
    assert max(len(s.tokens) for s in out.sequences) > context  # the rings wrapped
    assert len(drafts) > 20 and len(loads) * 3 < len(drafts)
    assert flushed == 2


def _assert_same_rings(win: EagleProposer, twin: EagleProposer, context: int) -> None:
    win._flush_window()
    assert win._window is not None and win._window.ctx is None
    for sid, slot in twin.features._slot.items():
        c = twin.features._count[slot]
        mine = win.features._slot[sid]
        assert win.features._count[mine] == c
        cells = [i % context for i in range(max(0, c - context), c)]
        assert torch.equal(win.features.rows[mine, cells], twin.features.rows[slot, cells])


def test_window_holds_a_context_only_while_its_histories_grow_by_its_own_steps() -> None:
    """After a load and an advance the window's inputs are the grown histories' (tokens, features, m, lengths); a
    context whose histories grew by anything but the window's advances (a plain decode step) is not held."""
    w = DraftWindow(rows=4, context=8, feature_dim=3, device=torch.device("cpu"))
    hist = [[1, 2, 3], [4, 5]]
    ctx = DraftContext(histories=hist, prompt_lens=[1, 1], group_ids=[0, 1], sample_ids=[0, 0], max_nodes=3,
                       max_depth=2)
    toks = torch.tensor([[0] * 5 + [1, 2, 3], [0] * 6 + [4, 5]])
    w.load(ctx, toks, torch.zeros(2, 8, 3), [2, 1])
    assert w.holds(ctx)
    w.advance(torch.tensor([[7, 8, 9], [6, 0, 0]]), torch.ones(2, 3, 3), torch.tensor([2, 1]))
    w.mirror([2, 1])
    assert not w.holds(ctx)  # the mirror ran ahead of the histories
    hist[0] += [7, 8]
    hist[1] += [6]
    assert w.holds(ctx)
    toks, feats, m, length = w.inputs(2)
    assert toks[0].tolist() == [0, 0, 0, 1, 2, 3, 7, 8] and toks[1].tolist() == [0] * 5 + [4, 5, 6]
    assert length.tolist() == [5, 3] and m.tolist() == [4, 2]
    assert feats[0, -2:].eq(1).all() and feats[0, :-2].eq(0).all() and feats[1, -1].eq(1).all()
    hist[1].append(3)  # a step the window did not see
    assert not w.holds(ctx)
