r"""``format``: does the response have the expected shape? ``correct_score`` if so, else
``incorrect_score`` (the combiner's ``weight`` scales it further).

Configured by a named ``preset`` or by a ``pattern`` regex:

* ``bare_number`` - only a number (``47``, ``-3``, ``0.5``, ``3/4``): the tiny task's answers;
* ``bare_answer`` - one token, no whitespace inside (``47``, ``olleh``, ``\frac{1}{2}``);
* ``boxed`` - exactly one ``\boxed{...}`` with non-empty, brace-balanced content (Qwen style);
* ``think_boxed`` - one ``<think>...</think>`` block first, then exactly one ``\boxed{...}``.

With ``pattern``, ``match="fullmatch"`` (default) or ``"search"`` decides how the regex is
applied; ``flags`` is a list of ``re`` flag names (``["DOTALL", "IGNORECASE"]``). The response is
stripped first unless ``strip=False``; ``max_chars`` optionally rejects over-long responses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from roll_ds.rewards.base import GroundTruth, RewardFn, find_boxed

_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?")
_BARE_ANSWER = re.compile(r"\S+")
_THINK = re.compile(r"<think>(.*?)</think>(.*)", re.DOTALL)


def _exactly_one_box(text: str) -> bool:
    boxes = find_boxed(text)
    return len(boxes) == 1 and boxes[0] is not None and boxes[0].strip() != ""


def _think_then_box(text: str) -> bool:
    m = _THINK.fullmatch(text)
    if m is None or "<think>" in m.group(1) or "</think>" in m.group(2):
        return False
    return _exactly_one_box(m.group(2))


PRESETS: dict[str, Callable[[str], bool]] = {
    "bare_number": lambda t: _NUMBER.fullmatch(t) is not None,
    "bare_answer": lambda t: _BARE_ANSWER.fullmatch(t) is not None,
    "boxed": _exactly_one_box,
    "think_boxed": _think_then_box,
}


class FormatReward(RewardFn):
    """``correct_score`` when the response matches the preset / pattern, else ``incorrect_score``.

    Info per sample: ``format_ok``, ``timed_out`` (always False), ``error``.
    """

    name = "format"
    failure_info = {"format_ok": False}  # noqa: RUF012

    def __init__(
        self,
        preset: str | None = None,
        pattern: str | None = None,
        match: str = "fullmatch",
        flags: Sequence[str] = (),
        strip: bool = True,
        max_chars: int | None = None,
        correct_score: float = 1.0,
        incorrect_score: float = 0.0,
    ) -> None:
        super().__init__(correct_score, incorrect_score)
        if (preset is None) == (pattern is None):
            raise ValueError(
                "format reward: give exactly one of preset= or pattern= "
                f"(presets: {', '.join(sorted(PRESETS))})"
            )
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(
                    f"unknown format preset {preset!r}; valid: {', '.join(sorted(PRESETS))}"
                )
            self.check = PRESETS[preset]
        else:
            if match not in ("fullmatch", "search"):
                raise ValueError(
                    f"format reward: match must be 'fullmatch' or 'search', got {match!r}"
                )
            re_flags = 0
            for name in flags:
                flag = getattr(re, str(name).upper(), None)
                if not isinstance(flag, re.RegexFlag):
                    raise ValueError(f"format reward: unknown regex flag {name!r}")
                re_flags |= flag
            regex = re.compile(pattern, re_flags)
            method = regex.fullmatch if match == "fullmatch" else regex.search
            self.check = lambda t: method(t) is not None
        self.preset = preset
        self.pattern = pattern
        self.strip = strip
        self.max_chars = max_chars

    def score_one(
        self, response: str, ground_truth: GroundTruth, prompt: str
    ) -> tuple[float, dict]:
        text = "" if response is None else str(response)
        if self.strip:
            text = text.strip()
        ok = (self.max_chars is None or len(text) <= self.max_chars) and bool(self.check(text))
        return (self.correct_score if ok else self.incorrect_score), {"format_ok": ok}
