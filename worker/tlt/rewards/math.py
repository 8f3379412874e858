"""Math answer verification (GSM8K and friends): extract the final answer of a response, normalise it to an exact
rational number, compare with the ground truth.

Extraction order (first that applies): the text after the last `####` (GSM8K's convention); the last `\\boxed{...}`
(balanced braces, `\\fbox` too); the last number anywhere. Normalisation drops `$`, `\\$`, thousands commas, `%`,
trailing units and words ("18 dollars", "5 cm^2"), LaTeX `\\text{..}` and `\\!`, turns `\\frac{a}{b}` / `\\dfrac` and
`a/b` into fractions, and compares as `fractions.Fraction`, so "0.50" == "1/2" == "\\frac{1}{2}" and "1,200" == "1200".

    math_accuracy("... so she has 18 dollars.\\n#### 18", "blah\\n#### 18")  # -> 1.0
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (nested braces allowed), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def clean(text: str) -> str:
    """Strip the decorations around a number: LaTeX text/units, money signs, thousands separators, percent."""
    s = _FRAC.sub(r"(\1)/(\2)", text)
    s = _TEXT.sub(" ", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _THOUSANDS.sub("", s)
    s = s.replace("(", "").replace(")", "")
    return s


def to_number(text: str, last: bool = False) -> Fraction | None:
    """The first (or last) number in `text` after `clean`, as an exact Fraction; None if there is none."""
    found = _NUMBER.findall(clean(text))
    if not found:
        return None
    token = (found[-1] if last else found[0]).replace(" ", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> Fraction | None:
    """The response's final answer as a number, by the extraction order of the module docstring."""
    if "####" in text:
        value = to_number(text.rsplit("####", 1)[1])
        if value is not None:
            return value
    boxed = last_boxed(text)
    if boxed is not None:
        value = to_number(boxed)
        if value is not None:
            return value
    return to_number(text, last=True)


def math_accuracy(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the ground truth's (both extracted the same way), else 0.0."""
    truth = extract_answer(answer)
    got = extract_answer(completion)
    return 1.0 if truth is not None and got is not None and got == truth else 0.0


def strict_final_line(completion: str) -> bool:
    """True when the response states its answer in the expected form: `#### <number>` or `\\boxed{<number>}`."""
    if "####" in completion and to_number(completion.rsplit("####", 1)[1]) is not None:
        return True
    boxed = last_boxed(completion)
    return boxed is not None and to_number(boxed) is not None
