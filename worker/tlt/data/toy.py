"""`toy-count`: a synthetic task small enough that a tiny random byte-level model learns it in a few dozen GRPO
steps on CPU. Used by the learning test and by the control plane's fast job tests.

Each prompt asks for one letter written many times ("Write the letter b many times: "); the ground truth is the
letter. Its reward (`toy_count` in the reward registry) counts characters: half of it is the fraction of response
characters that are lowercase ASCII letters, half the fraction equal to the target letter. A random byte-level model
(vocab 320) emits a letter for about 1 token in 12, so nearly every GRPO group has reward variance from the first
step (a signal), and the reward climbs from about 0.04 towards 1 as the policy learns letters, then the right one.
Rows are generated deterministically; no file is read.

`toy_many` (the demo's task reward) asks for what the prompt says, the letter *many* times: the share of the
answer's non-blank characters that are the target letter, times the run's length up to TOY_MANY letters. A lone
letter scores 1 / TOY_MANY, so a policy that shortens its answers (the demo pairs it with `brevity`) is not paid for
collapsing to one letter, and the responses of a group keep differing in how many letters they write.
"""

from __future__ import annotations

TOY_LETTERS = "abc"  # the target letters (few, so that even an unconditioned policy gains reward quickly)
TOY_MANY = 10  # letters `toy_many` counts as "many": fewer score proportionally less
TOY_ROWS = 96  # rows generated (the last `validation_size` rows become the validation split)


def toy_count_rows(n: int = TOY_ROWS) -> list[dict[str, str]]:
    """Rows {"prompt", "answer"} cycling through TOY_LETTERS."""
    return [
        {"prompt": f"Write the letter {c} many times: ", "answer": c}
        for c in (TOY_LETTERS[i % len(TOY_LETTERS)] for i in range(n))
    ]


def toy_count_reward(completion: str, answer: str) -> float:
    """0.5 x fraction of lowercase ASCII letters + 0.5 x fraction of the target letter (0 for an empty completion)."""
    target = answer.strip()[:1]
    if not completion or not target:
        return 0.0
    letters = sum("a" <= ch <= "z" for ch in completion)
    hits = sum(ch == target for ch in completion)
    return 0.5 * letters / len(completion) + 0.5 * hits / len(completion)


def toy_many_reward(completion: str, answer: str) -> float:
    """(target letters / non-blank characters) x min(1, target letters / TOY_MANY), either case; 0 for a blank
    completion."""
    target = answer.strip()[:1].lower()
    chars = [ch for ch in completion if not ch.isspace()]
    if not chars or not target:
        return 0.0
    hits = sum(ch.lower() == target for ch in chars)  # "B" is the letter b too (SmolLM2 often capitalises it)
    return hits / len(chars) * min(1.0, hits / TOY_MANY)
