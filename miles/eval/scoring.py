"""Evaluation scorers: one finished Sample in, a score out (1.0 correct, 0.0 not).

A scorer has the signature of a reward function (miles/rollout/rewards.py) and is named in the recipe
by `eval.datasets.<name>.scorer` as `module:function` or a built-in name (SCORERS below, then the
built-in rewards). Built-ins of this module:

- `boxed_math`: the model's answer is the content of the LAST `\\boxed{...}` of the response (braces
  matched, so `\\boxed{\\frac{1}{2}}` is whole; `\\fbox{...}` and `\\boxed 5` count too; a box cut off
  by the length cap is not an answer, the one before it is). No box: score 0. The answer is compared
  with the reference answer:
    * both integers (AIME answers are 0-999, and answer keys write them with leading zeros, `033`),
      once `$`, `\\text{}`/`\\mathrm{}`, spaces and a final period are stripped: compared as integers;
    * anything else (fractions, radicals, `x = 33`, `33^\\circ`, intervals): math-verify's symbolic
      equality, run in the math-verify process pool of miles.rollout.rewards with a timeout, because
      math-verify's own timeouts use SIGALRM, which works only on a process's main thread; a timeout
      or a checker crash scores 0.
- `boxed_math_or_last_number`: the same, except that a response without a box falls back to the last
  number written in it (for models that do not box; off by default, since the last number of a
  response is often not its answer).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from miles.config.plugins import load_function
from miles.rollout import rewards
from miles.sample import Sample

Scorer = Callable[[Sample], float]

_BOX = re.compile(r"\\(?:boxed|fbox)\b\s*")
_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|mbox)\{(.*)\}$", re.S)
_INTEGER = re.compile(r"^[+-]?\d+$")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _braced(text: str, start: int) -> str | None:
    """The text inside the brace group opening at text[start] ('{'), or None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`) in text, stripped."""
    for match in reversed(list(_BOX.finditer(text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            inner = _braced(text, end)
            if inner is not None:
                return inner.strip()
        elif end < len(text) and match.group(0)[-1:].isspace():
            token = re.match(r"[^\s$]+", text[end:])
            if token:
                return token.group(0).rstrip(".")
    return None


def last_number(text: str) -> str | None:
    """The last number written in text (thousands separators removed), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def as_integer(answer: object) -> int | None:
    """The integer an answer writes (`033`, `$33$`, `\\text{33}`, `33.`), or None if it is not one."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    text = str(answer).strip().strip("$").strip()
    while (m := _WRAPPER.match(text)) is not None:
        text = m.group(1).strip()
    text = re.sub(r"\\[,;!: ]|\s", "", text).rstrip(".")
    return int(text) if _INTEGER.match(text) else None


def math_equal(gold: object, answer: str) -> bool:
    """True when `answer` (LaTeX, no `$` needed) equals the reference `gold` (integer fast path, else math-verify)."""
    gold_int, answer_int = as_integer(gold), as_integer(answer)
    if gold_int is not None and answer_int is not None:
        return gold_int == answer_int
    gold_text = str(gold).strip()
    gold_text = gold_text if "$" in gold_text else f"${gold_text}$"
    answer_text = answer if "$" in answer else f"${answer}$"
    return rewards.MATH_POOL.verify(gold_text, answer_text)


def boxed_math(sample: Sample) -> float:
    """1.0 when the last boxed answer of the response equals the reference answer, else 0.0."""
    answer = last_boxed(sample.response)
    return float(answer is not None and math_equal(sample.answer, answer))


def boxed_math_or_last_number(sample: Sample) -> float:
    """As `boxed_math`, but a response without a box is judged by its last number."""
    answer = last_boxed(sample.response)
    if answer is None:
        answer = last_number(sample.response)
    return float(answer is not None and math_equal(sample.answer, answer))


SCORERS: dict[str, Scorer] = {
    "boxed_math": boxed_math,
    "boxed_math_or_last_number": boxed_math_or_last_number,
}


def load_scorer(spec: str, key: str) -> Scorer:
    """`module:function` or a built-in name (SCORERS, then the built-in rewards) -> the function;
    errors name the config `key` the spec came from."""
    return load_function(spec, key, {**rewards.BUILTIN_REWARDS, **SCORERS})
