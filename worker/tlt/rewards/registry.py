"""The reward registry: job specs name reward functions (`algorithm.reward_funcs`); the worker resolves the names
here. Only code installed on the worker runs: the built-ins below, plus functions other installed packages declare
under the `tlt.rewards` entry-point group (pyproject's `[project.entry-points."tlt.rewards"]`). No user code.

A reward function is `fn(completion: str, answer: str) -> float` (completion = decoded response, answer = the
dataset's ground truth).

    fns = resolve(["math_accuracy", "format"])
    score_all(fns, [1.0, 0.1], completions, answers)   # weighted sum per completion
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from worker.tlt.data.toy import toy_count_reward, toy_many_reward
from worker.tlt.data.toy_times import toy_times_reward
from worker.tlt.rewards.math import math_accuracy
from worker.tlt.rewards.shaping import brevity_reward, format_reward

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math_accuracy": math_accuracy,  # GSM8K ####, \boxed{}, last number; exact rational comparison
    "format": format_reward,  # final answer marked with #### or \boxed{}
    "brevity": brevity_reward,  # shorter non-empty responses score higher (0 from 160 characters on)
    "toy_count": toy_count_reward,  # the toy-count task: fraction of the target letter
    "toy_many": toy_many_reward,  # the toy-count task: the target letter, many times (>= 10)
    "toy_times": toy_times_reward,  # the toy-times task: the target letter, the asked number of times (partial credit)
}

ENTRY_POINT_GROUP = "tlt.rewards"


def available() -> dict[str, RewardFn]:
    """Every reward function the worker can run: built-ins, then installed entry points (which may add names; an
    entry point that reuses a built-in name must point at the same function)."""
    table = dict(BUILTIN_REWARDS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        fn = ep.load()
        if ep.name in table and table[ep.name] is not fn:
            raise ValueError(f"reward entry point {ep.name!r} ({ep.value}) shadows a built-in with another function")
        table[ep.name] = fn
    return table


def resolve(names: Sequence[str]) -> list[RewardFn]:
    table = available()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"unknown reward function(s) {unknown}; installed: {sorted(table)}")
    return [table[n] for n in names]


def score_all(
    fns: Sequence[RewardFn], weights: Sequence[float] | None, completions: Sequence[str], answers: Sequence[str]
) -> list[tuple[float, list[float]]]:
    """Per completion: (weighted total, [each function's raw score])."""
    w = list(weights) if weights is not None else [1.0] * len(fns)
    out = []
    for text, answer in zip(completions, answers, strict=True):
        parts = [float(fn(text, answer)) for fn in fns]
        out.append((sum(wi * p for wi, p in zip(w, parts, strict=True)), parts))
    return out
