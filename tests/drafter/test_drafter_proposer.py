"""EagleProposer inside the rollout engine: greedy speculative decoding with it emits exactly the plain-decoding
tokens (chain and tree), a drafter trained on the target's outputs gets more than one token per verify, proposals
respect the context's budget, and sampled chains carry their q rows."""

from __future__ import annotations

import pytest
import torch

from worker.tlt.decoding.sampling import DraftFilters, RowSampling
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.speculative_step import row_filters
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.drafter.spot_trainer import SpotTrainer, SpotTrainerConfig
from worker.tlt.speculative.proposers.draft_tree import node_depths
from worker.tlt.speculative.proposers.protocol import DraftContext

PROMPTS = [[(7 * i + j * 13) % 250 for j in range(6 + i % 3)] for i in range(8)]


@pytest.fixture(scope="module")
def trained(tiny_target: Transformer) -> EagleDrafter:
    """A drafter spot-trained on hidden states the engine captured from its own greedy rollout."""
    d = EagleDrafter(tiny_target, EagleConfig())
    buf = HiddenStateBuffer(d.feature_dim, budget_bytes=2**22, dtype=torch.float32)
    cap = EngineCapture(buf)
    eng = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=8), hidden_hook=cap)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (module fixtures run before the autouse one-thread fixture)
    try:
        eng.generate([Request(p, RequestSampling(temperature=0.0, max_new_tokens=40)) for p in PROMPTS])
        tr = SpotTrainer(d, buf, SpotTrainerConfig(learning_rate=1e-2, batch_size=8, window=24))
        tr.train(lambda: False, max_steps=250)
    finally:
        torch.set_num_threads(threads)
    return d


@pytest.mark.parametrize("method,topk", [("chain", 1), ("tree", 3)])
def test_greedy_sd_with_eagle_is_lossless_and_accepts(tiny_target: Transformer, trained: EagleDrafter, method: str,
                                                      topk: int) -> None:
    arm = chain_arm("eagle", 4) if topk == 1 else tree_arm("eagle", 4, topk, 10)
    params = RequestSampling(temperature=0.0, max_new_tokens=40)
    plain = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=8))
    ref = plain.generate([Request(p, params) for p in PROMPTS])
    prop = EagleProposer(trained, EagleProposerConfig(context=16))
    eng = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=8),
                 controller=AdaptiveSd.fixed(arm), proposers={"eagle": prop}, hidden_hook=prop.observe)
    out = eng.generate([Request(p, params) for p in PROMPTS])
    assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
    steps = [s for s in out.steps if s.kind == "spec"]
    per_verify = sum(s.emitted for s in steps) / sum(s.active for s in steps)
    assert per_verify > 1.5, f"{per_verify:.2f} tokens per verify"
    # an untrained drafter is (nearly) useless on the same rollout: the gain comes from training
    fresh = EagleProposer(EagleDrafter(tiny_target, EagleConfig()), EagleProposerConfig(context=16))
    eng0 = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=8),
                  controller=AdaptiveSd.fixed(arm), proposers={"eagle": fresh}, hidden_hook=fresh.observe)
    out0 = eng0.generate([Request(p, params) for p in PROMPTS])
    steps0 = [s for s in out0.steps if s.kind == "spec"]
    per_verify0 = sum(s.emitted for s in steps0) / sum(s.active for s in steps0)
    print(f"{method}: {per_verify:.2f} tokens per verify trained, {per_verify0:.2f} untrained")
    assert per_verify0 < per_verify - 0.3


def _ctx(hist: list[list[int]], depth: int, nodes: int, temperature: float, topk: int = 1) -> DraftContext:
    b = len(hist)
    return DraftContext(histories=hist, prompt_lens=[2] * b, group_ids=list(range(b)), sample_ids=[0] * b,
                        max_nodes=nodes, max_depth=depth, topk=topk,
                        sampling=RowSampling.uniform(b, temperature=temperature))


def test_proposals_respect_budget_and_carry_q(tiny_target: Transformer, trained: EagleDrafter) -> None:
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 2)]
    for topk, depth, nodes in ((1, 6, 4), (1, 3, 16), (2, 5, 7), (4, 3, 20)):
        p = EagleProposer(trained, EagleProposerConfig(context=8))
        for b, h in enumerate(hist[:2]):  # row 2 has no features yet: root only
            p.observe([(b, 0)] * (len(h) - 1), torch.zeros(len(h) - 1), torch.randn(len(h) - 1, 64, generator=g))
        prop = p.propose(_ctx(hist, depth, nodes, temperature=1.0 if topk == 1 else 0.0, topk=topk))
        assert prop.num_nodes <= nodes and bool((prop.counts <= nodes).all())
        assert int(node_depths(prop.parents).max()) <= depth
        assert prop.counts.tolist()[2] == 1 and prop.counts.tolist()[0] == min(nodes, 1 + depth if topk == 1 else nodes)
        assert torch.equal(prop.tokens[:, 0], torch.tensor([h[-1] for h in hist]))
        if topk == 1:
            q = prop.draft_probs
            assert q is not None and q.shape == (3, prop.num_nodes, tiny_target.args.vocab_size)
            k = prop.num_nodes - 1
            torch.testing.assert_close(q[:, :k].sum(-1), torch.ones(3, k))
            drafted_q = q[:, :k].gather(-1, prop.tokens[:, 1:, None]).squeeze(-1)
            assert bool((drafted_q[:2] > 0).all())  # every drafted token was drawn from its q row
        else:
            assert prop.draft_probs is None


def test_filters_no_row_uses_are_skipped_not_changed(tiny_target: Transformer, trained: EagleDrafter) -> None:
    """DraftContext.filters (the host's view of the rows' top-k / top-p) lets a chain draft skip the sort over the
    vocabulary: with neither filter in use, skipping gives the same drafts and q rows; a common top-k taken as a number
    gives the per-row result; row_filters reads the rows' settings."""
    g = torch.Generator().manual_seed(1)
    hist = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 14)]
    feats = [torch.randn(len(h) - 1, 64, generator=g) for h in hist]

    def draft(filters: DraftFilters, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        p = EagleProposer(trained, EagleProposerConfig(context=8, seed=3))
        for b, (h, f) in enumerate(zip(hist, feats, strict=True)):
            p.observe([(b, 0)] * (len(h) - 1), torch.zeros(len(h) - 1), f)
        ctx = _ctx(hist, 4, 5, temperature=1.0)
        ctx = DraftContext(**{**ctx.__dict__, "filters": filters,
                              "sampling": RowSampling.uniform(2, temperature=1.0, top_k=top_k)})
        prop = p.propose(ctx)
        assert prop.draft_probs is not None
        return prop.tokens, prop.draft_probs

    tok_all, q_all = draft(DraftFilters(-1, True, -1.0))
    tok_skip, q_skip = draft(DraftFilters(0, False, -1.0))
    assert torch.equal(tok_all, tok_skip)
    torch.testing.assert_close(q_skip, q_all, rtol=0, atol=1e-6)
    tok_t, q_t = draft(DraftFilters(0, False, 1.0))  # the common temperature as a number: no per-row greedy handling
    assert torch.equal(tok_all, tok_t)
    torch.testing.assert_close(q_t, q_all, rtol=0, atol=1e-6)
    tok_rows, q_rows = draft(DraftFilters(-1, True, -1.0), top_k=5)  # per-row k: the sort path
    tok_k, q_k = draft(DraftFilters(5, False, 1.0), top_k=5)  # the common k as a number: torch.topk
    assert int((q_k[:, :4] > 0).sum(-1).max()) <= 5
    assert torch.equal(tok_rows, tok_k)
    torch.testing.assert_close(q_k, q_rows, rtol=0, atol=1e-6)

    def rows(*settings: tuple[float, float, int]) -> list[RequestSampling]:
        return [RequestSampling(temperature=t, top_p=p, top_k=k) for t, p, k in settings]

    assert row_filters(rows((1.0, 1.0, 0), (1.0, 1.0, 0))) == DraftFilters(0, False, 1.0)
    assert row_filters(rows((1.0, 1.0, 50), (0.0, 0.9, 50))) == DraftFilters(50, True, -1.0)
    assert row_filters(rows((0.7, 1.0, 50), (0.7, 1.0, 0))) == DraftFilters(-1, False, 0.7)
    assert row_filters(rows((0.0, 1.0, 0), (0.0, 1.0, 0))) == DraftFilters(0, False, -1.0)
