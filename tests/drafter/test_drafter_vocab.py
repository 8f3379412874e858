"""An EAGLE-1 proposer's draft vocabulary (EagleProposer.set_draft_vocab): chain drafts sample from the drafter's
distribution restricted to a set of target ids and renormalised, so drafts stay inside it and q is zero outside;
greedy speculative decoding stays exactly plain decoding whatever the set (a useless set only costs acceptance);
the head rows it reads follow the target's head when that changes in place (a weight sync)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.drafter.test_drafter_proposer import PROMPTS, _ctx, trained  # noqa: F401 (the module fixture)
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleDrafter


def _observed(d: EagleDrafter, hist: list[list[int]], seed: int) -> EagleProposer:
    p = EagleProposer(d, EagleProposerConfig(context=8, seed=seed))
    g = torch.Generator().manual_seed(7)
    for b, h in enumerate(hist):
        p.observe([(b, 0)] * (len(h) - 1), torch.zeros(len(h) - 1), torch.randn(len(h) - 1, 64, generator=g))
    return p


def test_chain_drafts_inside_the_vocab_from_the_renormalised_q(trained: EagleDrafter) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 30)]
    vocab = torch.sort(torch.randperm(320, generator=g)[:120]).values
    full = _observed(trained, hist, seed=1).propose(_ctx(hist, 4, 5, temperature=1.0))
    p = _observed(trained, hist, seed=1)
    p.set_draft_vocab(vocab)
    assert p.draft_vocab_size == 120
    prop = p.propose(_ctx(hist, 4, 5, temperature=1.0))
    assert prop.draft_probs is not None and full.draft_probs is not None
    q = prop.draft_probs[:, :4]
    assert bool(torch.isin(prop.tokens[:, 1:], vocab).all())
    outside = ~torch.isin(torch.arange(320), vocab)
    assert bool((q[..., outside] == 0).all())
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 4))
    # the first draft position reads the same context in both: q is the full q restricted and renormalised
    want = full.draft_probs[:, 0, vocab] / full.draft_probs[:, 0, vocab].sum(-1, keepdim=True)
    torch.testing.assert_close(q[:, 0, vocab], want, rtol=1e-4, atol=1e-7)
    assert bool((q[:, :, :].gather(-1, prop.tokens[:, 1:, None]) > 0).all())


@pytest.mark.parametrize("covering", [True, False], ids=["covering", "useless"])
def test_greedy_sd_with_a_draft_vocab_is_lossless(tiny_target: Transformer, trained: EagleDrafter,  # noqa: F811
                                                  covering: bool) -> None:
    """A vocab holding the rollout's tokens keeps most of the acceptance; one holding none of them accepts nothing
    (every draft misses) -- and both emit exactly the plain-decoding tokens."""
    params = RequestSampling(temperature=0.0, max_new_tokens=40)
    plain = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=8))
    ref = [s.tokens for s in plain.generate([Request(p, params) for p in PROMPTS]).sequences]
    seen = torch.tensor(sorted({t for s in ref for t in s}))
    vocab = seen if covering else torch.tensor([t for t in range(320) if t not in set(seen.tolist())])
    prop = EagleProposer(trained, EagleProposerConfig(context=16))
    prop.set_draft_vocab(vocab)
    eng = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=8),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", 4)), proposers={"eagle": prop},
                 hidden_hook=prop.observe)
    out = eng.generate([Request(p, params) for p in PROMPTS])
    assert [s.tokens for s in out.sequences] == ref
    steps = [s for s in out.steps if s.kind == "spec"]
    per_verify = sum(s.emitted for s in steps) / sum(s.active for s in steps)
    if covering:
        assert per_verify > 1.5, f"{per_verify:.2f} tokens per verify"
    else:
        assert per_verify <= 1.0  # (a row ending mid-step emits none)


def test_vocab_head_rows_follow_the_target_head(tiny_target: Transformer, trained: EagleDrafter) -> None:  # noqa: F811
    target = copy.deepcopy(tiny_target)
    d = EagleDrafter(target, trained.cfg)
    d.load_state_dict(trained.state_dict())
    p = EagleProposer(d, EagleProposerConfig(context=8))
    vocab = torch.arange(0, 320, 3)
    p.set_draft_vocab(vocab)
    rows, ids = p._draft_head()
    assert ids is not None and torch.equal(ids, vocab) and torch.equal(rows, target.head_weight[vocab])
    with torch.no_grad():
        target.head_weight.mul_(2.0)  # an in-place update, as a weight sync or an optimizer step makes
    again, _ = p._draft_head()
    assert again.data_ptr() == rows.data_ptr()  # refreshed in place: a captured graph reads the new rows
    assert torch.equal(again, target.head_weight[vocab])
    p._graphs[(1, 4, (0, False, 1.0))] = "a captured graph"  # type: ignore[assignment]
    p.set_draft_vocab(vocab + 1)  # the same size: in place, captured graphs kept
    moved, ids = p._draft_head()
    assert moved.data_ptr() == rows.data_ptr() and ids is not None and torch.equal(ids, vocab + 1)
    assert torch.equal(moved, target.head_weight[vocab + 1]) and len(p._graphs) == 1
    p.set_draft_vocab(None)
    assert p._draft_head()[1] is None and p.draft_vocab_size == 320 and not p._graphs
    with pytest.raises(ValueError, match="EAGLE-3"):
        from worker.tlt.speculative.drafter.model import EagleConfig
        EagleProposer(EagleDrafter(target, EagleConfig(kind="eagle3"))).set_draft_vocab(vocab)
