"""Rewards as sequences finish: the scorer returns scores in index order whatever order responses arrive in; with an
engine that reports finished sequences (`generate(..., on_finish=)`) scoring runs on the worker thread while the
engine is still generating; with an engine that does not, every response is still handed over once after generate;
the trainer's streamed rewards equal scoring the decoded responses in one batch.

Run: python -m pytest tests/train/test_train_streaming_rewards.py -q
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from worker.tlt.data.dataset import load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.job_spec_translate import request_sampling
from worker.tlt.model.load import load_model
from worker.tlt.model.tokenizer import ByteTokenizer
from worker.tlt.rewards.registry import resolve, score_all
from worker.tlt.rewards.streaming import StreamingScorer
from worker.tlt.rl.engine_adapter import EngineRollout, make_rollout
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.rollout.types import GenerationOutput, Request, SequenceResult


def _count_a(completion: str, answer: str) -> float:
    return completion.count("a") / max(len(completion), 1)


def test_scorer_returns_scores_in_index_order() -> None:
    tok = ByteTokenizer()
    texts = ["aaa", "bab", "", "abba"]
    scorer = StreamingScorer(tok, [_count_a], None)
    for i in (2, 0, 3, 1):
        scorer.submit(i, tok.encode(texts[i]), "")
    got_texts, scored, busy = scorer.collect(4)
    assert got_texts == texts
    assert scored == score_all([_count_a], None, texts, [""] * 4)
    assert busy > 0
    with pytest.raises(ValueError, match="never submitted"):
        scorer.collect(1)
    scorer.submit(0, [97], "")
    with pytest.raises(ValueError, match="twice"):
        scorer.submit(0, [97], "")
    scorer.clear()  # what a rollout that raised left behind
    scorer.submit(0, [97, 97], "")
    assert scorer.collect(1)[1] == [(1.0, [1.0])]
    scorer.close()


class _FakeEngine:
    """Generates fixed responses one at a time. With `streaming`, its generate has the on_finish parameter and, after
    reporting a sequence, waits (bounded) until a reward function has seen it: generation provably still runs
    while scoring does."""

    def __init__(self, responses: list[list[int]], streaming: bool, scored: threading.Event) -> None:
        self.responses, self.scored = responses, scored
        self.gen = torch.Generator()
        self.returned_at: float | None = None
        if streaming:
            self.generate = self._generate_streaming  # type: ignore[method-assign]

    def _results(self, requests: Sequence[Request]) -> list[SequenceResult]:
        n = requests[0].params.n
        return [SequenceResult(r, s, self.responses[r * n + s], [0.0] * len(self.responses[r * n + s]), "stop")
                for r in range(len(requests)) for s in range(n)]

    def generate(self, requests: Sequence[Request], on_finish: None = None, *, plain: bool = False
                 ) -> GenerationOutput:
        assert on_finish is None, "this engine cannot report sequences as they finish"
        return GenerationOutput(self._results(requests), [], 0.0)

    def _generate_streaming(self, requests: Sequence[Request],
                            on_finish: Callable[[SequenceResult], None] | None = None, *,
                            plain: bool = False) -> GenerationOutput:
        results = self._results(requests)
        for k, res in enumerate(results):
            assert on_finish is not None
            on_finish(res)
            if k == 0:  # the rest are "still decoding" until the first response has been scored
                assert self.scored.wait(timeout=10), "the first response was not scored while generating"
        return GenerationOutput(results, [], 0.0)


def _toy_trainer(toy_spec, engine: Any = None, streaming: bool = True) -> GRPOTrainer:
    spec = toy_spec()
    model, tok = load_model(spec.model)
    rows, _ = split_examples(load_examples(spec.dataset), 0)
    prompts = render_examples(rows, tok, None, 64)
    rollout = make_rollout(spec, model, tok, torch.device("cpu"))
    if engine is not None:
        rollout = EngineRollout(engine, tok, request_sampling(spec), streams_finished=streaming)
    return GRPOTrainer(spec, model, tok, rollout, prompts, resolve(["toy_count"]))


@pytest.mark.parametrize("streaming", [True, False])
def test_rewards_arrive_through_the_engine_callback_or_after_generate(toy_spec, streaming: bool) -> None:
    scored = threading.Event()
    calls: list[tuple[str, bool]] = []
    engine = _FakeEngine([], streaming, scored)

    def reward(completion: str, answer: str) -> float:
        calls.append((threading.current_thread().name, engine.returned_at is None))
        scored.set()
        return float(len(completion))

    trainer = _toy_trainer(toy_spec, engine, streaming)
    trainer.scorer = StreamingScorer(trainer.tokenizer, [reward], None)
    prompts = trainer.sampler.next_batch(2)
    engine.responses = [[97] * k for k in (1, 2, 3, 4)]
    rollout = trainer.rollout
    assert isinstance(rollout, EngineRollout) and rollout.streams_finished == streaming
    handed: list[int] = []

    def on_finish(i: int, t: Any) -> None:
        handed.append(i)
        trainer.on_finish(i, t)

    trajs, _ = rollout(prompts, 2, False, on_finish=on_finish)
    engine.returned_at = 1.0
    rewards, _ = trainer.score(trajs)
    assert sorted(handed) == [0, 1, 2, 3]  # each response once, either way
    assert rewards.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert all(name.startswith("reward") for name, _ in calls)  # scored on the worker thread
    if streaming:
        assert calls[0][1]  # the first score ran before generate returned
    trainer.close()


def test_streamed_rewards_equal_batch_scoring_with_the_real_engine(toy_spec) -> None:
    trainer = _toy_trainer(toy_spec)
    prompts = trainer.sampler.next_batch(2)
    trajs, _ = trainer.rollout(prompts, 4, False, on_finish=trainer.on_finish)
    rewards, metrics = trainer.score(trajs)
    texts = [trainer.tokenizer.decode(list(t.response)) for t in trajs]
    expected = score_all(trainer.reward_fns, None, texts, [t.prompt.example.answer for t in trajs])
    assert rewards.tolist() == pytest.approx([total for total, _ in expected])
    assert metrics["timing_s/reward_work"] > 0
    # a rollout called without the callback still scores (the trainer submits what was never handed over)
    trajs2, _ = trainer.rollout(prompts, 4, False)
    rewards2, _ = trainer.score(trajs2)
    assert len(rewards2) == 8
    trainer.close()
