"""`toy-times`: write a letter a given number of times ("Write the letter b 5 times: "), the quick start's task.

The ground truth is the answer itself ("bbbbb"): its first character is the letter, its length the count. The
reward (`toy_times` in the reward registry) scores how close an answer comes, with partial credit everywhere:

    purity x min(hits, count) / max(hits, count)

where hits = how many of the answer's non-blank characters are the letter (either case: "B" is the letter b too) and
purity = hits / non-blank characters. "b b b b b" and "bbbbb" score 1 for count 5; "bbbb" 0.8; "bbbbbbbbbb" 0.5;
"b" 0.2; prose that mentions the letter a few times scores near 0; a blank answer 0.

Why this task for a short demo: its best answer depends on the prompt (letter AND count vary per row), so no single
constant answer is optimal, and a small model counts letters imprecisely, so the responses of a GRPO group keep
scoring differently while the mean reward rises (the task `toy-count` + `toy_many` rewards the same ten letters for
every prompt, and a policy there settles on one short answer within a few steps, leaving groups without a signal).
Rows are generated deterministically; no file is read.
"""

from __future__ import annotations

TIMES_LETTERS = "abc"
TIMES_COUNTS = (3, 4, 5, 6, 7, 8)  # the counts asked for (one letter token rarely covers them: the model must count)
TIMES_ROWS = 96


def toy_times_rows(n: int = TIMES_ROWS) -> list[dict[str, str]]:
    """Rows {"prompt", "answer"}: every (letter, count) pair in turn, the letter changing fastest."""
    rows = []
    for i in range(n):
        letter = TIMES_LETTERS[i % len(TIMES_LETTERS)]
        count = TIMES_COUNTS[(i // len(TIMES_LETTERS)) % len(TIMES_COUNTS)]
        rows.append({"prompt": f"Write the letter {letter} {count} times: ", "answer": letter * count})
    return rows


def toy_times_reward(completion: str, answer: str) -> float:
    """purity x min(hits, count) / max(hits, count) (module docstring); 0 for a blank completion or answer."""
    target = answer.strip()
    chars = [ch for ch in completion if not ch.isspace()]
    if not chars or not target:
        return 0.0
    letter, count = target[0].lower(), len(target)
    hits = sum(ch.lower() == letter for ch in chars)
    if hits == 0:
        return 0.0
    return hits / len(chars) * min(hits, count) / max(hits, count)
