"""Answer extraction and grading shared by every numeric task.

The reward runs on arbitrary model output, thousands of times per run, possibly inside a
rollout thread. So it must never raise and never hang: we first cut the candidate answer
out with a bounded regex (a short numeric string), and only that string goes to
math-verify. With bounded inputs math-verify's own timeout is unnecessary, and disabling it
matters: it is implemented with `signal.alarm`, which raises outside the main thread and
would clobber any SIGALRM the caller uses.
"""

from __future__ import annotations

import functools
import logging
import re

from a3po.tasks.base import RewardResult

ANSWER_MARKER = "####"
# An optional sign written against the number (ASCII or Unicode minus: "- 5" is a bullet or a
# subtraction, not -5), optional currency, then digits with thousands separators of exactly three
# digits ("1,2345" is 1 and 2345, never 1234), then an optional decimal part or a fraction
# denominator; or a bare decimal part (".5"). Lengths are capped so a pathological digit run
# cannot make sympy slow.
NUMBER_PATTERN = re.compile(
    r"(?<![\w.])[-\u2212]?(?:\$\s?)?"
    r"(?:\d{1,24}(?:,\d{3}(?!\d)){0,8}(?:\.\d{1,12}|/\d{1,12})?|\.\d{1,12})"
)


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns once that its timeout is off; here that is deliberate (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _logger_name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger_name).addFilter(_DropTimeoutDisabledNotice())


def extract_answer(completion: str) -> str | None:
    """The number after the last `####`, else the last number anywhere, else None."""
    marker_at = completion.rfind(ANSWER_MARKER)
    if marker_at >= 0:
        after_marker = NUMBER_PATTERN.search(completion, marker_at + len(ANSWER_MARKER))
        if after_marker is not None:
            return _clean_number(after_marker.group())
    last_number = None
    for last_number in NUMBER_PATTERN.finditer(completion):
        pass
    return _clean_number(last_number.group()) if last_number is not None else None


def _clean_number(text: str) -> str:
    return text.replace("\u2212", "-").replace("$", "").replace(" ", "").replace(",", "")


@functools.lru_cache(maxsize=65536)
def _parse(expression: str):
    from math_verify import parse

    return parse(expression, parsing_timeout=None)


def answers_match(predicted: str, gold: str) -> bool:
    from math_verify import verify

    try:
        gold_parsed = _parse(gold)
        predicted_parsed = _parse(predicted)
        if not gold_parsed or not predicted_parsed:
            return False
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=None))
    except Exception:  # a grading failure is a wrong answer, never a crashed run
        return False


def numeric_reward(completion: str, answer: str) -> RewardResult:
    try:
        predicted = extract_answer(completion)
    except Exception:
        predicted = None
    if predicted is None:
        return RewardResult(score=0.0, malformed=True)
    return RewardResult(score=1.0 if answers_match(predicted, answer) else 0.0, malformed=False)
