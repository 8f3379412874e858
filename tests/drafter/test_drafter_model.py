"""EagleDrafter: shapes, gradients only on drafter parameters, shared (not copied) target tensors, and that the
training-time-test unroll computes exactly what step-by-step drafting computes."""

from __future__ import annotations

import pytest
import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter, Kind, eagle3_layers


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_forward_backward_only_drafter_params_get_grads(tiny_target: Transformer, kind: Kind) -> None:
    d = EagleDrafter(tiny_target, EagleConfig(kind=kind, draft_vocab_size=200 if kind == "eagle3" else 0, ttt_steps=2))
    h = tiny_target.args.dim
    # shared by identity, never registered as the drafter's own
    assert d.embed_weight is tiny_target.model.embed_tokens.weight
    own = {id(p) for p in d.parameters()}
    assert all(id(p) not in own for p in tiny_target.parameters())
    assert not any(k.startswith(("target", "embed")) for k in d.state_dict())
    tiny_target.zero_grad(set_to_none=True)
    b, s = 2, 7
    toks = torch.randint(0, 256, (b, s + 1))
    feats = torch.randn(b, s, d.feature_dim)
    outs = d.unroll(toks, feats, steps=2)
    assert len(outs) == 2 and all(o.shape == (b, s, h) for o in outs)
    logits = d.logits(outs[1])
    assert logits.shape == (b, s, tiny_target.args.vocab_size)
    (sum(o.square().mean() for o in outs) + d.draft_logits(outs[0]).logsumexp(-1).mean()).backward()
    assert all(p.grad is None for p in tiny_target.parameters()), "the target's tensors must stay frozen"
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert d.fc.weight.shape == (h, (2 if kind == "eagle1" else 3) * h)
    if kind == "eagle3":
        assert d.self_attn.qkv_proj.weight.shape[1] == 2 * h and d.lm_head.weight.shape == (200, h)
        assert torch.isinf(logits[..., 250]).all()  # outside the draft vocab (ids 0..199 by default)
    else:
        assert not hasattr(d, "input_layernorm")  # EAGLE-1 layer 0 has no input_layernorm


def test_eagle3_feature_layers() -> None:
    assert eagle3_layers(30) == (2, 15, 27)  # SmolLM2: hidden states entering layers 2, L//2, L-3
    with pytest.raises(ValueError):
        eagle3_layers(3)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_unroll_matches_stepwise_drafting(tiny_target: Transformer, kind: Kind) -> None:
    """Step s of the training-time test at entry j == drafting s tokens after a context of entries 0..j."""
    torch.manual_seed(0)
    d = EagleDrafter(tiny_target, EagleConfig(kind=kind)).eval()
    d.reset_parameters(std=0.1, seed=3)
    s, steps = 6, 3
    toks = torch.randint(0, 256, (1, s + steps - 1))
    feats = torch.randn(1, s, d.feature_dim)
    with torch.no_grad():
        outs = d.unroll(toks, feats, steps)
        for j in (0, 3, 5):
            out, kv = d.step(toks[:, : j + 1], feats[:, : j + 1], torch.arange(j + 1)[None], None, None)
            o = out[:, -1:]
            torch.testing.assert_close(o[:, 0], outs[0][:, j], atol=1e-5, rtol=1e-5)
            for st in range(1, steps):
                mask = torch.ones(1, 1, kv.length + 1, dtype=torch.bool)
                o, kv = d.step(toks[:, j + st: j + st + 1], o, torch.tensor([[j + st]]), kv, mask)
                torch.testing.assert_close(o[:, 0], outs[st][:, j], atol=1e-5, rtol=1e-5)


def test_eagle3_head_starts_as_the_targets_over_its_draft_vocab(tiny_target: Transformer) -> None:
    d = EagleDrafter(tiny_target, EagleConfig(kind="eagle3", draft_vocab_size=100))
    x = torch.randn(3, tiny_target.args.dim)  # a pre-norm hidden state
    want = tiny_target.logits_from_hidden(tiny_target.model.norm(x))  # [3, V]
    torch.testing.assert_close(d.draft_logits(x), want[:, :100])  # draft ids 0..99 before any vocabulary is set
    counts = torch.zeros(tiny_target.args.vocab_size)
    picked = torch.randperm(tiny_target.args.vocab_size)[:100]
    counts[picked] = torch.rand(100) + 1.0
    d.set_draft_vocab(counts)
    ids = d.draft_to_target(torch.arange(100))
    assert torch.equal(ids, torch.sort(picked).values)
    torch.testing.assert_close(d.draft_logits(x), want[:, ids])  # the head follows the new vocabulary
