"""HiddenStateBuffer: byte budget, eviction of the oldest step and oldest rows, windows of consecutive rows of one
sequence; EngineCapture keeps response rows (and the prompt's last row) of real engine hook calls."""

from __future__ import annotations

import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.drafter.buffer import EngineCapture, HiddenStateBuffer


def _rows(seq: int, start: int, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + n)
    # token = position, hidden = (seq, position) so a sampled window shows where it came from
    hid = torch.stack([torch.full((n,), float(seq)), pos.float()], 1).repeat(1, width // 2)
    return torch.full((n,), seq), pos, hid


def test_budget_and_step_eviction() -> None:
    width = 4
    buf = HiddenStateBuffer(width, budget_bytes=100 * (width * 4 + 24), dtype=torch.float32)
    assert buf.capacity == 100 and buf.nbytes <= 100 * (width * 4 + 24)
    for step in range(3):
        buf.begin_step(step)
        for seq in range(2):
            buf.capture(*_rows(10 * step + seq, 0, 20, width))
        assert buf.steps_held() == list(range(max(0, step - 1), step + 1))  # the last two steps
        assert len(buf) == 40 * min(step + 1, 2)
    # overflow: 150 new rows into a 100-row ring keep the newest 100, all of step 3
    buf.begin_step(3)
    for seq in range(3):
        buf.capture(*_rows(30 + seq, 0, 50, width))
    assert len(buf) == 100 and buf.steps_held() == [3]
    kept = sorted(set(buf.seq[buf.step >= 0].tolist()))
    assert kept == [31, 32]


def test_sampled_windows_are_consecutive_rows_of_one_sequence() -> None:
    width = 2
    buf = HiddenStateBuffer(width, budget_bytes=1000 * (width * 4 + 24), dtype=torch.float32)
    buf.begin_step(0)
    # interleaved capture, as batched decoding delivers it: one row of each sequence per call
    for p in range(30):
        for seq in (1, 2, 3):
            if seq == 3 and p >= 5:
                continue
            ids, toks, hid = _rows(seq, p, 1, width)
            buf.capture(ids, toks, hid)
    batch = buf.sample(64, 8, torch.Generator().manual_seed(0))
    assert batch is not None and batch.tokens.shape == (64, 8) and batch.hidden.shape == (64, 8, width)
    assert bool((batch.lengths >= 2).all()) and bool((batch.lengths <= 8).all())
    for b in range(64):
        n = int(batch.lengths[b])
        seqs = batch.hidden[b, :n, 0]
        pos = batch.hidden[b, :n, 1]
        assert bool((seqs == seqs[0]).all())
        assert torch.equal(pos, pos[0] + torch.arange(n).float())
        assert torch.equal(batch.tokens[b, :n].float(), pos)
        if int(seqs[0]) == 3:
            assert int(pos[-1]) <= 4  # never runs past the end of a short sequence
    assert buf.sample(4, 8) is not None


def test_engine_capture_keeps_response_rows(tiny_target: Transformer) -> None:
    buf = HiddenStateBuffer(tiny_target.args.dim, budget_bytes=2**22, dtype=torch.float32)
    cap = EngineCapture(buf)
    engine = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=4), hidden_hook=cap)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    out = engine.generate([Request(p, RequestSampling(temperature=1.0, max_new_tokens=12, n=2)) for p in prompts])
    buf_rows = {}
    for s in set(buf.seq[buf.step >= 0].tolist()):
        sel = (buf.seq == s) & (buf.step >= 0)
        buf_rows[s] = buf.tokens[sel].tolist()
    for seq in out.sequences:
        sid = seq.request * cap.max_samples + seq.sample  # first rollout of this capture: epoch 0
        # the prompt's last row (sample 0 only: siblings share its prefill), then every emitted token that was fed
        # back (all but the last)
        expect = ([prompts[seq.request][-1]] if seq.sample == 0 else []) + seq.tokens[:-1]
        assert buf_rows[sid] == expect
    # the hidden rows are the target's own (teacher-forced check on one sequence)
    s0 = out.sequences[0]
    ids = torch.tensor([prompts[0] + s0.tokens])
    with torch.no_grad():
        _, h, _ = tiny_target.forward_hidden(ids)
    sel = (buf.seq == 0) & (buf.step >= 0)
    torch.testing.assert_close(buf.hidden[sel], h[0, len(prompts[0]) - 1: len(prompts[0]) - 1 + int(sel.sum())],
                               atol=1e-4, rtol=1e-4)
