"""The EAGLE-1 drafter's step on the fused Triton kernels (speculative/drafter/fused_step.py) against the torch step (CPU: Triton's
interpreter, fp32, the tiny target): every call a chain draft makes -- the context forward (S = W, left-padded
entries) and the one-token steps at write_at = W + step -- gives the same output and the same K/V buffers (1e-4);
a whole greedy chain draft drafts the same tokens; the dispatch picks the fused step only where it should; the
target's RoPE tables are the drafter's own RoPE. GPU (`-m gpu`): a SmolLM2-shaped bf16 drafter, fused close to torch,
greedy chains mostly equal, and the chain's time printed (`-s`).

Run: python -m pytest tests/drafter/test_drafter_fused_step.py -q    (GPU: ... -m gpu -s)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from worker.tlt.model import preset, random_model
from worker.tlt.model.transformer import Transformer, rope_inv_freq
from worker.tlt.speculative.drafter.chain_graph import record_graph
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer, EagleProposerConfig
from worker.tlt.speculative.drafter.model import DraftKV, EagleConfig, EagleDrafter


def _fused_module():  # imported lazily: the module decorates the kernels (tests/conftest.py sets the interpreter)
    from worker.tlt.speculative.drafter import fused_step

    return fused_step


def _drafter(target: Transformer, std: float = 0.1) -> EagleDrafter:
    d = EagleDrafter(target, EagleConfig()).eval()
    d.reset_parameters(std=std, seed=5)  # random weights: varied drafts (the identity init repeats itself)
    with torch.no_grad():  # a post-attention norm that is not all ones, so its weight is checked too
        w = d.post_attention_layernorm.weight
        w.copy_(1.0 + 0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(2)).to(w))
    return d


@dataclass
class Inputs:
    toks: torch.Tensor  # [B, W]
    feats: torch.Tensor  # [B, W, H]
    m: torch.Tensor  # [B] valid entries
    hist_len: torch.Tensor  # [B]


def _inputs(b: int, w: int, h: int, hist: list[int], m: list[int], vocab: int, dev: str = "cpu") -> Inputs:
    g = torch.Generator().manual_seed(3)
    return Inputs(torch.randint(0, vocab, (b, w), generator=g).to(dev), torch.randn(b, w, h, generator=g).to(dev),
                  torch.tensor(m).to(dev), torch.tensor(hist).to(dev))


Chain = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, parents, counts, draft_probs


def _chain(p: EagleProposer, x: Inputs, k: int) -> Chain:  # every row greedy (temperature 0)
    b, dev = x.toks.shape[0], x.toks.device
    return p.chain_draft_no_sync(x.toks, x.feats, x.m, x.hist_len, torch.zeros(b, device=dev),
                                 torch.ones(b, device=dev), torch.zeros(b, dtype=torch.int64, device=dev), k,
                                 (0, False, -1.0))


@dataclass
class Call:
    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, hidden, positions (cloned)
    past: DraftKV  # the buffers as the call found them (cloned)
    mask: torch.Tensor
    write_at: int


def _record(d: EagleDrafter, run: Callable[[], object], mp: pytest.MonkeyPatch) -> list[Call]:
    """The step calls `run` makes (torch steps), with their inputs as each call found them."""
    calls: list[Call] = []
    inner = d.step

    def spy(tokens, hidden, positions, past, mask, write_at=None):  # type: ignore[no-untyped-def]
        calls.append(Call((tokens.clone(), hidden.clone(), positions.clone()), DraftKV(past.k.clone(), past.v.clone()),
                          mask.clone(), write_at))
        return inner(tokens, hidden, positions, past, mask, write_at=write_at)

    mp.setattr(d, "step", spy)
    run()
    mp.undo()
    return calls


def _both(d: EagleDrafter, c: Call) -> tuple[tuple[torch.Tensor, DraftKV], tuple[torch.Tensor, DraftKV]]:
    """(torch step, fused step) of one recorded call, each on its own copy of the buffers."""
    fs = _fused_module()
    kv_t, kv_f = (DraftKV(c.past.k.clone(), c.past.v.clone()) for _ in range(2))
    d.fused = False
    with torch.no_grad():
        ref = d.step(*c.args, kv_t, c.mask, write_at=c.write_at)
    return ref, fs.fused_drafter_step(d, *c.args, kv_f, c.mask, c.write_at)


@pytest.mark.parametrize("kernels", ["fused", "gemm"])
def test_fused_step_equals_torch_step_on_every_chain_call(tiny_target: Transformer, monkeypatch: pytest.MonkeyPatch,
                                                          kernels: str) -> None:
    """Rows: 8 valid entries at positions 31..38, 3 valid (positions clamp to 0 on the left), none (root only).
    "gemm": the step a drafter of a large target's width runs (cuBLAS GEMMs between the glue kernels)."""
    d = _drafter(tiny_target)
    d.fused = False
    w, k = 8, 3
    x = _inputs(3, w, tiny_target.args.dim, hist=[40, 6, 2], m=[8, 3, 0], vocab=256)
    p = EagleProposer(d, EagleProposerConfig(context=w, cuda_graphs=False))
    calls = _record(d, lambda: _chain(p, x, k), monkeypatch)
    assert [(c.args[0].shape[1], c.write_at, c.mask.shape[2]) for c in calls] == [(w, 0, w), (1, w, w + 1),
                                                                                   (1, w + 1, w + 2)]
    assert not bool(calls[0].mask.all()) and bool(calls[0].args[2].max() == 38)  # padded, ragged context
    if kernels == "gemm":
        from worker.tlt.kernels import gemm_forward

        monkeypatch.setattr(gemm_forward, "GEMM_LAYER_BYTES", 0)  # the tiny drafter counts as large
        monkeypatch.setattr(_fused_module(), "linear_residual", None)  # so no fused GEMM may run
    for c in calls:
        (out_t, kv_t), (out_f, kv_f) = _both(d, c)
        assert out_f.shape == out_t.shape and out_f.dtype == out_t.dtype
        torch.testing.assert_close(out_f, out_t, atol=1e-4, rtol=0)
        # the whole buffers: the written columns agree, every other column is untouched
        torch.testing.assert_close(kv_f.k, kv_t.k, atol=1e-4, rtol=0)
        torch.testing.assert_close(kv_f.v, kv_t.v, atol=1e-4, rtol=0)
        assert not torch.equal(kv_f.k, c.past.k)  # it did write


def test_greedy_chain_with_fused_step_drafts_what_torch_drafts(tiny_target: Transformer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fs = _fused_module()
    d = _drafter(tiny_target)
    w, k = 8, 3
    x = _inputs(3, w, tiny_target.args.dim, hist=[40, 6, 2], m=[8, 3, 0], vocab=256)
    p = EagleProposer(d, EagleProposerConfig(context=w, cuda_graphs=False))
    d.fused = False
    ref = _chain(p, x, k)
    fused_calls: list[int] = []
    inner = fs.fused_drafter_step

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        fused_calls.append(a[1].shape[1])
        return inner(*a, **kw)

    monkeypatch.setattr(fs, "fused_drafter_step", counted)
    d.fused = True  # on CPU: Triton's interpreter
    got = _chain(p, x, k)
    assert fused_calls == [w, 1, 1]  # the context forward and k - 1 one-token steps all ran fused
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert got[0][:2, 1:].unique().numel() > 1  # varied drafts, not one repeated token


def test_dispatch_only_for_eagle1_inference_steps_into_a_buffer(tiny_target: Transformer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fs = _fused_module()
    calls: list[int] = []
    def fake(d: EagleDrafter, tokens: torch.Tensor, hidden: torch.Tensor, *rest: object) -> tuple[torch.Tensor, None]:
        calls.append(1)
        return hidden, None

    monkeypatch.setattr(fs, "fused_drafter_step", fake)
    h = tiny_target.args.dim
    toks, hid, pos = torch.zeros(1, 1, dtype=torch.int64), torch.randn(1, 1, h), torch.zeros(1, 1, dtype=torch.int64)
    mask = torch.ones(1, 1, 1, dtype=torch.bool)

    def step(d: EagleDrafter) -> None:
        kv = DraftKV.allocate(1, d.args, 4, like=d.fc.weight)
        d.step(toks, hid if d.cfg.kind == "eagle1" else torch.randn(1, 1, 3 * h), pos, kv, mask, write_at=0)

    d = _drafter(tiny_target)
    with torch.no_grad():
        step(d)  # CPU, fused None: torch
        assert calls == []
        d.fused = True
        step(d)
        assert calls == [1]
        d.step(toks, hid, pos, None, None)  # no buffer (training / trees): torch
        assert calls == [1]
    step(d)  # autograd on: torch
    assert calls == [1]
    e3 = EagleDrafter(tiny_target, EagleConfig(kind="eagle3"))
    e3.fused = True
    with torch.no_grad():
        step(e3)
    assert calls == [1]
    odd = EagleDrafter(random_model(preset("tiny-llama", head_dim=24), seed=1), EagleConfig())
    odd.fused = True
    with torch.no_grad(), pytest.raises(ValueError, match="head_dim 24"):
        step(odd)


def test_target_rope_tables_are_the_drafters_rope(tiny_target: Transformer) -> None:
    d = _drafter(tiny_target)
    assert torch.equal(d._inv_freq, rope_inv_freq(tiny_target.args))
    assert _fused_module().rope_mismatch(d) is None
    pos = torch.tensor([[0, 5, 700, 1023]])
    cos, sin = d._rope(pos)  # [1, 1, 4, D]
    half = d.args.hd // 2
    torch.testing.assert_close(tiny_target.rope_cos[pos[0]], cos[0, 0], atol=0, rtol=0)
    signed = torch.cat([-sin[0, 0, :, :half], sin[0, 0, :, half:]], dim=-1)
    torch.testing.assert_close(tiny_target.rope_sin[pos[0]], signed, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="Triton's interpreter is on: run the GPU tests alone with -m gpu (conftest.py)")
def test_gpu_smollm2_bf16_fused_step_close_and_chains_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, SmolLM2 shapes (H 576, 9/3 heads of 64, I 1536), B 8, W 64, k 6: every call's output and K/V within 3%
    of its largest magnitude, greedy chains >= 80% equal (a near-tie can flip a token and what follows), and the
    fused chain captured in a CUDA graph (as the proposer replays it) gives the eager fused chain's tokens."""
    dev = "cuda"
    target = random_model(preset("smollm2-135m", n_layers=2), seed=0, device=dev, dtype=torch.bfloat16, std=0.05)
    target.init_rope(dev, 640)
    d = _drafter(target, std=0.05).to(dev, torch.bfloat16)
    b, w, k = 8, 64, 6
    x = _inputs(b, w, target.args.dim, hist=[500, 70, 64, 30, 2, 200, 65, 400], m=[64, 64, 62, 28, 0, 64, 63, 64],
                vocab=target.args.vocab_size, dev=dev)
    p = EagleProposer(d, EagleProposerConfig(context=w, cuda_graphs=False))
    d.fused = False
    calls = _record(d, lambda: _chain(p, x, k), monkeypatch)
    for c in calls:
        (out_t, kv_t), (out_f, kv_f) = _both(d, c)
        for fused, plain in ((out_f, out_t), (kv_f.k, kv_t.k), (kv_f.v, kv_t.v)):
            assert (fused.float() - plain.float()).abs().amax().item() <= 0.03 * plain.float().abs().amax().item()
    d.fused = False
    ref = _chain(p, x, k)
    d.fused = None  # the default on CUDA: fused
    got = _chain(p, x, k)
    same = (got[0] == ref[0]).float().mean().item()
    assert same >= 0.8
    graph, out = record_graph(lambda: _chain(p, x, k), p.gen, torch.cuda.graph_pool_handle(),  # type: ignore[arg-type]
                              torch.device(dev))
    graph.replay()
    assert torch.equal(out[0], got[0])


@pytest.mark.parametrize("streams", [False, True], ids=["generator", "streams"])
@pytest.mark.parametrize("draft_vocab", [None, 97], ids=["all", "vocab97"])
def test_sampled_chain_with_fused_step_samples_in_kernels(tiny_target: Transformer, monkeypatch: pytest.MonkeyPatch,
                                                         draft_vocab: int | None, streams: bool) -> None:
    """T = 1, no filters, fused step: each drafted token comes from kernels/draft_sample.py, drawing the same noise
    as the torch path (from the proposer's generator, or the rows' own streams as the engine passes them), with the
    same tokens and q; with a draft vocabulary too (the kernel's token and q in target ids)."""
    from worker.tlt.decoding.sampling import pick_with_noise, processed_probs
    from worker.tlt.kernels import draft_sample as ds

    d = _drafter(tiny_target)
    d.fused = True  # on CPU: Triton's interpreter
    w, k, b = 8, 3, 3
    x = _inputs(b, w, tiny_target.args.dim, hist=[40, 6, 2], m=[8, 3, 0], vocab=256)
    p = EagleProposer(d, EagleProposerConfig(context=w, cuda_graphs=False))
    vocab = None
    if draft_vocab is not None:
        vocab = torch.sort(torch.randperm(tiny_target.args.vocab_size,
                                          generator=torch.Generator().manual_seed(1))[:draft_vocab]).values
        p.set_draft_vocab(vocab)

    def chain() -> Chain:
        p.gen.manual_seed(4)
        keyed = (torch.tensor([5, -9, 1 << 40]), torch.tensor([0, 3, 7])) if streams else None
        return p.chain_draft_no_sync(x.toks, x.feats, x.m, x.hist_len, torch.ones(b), torch.ones(b),
                                     torch.zeros(b, dtype=torch.int64), k, (0, False, 1.0), keyed)

    calls: list[float] = []
    kernel = ds.draft_sample

    def counted(logits, noise, temp, **kw):  # type: ignore[no-untyped-def]
        calls.append(temp)
        return kernel(logits, noise, temp, **kw)

    monkeypatch.setattr(ds, "draft_sample", counted)
    got = chain()
    assert calls == [1.0] * k

    def torch_path(logits, noise, temp, vocab, out):  # type: ignore[no-untyped-def]
        q = processed_probs(logits.float(), temp)
        if vocab is None:
            out.copy_(q)
            return pick_with_noise(q, noise), out
        out.index_copy_(-1, vocab, q)
        return vocab[pick_with_noise(q, noise)], out

    monkeypatch.setattr(ds, "draft_sample", torch_path)
    ref = chain()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[3], ref[3], rtol=2e-5, atol=1e-7)
    assert got[0][:2, 1:].unique().numel() > 1  # varied drafts
    if vocab is not None:
        assert bool(torch.isin(got[0][:, 1:], vocab).all())
