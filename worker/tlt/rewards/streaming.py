"""Rewards computed as sequences finish: the rollout hands each finished response to `StreamingScorer.submit`
(from the engine's `on_finish` callback) and a worker thread decodes and scores it while the rest of the batch is
still decoding; `collect` waits for the stragglers and returns every score in index order.

    scorer = StreamingScorer(tokenizer, fns, weights)
    ...  scorer.submit(i, response_ids, answer)      # once per response, in any order, any thread
    texts, scored, busy_s = scorer.collect(n)        # [n] texts, [n] (weighted total, [per-function score]),
                                                     # seconds the worker spent scoring them
    scorer.close()

Why a thread and not inline scoring: the engine calls back at its host-sync points; scoring there would hold the
decode loop for the time of a decode + regex, while a worker thread runs in the time the decode loop spends waiting
on the GPU (torch releases the GIL there). Reward functions are pure functions of (completion, answer), so the order
in which they run changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.rewards.registry import RewardFn, score_all

Scored = tuple[float, list[float]]  # (weighted total, each function's raw score)


class StreamingScorer:
    def __init__(self, tokenizer: TokenizerLike, fns: Sequence[RewardFn], weights: Sequence[float] | None,
                 workers: int = 1) -> None:
        self.tokenizer, self.fns, self.weights = tokenizer, list(fns), weights
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.pending: dict[int, Future[tuple[str, Scored]]] = {}
        self.busy_s = 0.0  # seconds the worker spent scoring (decode + reward functions) since the last collect

    def _score_one(self, response_ids: Sequence[int], answer: str) -> tuple[str, Scored]:
        t0 = time.perf_counter()
        text = self.tokenizer.decode(list(response_ids))
        scored = score_all(self.fns, self.weights, [text], [answer])[0]
        self.busy_s += time.perf_counter() - t0  # one worker thread by default: no race on the sum
        return text, scored

    def submit(self, index: int, response_ids: Sequence[int], answer: str) -> None:
        """Queue response `index` for scoring; each index once per collect()."""
        if index in self.pending:
            raise ValueError(f"response {index} submitted twice")
        self.pending[index] = self.pool.submit(self._score_one, tuple(response_ids), answer)

    def submitted(self, index: int) -> bool:
        return index in self.pending

    def collect(self, n: int) -> tuple[list[str], list[Scored], float]:
        """Texts and scores of responses 0..n-1 (waits for those still running) and the scoring seconds they cost;
        then forgets them."""
        missing = [i for i in range(n) if i not in self.pending]
        if missing:
            raise ValueError(f"responses {missing[:8]} were never submitted")
        results = [self.pending[i].result() for i in range(n)]
        self.pending.clear()
        busy, self.busy_s = self.busy_s, 0.0
        return [t for t, _ in results], [s for _, s in results], busy

    def clear(self) -> None:
        """Forget whatever a rollout that raised left behind (queued scores are cancelled; the one running, if any,
        ends on its own and is ignored)."""
        for f in self.pending.values():
            f.cancel()
        self.pending.clear()
        self.busy_s = 0.0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
