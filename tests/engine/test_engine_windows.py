"""The plain decode loop one window ahead of its host reads (rollout/windows.py), forced on CPU: greedy outputs
(tokens and finish reasons; log-probs to 1e-4) equal the read-at-once loop's with early EOS and continuous
batching (rows that finish are retired a window late, waiting requests join a window late, done flags of moved rows
are never used); no window runs for nothing when every row ends by its token budget, at most one when rows end by
EOS.
Run: python -m pytest tests/engine/test_engine_windows.py -q"""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from worker.tlt.rollout import engine as engine_mod
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, RequestSampling
from worker.tlt.rollout.windows import PlainWindows

MODEL = tiny_target()


def _generate(reqs: list[Request], eos: tuple[int, ...], slots: int, overlap: bool,
              monkeypatch: pytest.MonkeyPatch) -> GenerationOutput:
    monkeypatch.setattr(engine_mod, "PlainWindows", functools.partial(PlainWindows, overlap=overlap))
    cfg = EngineConfig(max_len=64, max_slots=slots, sync_every=3)
    return Engine(MODEL, eos_ids=eos, config=cfg).generate(reqs)


def _requests(n: int, seed: int) -> list[Request]:
    return [Request(p, RequestSampling(temperature=0.0, max_new_tokens=10 + 3 * (i % 4)))
            for i, p in enumerate(random_prompts(n, seed=seed, hi=10))]


def _frequent_token(reqs: list[Request], monkeypatch: pytest.MonkeyPatch) -> int:
    """A token that greedy decoding emits mid-sequence in several rows: as EOS it ends them early."""
    out = _generate(reqs, (), len(reqs), False, monkeypatch)
    return Counter(t for s in out.sequences for t in s.tokens[2:8]).most_common(1)[0][0]


def _decode_steps(out: GenerationOutput) -> int:
    return sum(s.kind == "decode" for s in out.steps)


@pytest.mark.parametrize("slots", [3, 8])
def test_run_ahead_equals_read_at_once(slots: int, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _requests(8, seed=3)
    eos = (_frequent_token(reqs, monkeypatch),)
    want = _generate(reqs, eos, slots, False, monkeypatch)
    got = _generate(reqs, eos, slots, True, monkeypatch)
    assert any(s.finish_reason == "stop" for s in want.sequences)  # early EOS happened
    assert [(s.tokens, s.finish_reason) for s in got.sequences] == [(s.tokens, s.finish_reason) for s in want.sequences]
    # rows retired a window late keep the batch wider for a while: other matmul shapes, other fp32 rounding
    assert [x for s in got.sequences for x in s.logprobs] == \
        pytest.approx([x for s in want.sequences for x in s.logprobs], abs=1e-4)
    emitted = sum(s.emitted for s in got.steps if s.kind == "decode")
    assert emitted == sum(len(s.tokens) - 1 for s in got.sequences)  # the first tokens come from the prefill
    if slots == 8:  # no one waits: only the last window can run for nothing
        assert _decode_steps(want) <= _decode_steps(got) <= _decode_steps(want) + 3


def test_no_wasted_window_when_rows_end_by_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _requests(4, seed=5)
    want = _generate(reqs, (), 4, False, monkeypatch)
    got = _generate(reqs, (), 4, True, monkeypatch)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert _decode_steps(got) == _decode_steps(want) == 18  # ceil(18 / 3) windows of 3 (19 new tokens at most)
