"""The resumable prompt sampler: walks the training rows in a seeded random order, epoch after epoch.

Its whole state is (epoch, position): the order of epoch e is `randperm(n)` under seed `seed + e`, so a checkpoint
stores two integers and a resumed run draws exactly the prompts the uninterrupted run would have drawn.

    sampler = PromptSampler(train_rows, seed=spec.seed)
    batch = sampler.next_batch(spec.algorithm.prompts_per_step)
    state = sampler.state_dict(); sampler.load_state_dict(state)
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class PromptSampler(Generic[T]):
    def __init__(self, rows: list[T], seed: int) -> None:
        if not rows:
            raise ValueError("no training rows")
        self.rows = rows
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next_batch(self, k: int) -> list[T]:
        """The next k rows; crosses into the next epoch (new order) when this one runs out."""
        out = []
        for _ in range(k):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._order_of(self.epoch)
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._order_of(self.epoch)
