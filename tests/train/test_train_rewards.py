"""Reward functions: math answer extraction and normalisation, format and brevity rewards, overlong penalty, the
registry.

Run: python -m pytest tests/train/test_train_rewards.py -q
"""

import tomllib
from fractions import Fraction
from pathlib import Path

import pytest

from worker.tlt.data.toy import toy_count_reward
from worker.tlt.rewards.math import extract_answer, last_boxed, math_accuracy
from worker.tlt.rewards.registry import BUILTIN_REWARDS, resolve, score_all
from worker.tlt.rewards.shaping import BREVITY_CHARS, brevity_reward, format_reward, overlong_penalty

GSM_TRUTH = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    "text, value",
    [
        ("so the answer is\n#### 72", Fraction(72)),
        ("#### $1,200.50 dollars", Fraction("1200.50")),
        ("The total is \\boxed{\\frac{3}{4}}.", Fraction(3, 4)),
        ("\\boxed{\\dfrac{10}{4}}", Fraction(5, 2)),
        ("\\boxed{18\\text{ dollars}}", Fraction(18)),  # \text{} units dropped
        ("\\boxed{\\text{none}} but 18 before", Fraction(18)),  # no number in the box: last number
        ("first 3 apples then 5 apples, 8 in total.", Fraction(8)),  # last number
        ("She pays 50% of $2,000,000", Fraction(2_000_000)),
        ("#### -7", Fraction(-7)),
        ("#### 0.5", Fraction(1, 2)),
        ("#### 1/2", Fraction(1, 2)),
        ("no numbers here", None),
    ],
)
def test_extract_answer(text: str, value: Fraction | None) -> None:
    assert extract_answer(text) == value


def test_boxed_nested_braces() -> None:
    assert last_boxed("x \\boxed{a} y \\boxed{\\frac{1}{2}} z") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None


def test_math_accuracy_against_gsm8k_truth() -> None:
    assert math_accuracy("48 + 24 = 72 clips.\n#### 72", GSM_TRUTH) == 1.0
    assert math_accuracy("The answer is \\boxed{72}", GSM_TRUTH) == 1.0
    assert math_accuracy("She sold 72.00 clips", GSM_TRUTH) == 1.0  # last number, trailing zeros
    assert math_accuracy("#### 71", GSM_TRUTH) == 0.0
    assert math_accuracy("#### 72 ... wait, 73", GSM_TRUTH) == 1.0  # first number after the last ####
    assert math_accuracy("", GSM_TRUTH) == 0.0
    assert math_accuracy("1,000", "#### 1000") == 1.0
    assert math_accuracy("#### 1000", "no answer in truth") == 0.0


def test_format_reward() -> None:
    assert format_reward("blah\n#### 12", "") == 1.0
    assert format_reward("\\boxed{12}", "") == 1.0
    assert format_reward("the answer is 12", "") == 0.0
    assert format_reward("#### twelve", "") == 0.0


def test_brevity_reward_falls_with_length_and_scores_nothing_as_zero() -> None:
    assert brevity_reward("b", "b") == pytest.approx(1 - 1 / BREVITY_CHARS)
    assert brevity_reward("  bbbb \n", "b") == pytest.approx(1 - 4 / BREVITY_CHARS)  # surrounding blanks not counted
    assert brevity_reward("x" * (BREVITY_CHARS // 2), "") == pytest.approx(0.5)
    assert brevity_reward("x" * BREVITY_CHARS, "") == 0.0
    assert brevity_reward("x" * (3 * BREVITY_CHARS), "") == 0.0  # floored, never negative
    assert brevity_reward("", "b") == 0.0 and brevity_reward(" \n", "b") == 0.0  # an empty answer is not a short one
    assert brevity_reward("ab", "x") == brevity_reward("ab", "y")  # the ground truth plays no part


def test_overlong_penalty_dapo_shape() -> None:
    assert overlong_penalty(900, 1024, 64) == 0.0
    assert overlong_penalty(960, 1024, 64) == 0.0
    assert overlong_penalty(1000, 1024, 64) == pytest.approx(-40 / 64)
    assert overlong_penalty(1024, 1024, 64) == pytest.approx(-1.0)
    assert overlong_penalty(2000, 1024, 64) == -1.0
    assert overlong_penalty(2000, 1024, 0) == 0.0


def test_toy_count_reward() -> None:
    assert toy_count_reward("aaaa", "a") == 1.0
    assert toy_count_reward("abab", "a") == 0.75  # all letters (0.5) + half of them the target (0.25)
    assert toy_count_reward("a1#Z", "a") == 0.25
    assert toy_count_reward("", "a") == 0.0


def test_registry_resolves_and_weights() -> None:
    fns = resolve(["math_accuracy", "format"])
    scored = score_all(fns, [1.0, 0.5], ["#### 72", "72"], [GSM_TRUTH, GSM_TRUTH])
    assert scored == [(1.5, [1.0, 1.0]), (1.0, [1.0, 0.0])]
    with pytest.raises(KeyError, match="unknown reward"):
        resolve(["no_such_reward"])


def test_pyproject_entry_points_name_the_builtins() -> None:
    root = Path(__file__).resolve().parents[2]
    table = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["tlt.rewards"]
    for name, target in table.items():
        module, attr = target.split(":")
        fn = getattr(__import__(module, fromlist=[attr]), attr)
        assert BUILTIN_REWARDS[name] is fn
    assert set(table) == set(BUILTIN_REWARDS)


def test_toy_many_pays_for_many_target_letters_not_for_one() -> None:
    from worker.tlt.data.toy import TOY_MANY, toy_many_reward

    one, many = toy_many_reward("b", "b"), toy_many_reward("b" * TOY_MANY, "b")
    assert one == pytest.approx(1 / TOY_MANY) and many == pytest.approx(1.0)
    assert toy_many_reward("b " * TOY_MANY, "b") == pytest.approx(1.0)  # blanks between the letters are free
    assert toy_many_reward("B" * TOY_MANY, "b") == pytest.approx(1.0)  # either case
    assert toy_many_reward("b" * (2 * TOY_MANY), "b") == pytest.approx(1.0)  # more than many: no penalty here
    assert toy_many_reward("bbbbbaaaaa", "b") == pytest.approx(0.5 * 5 / TOY_MANY)  # wrong letters dilute it
    assert toy_many_reward("  \n", "b") == 0.0 and toy_many_reward("", "b") == 0.0


def test_toy_times_scores_closeness_to_the_asked_count() -> None:
    from worker.tlt.data.toy_times import toy_times_reward

    assert toy_times_reward("bbbbb", "bbbbb") == 1.0 and toy_times_reward("b b b b b", "bbbbb") == 1.0
    assert toy_times_reward("B B B B B", "bbbbb") == 1.0  # either case
    assert toy_times_reward("bbbb", "bbbbb") == pytest.approx(0.8)  # one short
    assert toy_times_reward("b" * 10, "bbbbb") == pytest.approx(0.5)  # twice too many
    assert toy_times_reward("b", "bbbbb") == pytest.approx(0.2)  # a lone letter: no constant answer fits every count
    assert toy_times_reward("b", "bbb") > toy_times_reward("b", "bbbbbbb")  # ... the best answer depends on the prompt
    assert toy_times_reward("bbbbb.", "bbbbb") == pytest.approx(5 / 6)  # other characters dilute it
    assert toy_times_reward("aaaaa", "bbbbb") == 0.0  # the wrong letter
    assert toy_times_reward(" \n", "bbbbb") == 0.0 and toy_times_reward("", "bbbbb") == 0.0
