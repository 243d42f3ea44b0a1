r"""``exact_match``: normalized string equality with the ground truth (e.g. string reversal).

Normalization: ``strip()``; runs of whitespace collapsed to one space (``collapse_whitespace``);
case folded unless ``case_sensitive``; optional ``strip_chars`` (e.g. ``".\"'"``) removed from
both ends. ``extract="auto"`` (default) compares the content of the last ``\boxed{...}`` when the
response has one, else the whole response; ``"none"`` always uses the whole response;
``"boxed"`` requires a box (no box -> incorrect). A list ground truth matches any element; an
empty answer never matches.
"""

from __future__ import annotations

import re

from roll_ds.rewards.base import GroundTruth, RewardFn, ground_truth_list, last_boxed

_WS = re.compile(r"\s+")
EXTRACT_MODES = ("auto", "none", "boxed")


class ExactMatchReward(RewardFn):
    """``correct_score`` if the normalized answer equals a normalized ground truth.

    Info per sample: ``correct``, ``timed_out`` (always False), ``error``, ``extracted``.
    """

    name = "exact_match"
    failure_info = {"correct": False, "extracted": None}  # noqa: RUF012

    def __init__(
        self,
        case_sensitive: bool = True,
        collapse_whitespace: bool = True,
        strip_chars: str | None = None,
        extract: str = "auto",
        correct_score: float = 1.0,
        incorrect_score: float = 0.0,
    ) -> None:
        super().__init__(correct_score, incorrect_score)
        if extract not in EXTRACT_MODES:
            raise ValueError(
                f"exact_match: unknown extract {extract!r}; valid: {', '.join(EXTRACT_MODES)}"
            )
        self.case_sensitive = case_sensitive
        self.collapse_whitespace = collapse_whitespace
        self.strip_chars = strip_chars
        self.extract = extract

    def normalize(self, text: str) -> str:
        text = text.strip()
        if self.collapse_whitespace:
            text = _WS.sub(" ", text)
        if self.strip_chars:
            text = text.strip(self.strip_chars).strip()
        if not self.case_sensitive:
            text = text.casefold()
        return text

    def answer_of(self, response: str) -> str | None:
        if self.extract == "none":
            return response
        boxed = last_boxed(response)
        if boxed is not None or self.extract == "boxed":
            return boxed
        return response

    def score_one(
        self, response: str, ground_truth: GroundTruth, prompt: str
    ) -> tuple[float, dict]:
        answer = self.answer_of("" if response is None else str(response))
        golds = {self.normalize(g) for g in ground_truth_list(ground_truth)}
        extracted = None if answer is None else self.normalize(answer)
        correct = bool(extracted) and extracted in golds
        info = {"correct": correct, "extracted": extracted}
        return (self.correct_score if correct else self.incorrect_score), info
