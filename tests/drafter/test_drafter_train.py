"""SpotTrainer: learns the target's own greedy outputs, stops at step boundaries when told, saves/loads only its
trainable parameters, publishes versioned snapshots."""

from __future__ import annotations

import time

import pytest
import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.buffer import HiddenStateBuffer
from worker.tlt.speculative.drafter.eagle_proposer import EagleProposer
from worker.tlt.speculative.drafter.model import EagleConfig, EagleDrafter, Kind
from worker.tlt.speculative.drafter.spot_trainer import SpotTrainer, SpotTrainerConfig


def _trainer(target: Transformer, seqs: torch.Tensor, filler, kind: Kind = "eagle1", **kw) -> SpotTrainer:
    d = EagleDrafter(target, EagleConfig(kind=kind, ttt_steps=1 if kind == "eagle1" else 2))
    width = d.feature_dim + (0 if kind == "eagle1" else d.args.dim)
    buf = HiddenStateBuffer(width, budget_bytes=2**22, dtype=torch.float32)
    buf.begin_step(0)
    filler(buf, d, target, seqs, prompt_len=8)
    return SpotTrainer(d, buf, SpotTrainerConfig(**{"learning_rate": 1e-2, "batch_size": 8, "window": 24, **kw}))


def _full_accuracy(tr: SpotTrainer, seqs: torch.Tensor) -> float:
    """Top-1 agreement over every training pair of every sequence (deterministic: whole sequences, no sampling)."""
    d = tr.drafter.eval()
    rows = tr.buffer.hidden[: seqs.shape[0] * 41].view(seqs.shape[0], 41, -1)
    toks = tr.buffer.tokens[: seqs.shape[0] * 41].view(seqs.shape[0], 41)
    with torch.no_grad():
        out = d.unroll(toks[:, 1:], rows[:, :-1, : d.feature_dim], 1)[0]
        pred = d.logits(out).argmax(-1)
        final = rows[:, 1:, d.feature_dim:] if d.cfg.kind == "eagle3" else rows[:, 1:]
        truth = torch.nn.functional.linear(final, d.target.head_weight).argmax(-1)
    return float((pred == truth).float().mean())


def test_learns_target_greedy_outputs(tiny_target: Transformer, tiny_rollouts: torch.Tensor, filler) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler)
    before = _full_accuracy(tr, tiny_rollouts)
    repeat = float((tiny_rollouts[:, 9:] == tiny_rollouts[:, 8:-1]).float().mean())  # "next = current" baseline
    t0 = time.perf_counter()
    steps = tr.train(lambda: False, max_steps=400)
    took = time.perf_counter() - t0
    after = _full_accuracy(tr, tiny_rollouts)
    m = tr.metrics()
    assert steps == 400 and m["drafter/steps"] == 400
    assert before < 0.2 and repeat < 0.2  # init = "copy h_j", i.e. the repeat baseline
    # a random 4-layer target is harder to imitate than a real LM's own text: ~0.55 after 400 steps (0.12 at init)
    assert after > 0.45 and after > 3 * max(before, repeat), f"top-1 agreement {after:.2f} (from {before:.2f})"
    assert m["drafter/acc"] > 0.4 and m["drafter/loss"] > 0
    assert 0 < m["harvest/used_gpu_s_total"] <= m["harvest/idle_gpu_s_total"] <= took + 1e-3


def test_preemption_returns_at_step_boundary(tiny_target: Transformer, tiny_rollouts: torch.Tensor, filler) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler)
    calls = []

    def until() -> bool:
        calls.append(1)
        return len(calls) > 3

    assert tr.train(until, max_steps=100) == 3 and tr.steps == 3
    opt_steps = {int(s["step"]) for s in tr.optimizer.state.values()}
    assert opt_steps == {3}  # optimizer state and the step counter moved together
    before = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
    assert tr.train(lambda: True, max_steps=100) == 0  # told to stop before starting: nothing changes
    assert all(torch.equal(before[k], v) for k, v in tr.drafter.state_dict().items())
    # a deadline: returns within about one step of it
    step_s = tr.used_gpu_s / 3
    deadline = time.perf_counter() + 0.3
    t0 = time.perf_counter()
    n = tr.train(lambda: time.perf_counter() > deadline, max_steps=10_000)
    assert n > 0 and time.perf_counter() - t0 < 0.3 + 3 * step_s + 0.2
    assert {int(s["step"]) for s in tr.optimizer.state.values()} == {3 + n}


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_save_load_trainable_only(tmp_path, tiny_target: Transformer, tiny_rollouts: torch.Tensor, filler,
                                  kind: Kind) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler, kind=kind)
    tr.train(lambda: False, max_steps=3)
    path = tmp_path / "drafter.safetensors"
    tr.save(path)
    from safetensors.torch import load_file

    saved = load_file(str(path))
    assert set(saved) == set(tr.drafter.state_dict())
    assert not any("embed" in k for k in saved)
    # bytes on disk: the drafter's own tensors only (the target embedding alone would be V*H*4 bytes more)
    assert path.stat().st_size < sum(v.numel() * v.element_size() for v in saved.values()) + 64 * 1024
    other = _trainer(tiny_target, tiny_rollouts, filler, kind=kind)
    other.load(path)
    assert other.steps == 3
    for k, v in tr.drafter.state_dict().items():
        assert torch.equal(other.drafter.state_dict()[k], v)
    batch = tr.buffer.sample(4, 16, torch.Generator().manual_seed(1))
    assert batch is not None
    with torch.no_grad():
        torch.testing.assert_close(tr.loss(batch)[0], other.loss(batch)[0])


def test_snapshots_reach_the_proposer_only_when_loaded(tiny_target: Transformer, tiny_rollouts: torch.Tensor,
                                                       filler) -> None:
    tr = _trainer(tiny_target, tiny_rollouts, filler)
    prop = EagleProposer(EagleDrafter(tiny_target, EagleConfig()))
    snap = tr.snapshot()
    assert prop.load_snapshot(snap) and prop.version == 1
    tr.train(lambda: False, max_steps=2)  # training after the snapshot does not touch the engine's copy
    for k, v in snap.state.items():
        assert torch.equal(prop.drafter.state_dict()[k], v)
    assert not torch.equal(prop.drafter.fc.weight, tr.drafter.fc.weight)
    assert not prop.load_snapshot(snap)  # not newer
    assert prop.load_snapshot(tr.snapshot()) and prop.version == 2
    assert torch.equal(prop.drafter.fc.weight, tr.drafter.fc.weight)
