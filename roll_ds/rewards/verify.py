r"""Verification of one sample with math-verify, optionally under a float ``setitimer`` alarm.

The gold answer and the response are parsed with ``math_verify.parse`` and compared with
``math_verify.verify`` (:func:`verify_response`, no timeout). :func:`verify_with_alarm` runs that
under one alarm covering the whole sample, in the calling process's main thread; it is what the
worker processes of :mod:`roll_ds.rewards.verify_pool` run, and what the in-process backends of
:class:`roll_ds.rewards.math_rule.MathRuleReward` call. Why the alarm is set up this way: see the
docstring of :mod:`roll_ds.rewards.math_rule`.

math-verify (sympy) is imported lazily, on first use.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from roll_ds.rewards.base import find_boxed, format_error

logger = logging.getLogger(__name__)

_MAX_EXTRACTED_CHARS = 200
_BARE_MAX_CHARS = 200


class _QuietTimeoutWarning(logging.Filter):
    """Drop math-verify's "Timeout is disabled ..." warning: timeouts are handled here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_filter_installed = False


def _install_log_filter() -> None:
    global _filter_installed
    if not _filter_installed:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_QuietTimeoutWarning())
        _filter_installed = True


_DELIMITED = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox|\\begin")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


def _is_bare_math(text: str) -> bool:
    """A short one-line answer without delimiters and without words (``2\\pi``, ``x+1``)."""
    return (
        0 < len(text) <= _BARE_MAX_CHARS
        and "\n" not in text
        and not _DELIMITED.search(text)
        and not _WORD.search(_LATEX_COMMAND.sub(" ", text))
    )


def _has_expr(parsed: list) -> bool:
    return any(not isinstance(p, str) for p in parsed)


_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _parse_latex_first(text: str) -> list:
    """Parse a delimiter-less answer as LaTeX (``$text$``) first, then as plain text.

    A plain number takes the cheap plain-text path (LaTeX parsing costs ~2 ms, most of the
    verification time for simple answers).
    """
    from math_verify import parse

    if not _PLAIN_NUMBER.fullmatch(text):
        try:
            wrapped = parse(f"${text}$", parsing_timeout=None)
        except Exception:
            wrapped = []
        if _has_expr(wrapped):
            return wrapped
    return parse(text, parsing_timeout=None, raise_on_error=True)


_GOLD_CACHE_SIZE = 4096
_gold_cache: dict[str, list] = {}


def _parse_gold(gold: str) -> list:
    """Parsed gold answer, cached: the samples of a GRPO group share their gold."""
    from math_verify import parse

    gold = gold.strip()
    cached = _gold_cache.get(gold)
    if cached is not None:
        return cached
    if not gold:
        parsed: list = []
    elif _DELIMITED.search(gold):
        parsed = parse(gold, parsing_timeout=None, raise_on_error=True)
    else:
        # Bare gold answers are LaTeX: "2\pi" must not become 2, "x=3" not 3.
        parsed = _parse_latex_first(gold)
    if len(_gold_cache) >= _GOLD_CACHE_SIZE:
        _gold_cache.clear()
    _gold_cache[gold] = parsed
    return parsed


_SIMPLE_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _parse_answer(response: str) -> list:
    from math_verify import parse

    text = response.strip()
    if _is_bare_math(text):
        return _parse_latex_first(text)
    boxes = find_boxed(text)
    if len(boxes) == 1 and boxes[0] is not None and _SIMPLE_NUMBER.fullmatch(boxes[0].strip()):
        # Fast path, same result as math-verify's LaTeX extraction of a lone \boxed{number}.
        return parse(boxes[0].strip(), parsing_timeout=None, raise_on_error=True)
    return parse(response, parsing_timeout=None, raise_on_error=True)


# An integer as math-verify extracts it unchanged: no sign but "-", no leading zeros, and short
# enough that int() never meets Python's digit limit.
_CANONICAL_INTEGER = re.compile(r"-?(?:0|[1-9]\d{0,29})")


def integer_verdict(response: str, golds: list[str]) -> dict[str, Any] | None:
    """The verdict of :func:`verify_with_alarm` without math-verify, where the answer
    :func:`verify_response` would extract (a bare answer, or a lone ``\boxed{}``) and every gold
    answer are canonical integers (``-12``, ``0``, ``407``): equal integers are correct. None for
    anything else. Integer answers are the common case of grade-school maths, and this skips
    sympy and, under the process backend, a round trip to a worker."""
    text = response.strip()
    if _is_bare_math(text):
        answer = text
    else:
        boxes = find_boxed(text)
        if len(boxes) != 1 or boxes[0] is None:
            return None
        answer = boxes[0].strip()
    stripped = [g.strip() for g in golds]
    if not stripped or not all(_CANONICAL_INTEGER.fullmatch(t) for t in [answer, *stripped]):
        return None
    value = int(answer)
    return {
        "correct": any(int(g) == value for g in stripped),
        "error": None,
        "extracted": answer,
        "timed_out": False,
    }


def _extracted_str(parsed: list) -> str | None:
    strs = [p for p in parsed if isinstance(p, str)]
    text = strs[0] if strs else (str(parsed[0]) if parsed else None)
    if text is not None and len(text) > _MAX_EXTRACTED_CHARS:
        text = text[: _MAX_EXTRACTED_CHARS - 3] + "..."
    return text


@dataclass(frozen=True)
class VerifyOptions:
    """Options of ``math_verify.verify``."""

    float_rounding: int = 6
    numeric_precision: int = 15
    strict: bool = True


def verify_response(
    response: str, golds: list[str], opts: VerifyOptions = VerifyOptions()
) -> dict[str, Any]:
    """Judge ``response`` against any of ``golds``; no timeout, exceptions propagate.

    Returns ``{"correct": bool, "error": str | None, "extracted": str | None}``; ``error`` is
    ``"gold_unparsed: ..."`` when no gold answer could be parsed (a data problem).
    """
    from math_verify import verify

    _install_log_filter()
    gold_parsed: list = []
    for g in golds:
        gold_parsed.extend(_parse_gold(g))
    answer = _parse_answer(response)
    result: dict[str, Any] = {"correct": False, "error": None, "extracted": _extracted_str(answer)}
    if not gold_parsed:
        shown = golds[0][:100] if golds else ""
        result["error"] = f"gold_unparsed: {shown!r}"
        return result
    if answer:
        result["correct"] = bool(
            verify(
                gold_parsed,
                answer,
                float_rounding=opts.float_rounding,
                numeric_precision=opts.numeric_precision,
                strict=opts.strict,
                timeout_seconds=None,
            )
        )
    return result


# Verified once before a worker reports ready: the first LaTeX parse builds the ANTLR parser and
# sympy imports modules lazily (~1 s together), which must not count against a sample's timeout.
_WARMUP_CASES = (
    (r"\frac{1}{2}", ["0.5"]),
    (r"The answer is \boxed{x^2+\sqrt{3}}", [r"\sqrt{3}+x^2"]),
    (r"$\{1,2\}$ or $(1, 2]$", ["(1,2)"]),
    (r"$x = \frac{\pi}{4}$, $2^{10}$", [r"x=45^\circ"]),
)


def warm_up_verifier() -> None:
    """Import math-verify and exercise its slow first-use paths (never raises)."""
    _install_log_filter()
    for response, golds in _WARMUP_CASES:
        try:
            verify_response(response, golds)
        except Exception:
            logger.debug("math_rule warm-up case failed", exc_info=True)


class _SoftTimeout(BaseException):
    """Raised by the alarm handler. A BaseException, so math-verify's and sympy's
    ``except Exception`` handlers let it through."""


def _raise_soft_timeout(signum: int, frame: Any) -> None:
    raise _SoftTimeout()


def can_use_signals() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


def verify_with_alarm(
    response: str, golds: list[str], opts: VerifyOptions, timeout_s: float | None
) -> dict[str, Any]:
    """:func:`verify_response` under a ``setitimer`` alarm (main thread only), never raises.

    Returns the result dict plus ``timed_out``; exceptions become ``error``.
    """
    use_alarm = timeout_s is not None and timeout_s > 0
    if use_alarm and not can_use_signals():
        raise RuntimeError("verify_with_alarm needs the main thread")
    old_handler: Any = None
    old_timer = (0.0, 0.0)
    started = time.monotonic()
    try:
        if use_alarm:
            old_handler = signal.signal(signal.SIGALRM, _raise_soft_timeout)
            old_timer = signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
        try:
            result = verify_response(response, golds, opts)
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        result["timed_out"] = False
        return result
    except _SoftTimeout:
        return {"correct": False, "timed_out": True, "error": None, "extracted": None}
    except Exception as e:
        return {"correct": False, "timed_out": False, "error": format_error(e), "extracted": None}
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_timer[0] > 0:  # re-arm an alarm someone else had set
                remaining = max(old_timer[0] - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, remaining, old_timer[1])
