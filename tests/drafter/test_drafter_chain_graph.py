"""The chain draft is graph-ready: k drafter forwards, no host sync, a preallocated drafter K/V that drafts exactly what
the concatenating K/V drafts; on CUDA (gpu marker) the captured graph drafts exactly what eager drafting drafts and
a propose never synchronises with the device.

GPU: python -m pytest tests/drafter/test_drafter_chain_graph.py -q -m gpu
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from tests.drafter.eager_graphs import record_eagerly
from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.sampling import RowSampling, processed_probs
from worker.tlt.model import preset, random_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.proposers.protocol import DraftContext

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _drafter(target: Transformer) -> EagleDrafter:
    d = EagleDrafter(target, EagleConfig())
    d.reset_parameters(std=0.1, seed=5)  # random weights: varied drafts (the identity init repeats itself)
    return d


def _filled(d: EagleDrafter, cfg: EagleProposerConfig, hist: list[list[int]], seed: int = 0) -> EagleProposer:
    p = EagleProposer(d, cfg)
    g = torch.Generator().manual_seed(seed)
    for b, h in enumerate(hist[:-1]):  # the last row has no features yet: root only
        n = len(h) - 1
        p.observe([(b, 0)] * n, torch.tensor(h[:-1]), torch.randn(n, d.feature_dim, generator=g).to(p.device))
    return p


def _ctx(hist: list[list[int]], depth: int, temperature: float, device: torch.device) -> DraftContext:
    b = len(hist)
    return DraftContext(histories=hist, prompt_lens=[2] * b, group_ids=list(range(b)), sample_ids=[0] * b,
                        max_nodes=depth + 1, max_depth=depth, device=device,
                        sampling=RowSampling.uniform(b, temperature=temperature, device=device))


def _hist(lengths: tuple[int, ...] = (9, 40, 3, 70, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


class SyncCounter:
    """Counts calls of the Tensor methods that read a value back to the host (each one waits for the device)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in SYNCS:
            orig = getattr(torch.Tensor, name)
            mp.setattr(torch.Tensor, name, self._wrap(name, orig))

    def _wrap(self, name, orig):  # type: ignore[no-untyped-def]
        def f(t, *a, **k):  # type: ignore[no-untyped-def]
            self.calls.append(name)
            return orig(t, *a, **k)

        return f


@pytest.fixture
def sync_counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    yield SyncCounter(monkeypatch)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_propose_has_no_host_sync_and_k_forwards(tiny_target: Transformer, temperature: float,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = _drafter(tiny_target)
    hist = _hist()
    p = _filled(d, EagleProposerConfig(context=16), hist)
    ctx = _ctx(hist, 6, temperature, p.device)
    forwards: list[int] = []
    inner = d.step

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        forwards.append(1)
        return inner(*a, **k)

    monkeypatch.setattr(d, "step", counted)
    counter = SyncCounter(monkeypatch)
    prop = p.propose(ctx)
    assert counter.calls == [] and len(forwards) == 6  # context forward + 5 chain steps draft 6 tokens
    assert bool(prop.counts[0] == 7) and counter.calls == ["__bool__"]  # the counter does see a read-back
    monkeypatch.undo()
    assert prop.tokens.shape == (5, 7) and prop.counts.tolist() == [7, 7, 7, 7, 1]
    assert prop.draft_probs is not None and prop.draft_probs.shape == (5, 7, tiny_target.args.vocab_size)
    drawn = prop.draft_probs[:4, :6].gather(-1, prop.tokens[:4, 1:, None])
    assert bool((drawn > 0).all())  # every drafted token came from its q row (greedy: the one-hot's index)
    # the tree path still reads histories through the same inputs (and may sync: it is not graph-captured)
    tree = DraftContext(**{**ctx.__dict__, "topk": 3})
    assert EagleProposer(d, EagleProposerConfig(context=16)).propose(tree).num_nodes <= 7


def test_preallocated_kv_drafts_what_the_concatenating_kv_drafts(tiny_target: Transformer) -> None:
    """chain_draft_no_sync (K/V written by column into one buffer) == a reference chain over a K/V grown by
    concatenation (the training path's DraftKV.extend)."""
    d = _drafter(tiny_target)
    hist = _hist()
    w, k = 16, 5
    p = _filled(d, EagleProposerConfig(context=w), hist)
    ctx = _ctx(hist, k, 0.0, p.device)
    prop = p.propose(ctx)
    packed = torch.from_numpy(p._pack(ctx, len(hist)))
    toks, feats, m = p._inputs(ctx, packed)
    with torch.no_grad():
        o, kv, valid, last_pos = p._context_forward(toks, feats, m, packed[:, -1], None)
        ref = []
        mask = valid
        for s in range(k):
            tok = processed_probs(d.logits(o[:, 0]).float(), 0.0).argmax(-1)
            ref.append(tok)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            o, kv = d.step(tok[:, None], o, (last_pos + 1 + s)[:, None], kv, mask[:, None, :])
    assert torch.equal(prop.tokens[:, 1:], torch.stack(ref, 1))
    assert torch.equal(prop.tokens[:, 0], torch.tensor([h[-1] for h in hist]))


def _assert_same_q(a: DraftProposal, b: DraftProposal) -> None:
    """Row i of draft_probs is q(. | nodes 0..i): it must match (fp32 rounding only, atol 1e-5) wherever both
    proposals drafted the same nodes 0..i -- always the root row q(. | context), which no random draw precedes."""
    assert a.draft_probs is not None and b.draft_probs is not None
    same = (a.tokens == b.tokens).long().cumprod(1).bool()  # [B, k+1] nodes 0..i agree
    assert bool(same[:, 0].all())
    torch.testing.assert_close(a.draft_probs[same], b.draft_probs[same], atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_plumbing_pads_to_the_bucket_and_matches_eager(tiny_target: Transformer, temperature: float,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphed path (static buffers per batch bucket, padding rows, output slicing, reuse across calls) drafts
    what the eager path drafts; the graph is replaced by eager replay so this runs on the CPU. The context carries
    the rows' random streams (DraftContext.streams, as the engine passes them), so even sampled drafts are identical,
    in an exact bucket (4 rows) or a padded one (5 rows in bucket 8). Histories longer than the context window make
    each sequence's features wrap around its ring within one observe."""
    d = _drafter(tiny_target)
    w, k = 16, 6

    monkeypatch.setattr(EagleProposer, "_record", record_eagerly)
    monkeypatch.setattr(EagleProposer, "_graphable", lambda self, bsz, ctx: True)
    for lengths, bucket in (((9, 40, 3, 70, 5), 8), ((12, 6, 30, 25), 4), ((12, 6, 30), 4)):
        hist = _hist(lengths)
        graphed = _filled(d, EagleProposerConfig(context=w), hist)
        eager = _filled(d, EagleProposerConfig(context=w, cuda_graphs=False), hist)
        monkeypatch.setattr(eager, "_graphable", lambda bsz, ctx: False)
        n = len(lengths)
        keys, n_gen = torch.arange(7, 7 + n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        ctx = dataclasses.replace(_ctx(hist, k, temperature, eager.device), streams=(keys, n_gen))
        graphed.propose(ctx)  # captures
        for step in range(2):
            n_gen.fill_(step * 3)  # the rows moved on: other draws
            a, b = eager.propose(ctx), graphed.propose(ctx)
            assert torch.equal(a.parents, b.parents) and torch.equal(a.counts, b.counts)
            assert torch.equal(a.tokens, b.tokens)
            _assert_same_q(a, b)
        assert list(graphed._graphs) == [(bucket, k, (-1, True, -1.0))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphed_chain_equals_eager_and_never_syncs(tiny_target: Transformer, temperature: float) -> None:
    """The captured chain computes what eager drafting computes, on the same inputs, without a host sync. 4 rows fill
    batch bucket 4 exactly, so graph and eager run the same matmul shapes; fp32, so every q row whose prefix both
    drafted alike must agree to fp32 rounding (atol 1e-5), the root's q(. | context) always. (The root
    rows once differed by 0.008 because the two proposers' feature rings had kept different stale features -- a
    CUDA index_copy_ race on a sequence's duplicate ring cells, fixed in observe; test_drafter_observe.py.)
    T=0: identical drafts (a flip would need a logit near-tie within fp32 rounding). T=1: the graph samples with
    the proposer's generator registered to it; the sampled streams are not required to match eager's, only drafted
    tokens that q can produce and fresh draws on every replay."""
    dev = torch.device("cuda")
    target = copy.deepcopy(tiny_target).to(dev)
    d = _drafter(target).to(dev)
    hist = _hist((9, 40, 3, 70))
    eager = _filled(d, EagleProposerConfig(context=16, cuda_graphs=False), hist)
    graphed = _filled(d, EagleProposerConfig(context=16), hist)
    ctx = _ctx(hist, 6, temperature, dev)
    graphed.propose(ctx)  # captures (batch bucket, depth 6)
    assert list(graphed._graphs) == [(4, 6, (-1, True, -1.0))]
    for _ in range(3):
        state = graphed.gen.get_state()
        eager.gen.set_state(state)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            a = eager.propose(ctx)
            b = graphed.propose(ctx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert a.draft_probs is not None and b.draft_probs is not None
        assert torch.equal(a.parents, b.parents) and torch.equal(a.counts, b.counts)
        _assert_same_q(a, b)  # the root's row q(. | context), and every later row whose prefix agrees
        print(f"T={temperature}: drafted tokens agree on {(a.tokens == b.tokens).float().mean():.2f} of nodes")
        if temperature == 0.0:
            assert torch.equal(a.tokens, b.tokens)
        else:
            q_of_tok = b.draft_probs[:, :-1].gather(2, b.tokens[:, 1:, None]).squeeze(2)  # node i+1 ~ row i
            assert bool((q_of_tok > 0).all())  # every drafted token is one its q can sample
            assert graphed.gen.get_state().tolist() != state.tolist()  # each replay draws fresh numbers
    assert len(graphed._graphs) == 1  # replays, no new capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft_vocab", [0, 150], ids=["all", "vocab150"])
def test_graphed_chain_in_the_engine_is_lossless(draft_vocab: int) -> None:
    """Chain drafts from captured graphs inside the engine's speculative steps: greedy output == plain decoding
    (fp32, so both paths round alike); then bf16 target + bf16 drafter (how OnlineDrafter serves on GPU) sampled at
    T=1 finish with a sane acceptance. Also with a draft vocabulary (the fused race over its 150 ids)."""
    from worker.tlt.rollout.engine import Engine
    from worker.tlt.rollout.types import EngineConfig, Request
    from worker.tlt.rollout.types import RequestSampling as ReqParams
    from worker.tlt.speculative.arm import chain_arm
    from worker.tlt.speculative.control.controller import AdaptiveSd

    dev = torch.device("cuda")
    prompts = [[(7 * i + j * 13) % 250 for j in range(6 + i % 3)] for i in range(6)]
    cfg = EngineConfig(max_len=64, max_slots=8)
    for dtype in (torch.float32, torch.bfloat16):
        # the fixture's model, built in `dtype` on the GPU (RoPE tables stay fp32)
        target = random_model(preset("tiny-llama", n_layers=4), seed=1, std=0.15, device=dev, dtype=dtype)
        d = _drafter(target).to(dev, dtype)
        prop = EagleProposer(d, EagleProposerConfig(context=16))
        if draft_vocab:
            prop.set_draft_vocab(torch.randperm(258, generator=torch.Generator().manual_seed(0))[:draft_vocab])
        eng = Engine(target, eos_ids=(257,), config=cfg, controller=AdaptiveSd.fixed(chain_arm("eagle", 5)),
                     proposers={"eagle": prop}, hidden_hook=prop.observe)
        if dtype == torch.float32:
            greedy = ReqParams(temperature=0.0, max_new_tokens=40)
            ref = Engine(target, eos_ids=(257,), config=cfg).generate([Request(p, greedy) for p in prompts])
            out = eng.generate([Request(p, greedy) for p in prompts])
            assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
        sampled = eng.generate([Request(p, ReqParams(temperature=1.0, max_new_tokens=40)) for p in prompts])
        assert len(prop._graphs) >= 1 and all(k == 5 for _, k, _ in prop._graphs)
        steps = [s for s in sampled.steps if s.kind == "spec"]
        per_verify = sum(s.emitted for s in steps) / sum(s.active for s in steps)
        assert 1.0 <= per_verify <= 6.0 and all(len(s.tokens) > 0 for s in sampled.sequences)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_chain_follows_an_in_place_draft_vocab_change(tiny_target: Transformer) -> None:
    """OnlineDrafter re-picks the draft vocabulary at each rollout start with a set of the same size: copied in
    place, so the captured graph (no re-capture) drafts from the new set and its head rows. fp32, T=1."""
    dev = torch.device("cuda")
    d = _drafter(copy.deepcopy(tiny_target).to(dev)).to(dev)
    hist = _hist((9, 40, 3, 70))
    p = _filled(d, EagleProposerConfig(context=16), hist)
    ctx = _ctx(hist, 6, 1.0, dev)
    perm = torch.randperm(320, generator=torch.Generator().manual_seed(3))
    first, second = perm[:100], perm[100:200]  # disjoint sets
    p.set_draft_vocab(first)
    a = p.propose(ctx)
    assert bool(torch.isin(a.tokens[:, 1:].cpu(), first).all())
    graphs = dict(p._graphs)
    p.set_draft_vocab(second)
    b = p.propose(ctx)
    assert bool(torch.isin(b.tokens[:, 1:].cpu(), second).all())
    assert p._graphs == graphs and all(p._graphs[k] is g for k, g in graphs.items())  # replayed, not re-captured
    assert b.draft_probs is not None
    outside = ~torch.isin(torch.arange(320), second)
    assert bool((b.draft_probs[:, :-1, outside.to(dev)] == 0).all())
