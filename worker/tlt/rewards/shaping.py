"""Reward shaping that is not about correctness: the format reward, the brevity reward and DAPO's soft overlong
penalty.

    format_reward("... #### 42", "")                       # 1.0: final answer marked with #### or \\boxed{}
    brevity_reward("bbbb", "")                             # 1 - 4 / 160 = 0.975: shorter is better, empty is 0
    overlong_penalty(num_tokens=1000, max_tokens=1024, buffer=64)   # -(1000 - 960) / 64 = -0.625

The overlong penalty (DAPO, Yu et al. 2025, eq. 13) is 0 up to `max_tokens - buffer` tokens, falls linearly to -1 at
`max_tokens`, and is -1 beyond; the trainer adds it to the summed reward when `algorithm.overlong_buffer > 0`.
"""

from __future__ import annotations

from worker.tlt.rewards.math import strict_final_line


def format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion marks its final answer (`#### <number>` or `\\boxed{<number>}`), else 0.0."""
    del answer  # the format does not depend on the ground truth
    return 1.0 if strict_final_line(completion) else 0.0


BREVITY_CHARS = 160  # a response this long (about 40 tokens of English) or longer gets no brevity reward


def brevity_reward(completion: str, answer: str) -> float:
    """1 - characters / BREVITY_CHARS, floored at 0; 0.0 for an empty or blank completion (saying nothing is not a
    short answer). A signal a small model learns in a few GRPO steps: where to stop (the demo preset pairs it with
    the task's own reward)."""
    del answer  # length does not depend on the ground truth
    text = completion.strip()
    if not text:
        return 0.0
    return max(0.0, 1.0 - len(text) / BREVITY_CHARS)


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO soft overlong punishment of a response of `num_tokens` tokens; 0 when buffer is 0."""
    if buffer <= 0:
        return 0.0
    free = max_tokens - buffer
    if num_tokens <= free:
        return 0.0
    if num_tokens <= max_tokens:
        return (free - num_tokens) / buffer
    return -1.0
