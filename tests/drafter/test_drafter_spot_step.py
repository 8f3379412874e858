"""A spot-training step is cheap: no host read-back inside the step loop (syncs do not grow with the step count),
fixed-shape windows drawn by the trainer's generator, and the chunked soft-CE equals the plain full-vocab one in
value, gradient and top-1 agreement.

Run: python -m pytest tests/drafter/test_drafter_spot_step.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.buffer import HiddenStateBuffer
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter
from worker.tlt.speculative.drafter.soft_ce import soft_cross_entropy
from worker.tlt.speculative.drafter.spot_trainer import SpotTrainer, SpotTrainerConfig, bench_step

# Tensor methods that read a value back to the host (each waits for the device on CUDA)
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter:
    """Counts host read-backs. AdamW's CPU path reads its CPU step counters with .item() (no device is involved, and
    the fused CUDA optimizer keeps them on the device), so those tensors are not counted."""

    def __init__(self, mp: pytest.MonkeyPatch, ignore: set[int]) -> None:
        self.calls: list[str] = []
        self.ignore = ignore
        for name in SYNCS:
            mp.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, orig):  # type: ignore[no-untyped-def]
        def f(t, *a, **k):  # type: ignore[no-untyped-def]
            if id(t) not in self.ignore:
                self.calls.append(name)
            return orig(t, *a, **k)

        return f


def _trainer(target: Transformer, seqs: torch.Tensor, filler, **kw) -> SpotTrainer:
    d = EagleDrafter(target, EagleConfig(feature_noise=0.1))
    buf = HiddenStateBuffer(d.feature_dim, budget_bytes=2**22, dtype=torch.float32)
    buf.begin_step(0)
    filler(buf, d, target, seqs, prompt_len=8)
    return SpotTrainer(d, buf, SpotTrainerConfig(**{"learning_rate": 1e-2, "batch_size": 8, "window": 24, **kw}))


def _optimizer_steps(tr: SpotTrainer) -> set[int]:
    return {id(s["step"]) for s in tr.optimizer.state.values()}


def test_step_loop_has_no_host_sync(tiny_target: Transformer, tiny_rollouts: torch.Tensor, filler,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler)
    assert tr.train(lambda: False, 1) == 1  # builds the window index (one read of its size) and AdamW's state
    counter = SyncCounter(monkeypatch, _optimizer_steps(tr))
    for _ in range(5):
        out = tr.train_step()
        assert out is not None
    assert counter.calls == []
    assert tr.train(lambda: False, 7) == 7 and counter.calls == []  # whole train() calls too
    m = tr.metrics()  # the one read of the step metrics
    assert counter.calls != []
    monkeypatch.undo()
    assert m["drafter/steps"] == 13 and m["drafter/loss"] > 0 and 0 <= m["drafter/acc"] <= 1


def test_windows_have_fixed_shapes_and_replay_from_the_generator(tiny_target: Transformer,
                                                                 tiny_rollouts: torch.Tensor, filler) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler)
    state = tr.generator.get_state()
    a = tr.buffer.sample(8, 24, tr.generator)
    b = tr.buffer.sample(8, 24, tr.generator)
    tr.generator.set_state(state)
    again = tr.buffer.sample(8, 24, tr.generator)
    assert a is not None and b is not None and again is not None
    assert a.tokens.shape == (8, 24) and a.hidden.shape == (8, 24, tr.drafter.feature_dim)
    assert torch.equal(a.tokens, again.tokens) and torch.equal(a.lengths, again.lengths)
    assert not torch.equal(a.tokens, b.tokens)  # the generator advanced
    # 16 sequences of 41 rows: every start has a successor except each sequence's last row; starts are uniform
    starts = torch.cat([tr.buffer.sample(64, 2, tr.generator).tokens[:, 0] for _ in range(50)])  # type: ignore[union-attr]
    assert len(set(starts.tolist())) > 100


@pytest.mark.parametrize("chunk_elems", [10**9, 3 * 300])  # one chunk; chunks of 3 rows (the last one partial)
def test_chunked_soft_ce_matches_full_vocab(chunk_elems: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v = 14, 16, 300
    head = torch.randn(v, h, generator=g)
    x = torch.randn(n, h, generator=g, requires_grad=True)
    t = torch.randn(n, h, generator=g)
    w = torch.rand(n, generator=g)  # per-row loss weights, as the trainer's masks give
    ce, agree = soft_cross_entropy(x, t, head, chunk_elems)
    (ce * w).sum().backward()
    gx = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    z, tl = x @ head.T, t @ head.T
    ref = -(torch.softmax(tl, -1) * torch.log_softmax(z, -1)).sum(-1)
    (ref * w).sum().backward()
    torch.testing.assert_close(ce, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(agree, z.argmax(-1) == tl.argmax(-1))
    with torch.no_grad():  # evaluation: no gradient buffer, same values
        torch.testing.assert_close(soft_cross_entropy(x, t, head, chunk_elems)[0], ce.detach())


def test_trainer_loss_matches_the_plain_eagle1_loss(tiny_target: Transformer, tiny_rollouts: torch.Tensor,
                                                    filler) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler, ce_chunk_elems=5 * tiny_target.args.vocab_size)
    tr.drafter.eval()  # no feature noise: the reference below sees the same inputs
    batch = tr.buffer.sample(8, 24, tr.generator)
    assert batch is not None
    loss, acc = tr.loss(batch)
    d, s = tr.drafter, 23
    out = d.unroll(batch.tokens[:, 1:], batch.hidden[:, :s], 1)[0]
    tgt = batch.hidden[:, 1:]
    valid = torch.arange(s)[None] + 1 < batch.lengths[:, None]
    logits, tl = F.linear(out, d.target.head_weight), F.linear(tgt, d.target.head_weight)
    ce = -(torch.softmax(tl, -1) * torch.log_softmax(logits, -1)).sum(-1)
    per = F.smooth_l1_loss(out, tgt, reduction="none").mean(-1) + 0.1 * ce
    torch.testing.assert_close(loss, (per * valid).sum() / valid.sum(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acc, ((logits.argmax(-1) == tl.argmax(-1)) & valid).sum() / valid.sum())


def test_bench_entry_times_a_step() -> None:
    r = bench_step("cpu", "tiny-llama", batch=2, window=16, steps=2, warmup=1)
    assert r["ms_per_step"] > 0 and r["tokens_per_step"] == 30 and r["loss"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_never_syncs_and_learns(tiny_target: Transformer, tiny_rollouts: torch.Tensor, filler,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (bf16 target and buffer, fp32 drafter, fused AdamW, bf16 autocast): zero read-backs per step, and the
    bf16 chunked soft-CE still trains the drafter."""
    import copy

    dev = torch.device("cuda")
    target = copy.deepcopy(tiny_target).to(dev, torch.bfloat16)
    d = EagleDrafter(target).to(dev)
    buf = HiddenStateBuffer(d.feature_dim, budget_bytes=2**22, device=dev, dtype=torch.bfloat16)
    buf.begin_step(0)
    filler(buf, d, target, tiny_rollouts.to(dev), prompt_len=8)
    tr = SpotTrainer(d, buf, SpotTrainerConfig(learning_rate=1e-2, batch_size=8, window=24, ce_chunk_elems=2**12))
    assert tr.optimizer.param_groups[0]["fused"] and tr.generator.device.type == "cuda"
    assert tr.train(lambda: False, 5) == 5
    first = tr.metrics()["drafter/loss"]
    counter = SyncCounter(monkeypatch, set())
    for _ in range(5):
        tr.train_step()
    assert counter.calls == []
    monkeypatch.undo()
    tr.train(lambda: False, 300)
    m = tr.metrics()
    assert m["drafter/loss"] < 0.8 * first and m["drafter/acc"] > 0.3, m
