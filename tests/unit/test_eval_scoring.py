"""The boxed-answer math scorer on AIME-style answers: extraction, integers with leading zeros, LaTeX."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.eval import scoring
from miles.eval.scoring import as_integer, boxed_math, boxed_math_or_last_number, last_boxed, load_scorer
from miles.rollout import rewards
from miles.sample import Sample


@pytest.fixture(scope="module", autouse=True)
def _close_math_pool():
    yield
    rewards.MATH_POOL.close()  # the pool math-verify answers went to, stopped before exit


def sample(response: str, answer) -> Sample:
    return Sample(0, 0, [1], response=response, answer=answer)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{204}.", "204"),
        ("first \\boxed{12}, on reflection \\boxed{25}", "25"),  # the last box wins
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),  # nested braces kept whole
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are text
        ("\\fbox{073}", "073"),
        ("hence $\\boxed 7$.", "7"),
        ("\\boxed{113} then \\boxed{11", "113"),  # a box cut off by the length cap is no answer
        ("\\boxed{ 540 }", "540"),
        ("no box at all: 204", None),
        ("\\boxed{", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("answer", "value"),
    [("033", 33), ("$204$", 204), ("\\text{025}", 25), ("\\mathbf{809}", 809), ("7.", 7), ("1\\,000", 1000)]
    + [(116, 116), ("0", 0), ("\\frac{1}{2}", None), ("33^\\circ", None), ("x=3", None), (True, None)],
)
def test_as_integer(answer, value) -> None:
    assert as_integer(answer) == value


# real AIME answer forms: answer keys write 0-999 with three digits (`025`), datasets as int or string
@pytest.mark.parametrize(
    ("response", "gold", "score"),
    [
        ("Thus the remainder is $\\boxed{25}$.", "025", 1.0),
        ("\\boxed{025}", "25", 1.0),
        ("\\boxed{025}", 25, 1.0),
        ("\\boxed{\\text{204}}", "204", 1.0),
        ("\\boxed{0}", "000", 1.0),
        ("\\boxed{999}", 999, 1.0),
        ("Final answer: \\boxed{204.}", 204, 1.0),
        ("\\boxed{240}", "204", 0.0),
        ("\\boxed{204} was wrong, it is \\boxed{205}", "204", 0.0),  # the last box wins
        ("The answer is 204.", "204", 0.0),  # no box: not an answer by default
    ],
)
def test_boxed_math_integer_answers(response: str, gold, score: float) -> None:
    assert boxed_math(sample(response, gold)) == score


def test_last_number_fallback_only_when_chosen() -> None:
    unboxed = sample("Adding up, we get 1,000 - 796 = 204", "204")
    assert boxed_math(unboxed) == 0.0
    assert boxed_math_or_last_number(unboxed) == 1.0
    assert boxed_math_or_last_number(sample("\\boxed{17} ... 204", "204")) == 0.0  # a box still wins
    assert boxed_math_or_last_number(sample("no numbers", "204")) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("response", "gold", "score"),
    [
        ("\\boxed{\\frac{66}{2}}", "033", 1.0),
        ("\\boxed{x = 33}", "33", 1.0),
        ("\\boxed{33^\\circ}", "033", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ],
)
def test_boxed_math_latex_answers_through_math_verify(response: str, gold, score: float) -> None:
    assert boxed_math(sample(response, gold)) == score


def test_load_scorer_builtins_dotted_and_errors() -> None:
    assert load_scorer("boxed_math", "k") is boxed_math
    assert load_scorer("first_number", "k") is rewards.first_number  # the built-in rewards count too
    assert (
        load_scorer("miles.eval.scoring:boxed_math_or_last_number", "k") is scoring.boxed_math_or_last_number
    )
    for bad in ("nope", "miles.nope:fn", "miles.eval.scoring:missing"):
        with pytest.raises(ConfigError, match=r"eval\.datasets\.aime\.scorer"):
            load_scorer(bad, "eval.datasets.aime.scorer")
