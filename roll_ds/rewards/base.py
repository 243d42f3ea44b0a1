"""The reward-function interface shared by every rule-based reward.

A reward function scores a batch of samples, each ``(response, ground_truth, prompt)``, and
returns one float score and one ``info`` dict per sample. Scoring never raises for a bad sample:
an exception or a timeout gives that sample the function's ``incorrect_score`` and is recorded in
its info (``error`` / ``timed_out``), so a single pathological response cannot take down a reward
worker. Programming errors of the caller (wrong argument types, mismatched lengths) still raise.

Info keys with a fixed meaning (aggregated by :class:`roll_ds.rewards.scorer.RewardScorer`):

* ``timed_out`` (bool): scoring this sample was cut off by a timeout.
* ``error`` (str | None): ``"ExcType: message"`` of a failure, else None.
* ``correct`` (bool): the answer was judged correct (correctness rewards only).
* ``format_ok`` (bool): the response has the required format (format rewards only).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

GroundTruth = Any  # usually a str; a list/tuple means "any of these answers"


class RewardSample(NamedTuple):
    """One sample to score; plain ``(response, ground_truth, prompt)`` tuples work too."""

    response: str
    ground_truth: GroundTruth
    prompt: str = ""


@dataclass
class RewardOutput:
    """Per-sample scores and info dicts, index-aligned with the input samples."""

    scores: list[float]
    infos: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.infos:
            self.infos = [{} for _ in self.scores]
        if len(self.infos) != len(self.scores):
            raise ValueError(f"{len(self.scores)} scores but {len(self.infos)} infos")


def format_error(exc: BaseException, limit: int = 300) -> str:
    """``"ExcType: message"``, cut to ``limit`` characters (str() of some errors is huge)."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # str() itself can fail on odd exception payloads
        text = type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_samples(samples: Iterable[Sequence[Any]]) -> list[RewardSample]:
    """Normalize ``(response, ground_truth[, prompt])`` tuples into :class:`RewardSample`."""
    out = []
    for i, s in enumerate(samples):
        if isinstance(s, RewardSample):
            out.append(s)
            continue
        if isinstance(s, dict):
            out.append(RewardSample(s["response"], s.get("ground_truth"), s.get("prompt", "")))
            continue
        if not isinstance(s, (tuple, list)) or not 2 <= len(s) <= 3:
            raise TypeError(
                f"sample {i}: expected (response, ground_truth[, prompt]), got {type(s).__name__}"
            )
        out.append(RewardSample(*s))
    return out


def ground_truth_list(ground_truth: GroundTruth) -> list[str]:
    """Ground truth as a list of candidate answer strings (``None`` -> ``[]``)."""
    if ground_truth is None:
        return []
    if isinstance(ground_truth, (list, tuple)):
        return [str(g) for g in ground_truth if g is not None]
    return [str(ground_truth)]


class RewardFn:
    """Base class: subclasses implement :meth:`score_one` or override :meth:`score_batch`.

    ``correct_score`` / ``incorrect_score`` are the values for a pass / a fail (including errors
    and timeouts). Call the instance (``fn(samples)``) to score: that entry point validates the
    output and turns an exception escaping ``score_batch`` into per-sample errors.
    """

    #: registry name, set by subclasses
    name: str = "reward"
    #: info entries of a failed sample besides timed_out/error (e.g. {"correct": False})
    failure_info: dict[str, Any] = {}  # noqa: RUF012  (read-only class default)

    def __init__(self, correct_score: float = 1.0, incorrect_score: float = 0.0) -> None:
        self.correct_score = float(correct_score)
        self.incorrect_score = float(incorrect_score)

    # -- to implement -------------------------------------------------------------------------
    def score_one(
        self, response: str, ground_truth: GroundTruth, prompt: str
    ) -> tuple[float, dict]:
        raise NotImplementedError(
            f"{type(self).__name__} implements neither score_one nor score_batch"
        )

    def score_batch(self, samples: list[RewardSample]) -> RewardOutput:
        """Default: :meth:`score_one` per sample; an exception only fails its own sample."""
        scores, infos = [], []
        for s in samples:
            try:
                score, info = self.score_one(s.response, s.ground_truth, s.prompt)
                info = {"timed_out": False, "error": None, **info}
            except Exception as e:
                score, info = self.failure(e)
            scores.append(float(score))
            infos.append(info)
        return RewardOutput(scores, infos)

    # -- shared -------------------------------------------------------------------------------
    def __call__(self, samples: Iterable[Sequence[Any]]) -> RewardOutput:
        samples = as_samples(samples)
        try:
            out = self.score_batch(samples)
            if len(out.scores) != len(samples):
                raise RuntimeError(
                    f"{type(self).__name__} returned {len(out.scores)} scores for "
                    f"{len(samples)} samples"
                )
            return out
        except Exception as e:
            logger.exception("reward function %r failed on a whole batch", self.name)
            failed = [self.failure(e) for _ in samples]
            return RewardOutput([s for s, _ in failed], [i for _, i in failed])

    def failure(
        self, exc: BaseException | None = None, *, timed_out: bool = False, **info: Any
    ) -> tuple[float, dict]:
        """The (score, info) of a sample whose scoring failed or timed out."""
        error = format_error(exc) if exc is not None else None
        return self.incorrect_score, {
            **self.failure_info,
            "timed_out": timed_out,
            "error": error,
            **info,
        }

    def warmup(self) -> None:
        """Do expensive one-off setup now (imports, worker processes). Optional."""

    def close(self) -> None:
        """Release resources (worker processes). Idempotent."""

    def __enter__(self) -> RewardFn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionReward(RewardFn):
    """Wraps a plain ``fn(response, ground_truth, prompt) -> float | (float, info)``.

    For custom rules and for tests; runs in-process without a timeout. An exception from ``fn``
    fails only its sample (score ``incorrect_score``, ``info["error"]`` set).
    """

    name = "function"

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        correct_score: float = 1.0,
        incorrect_score: float = 0.0,
    ) -> None:
        super().__init__(correct_score, incorrect_score)
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "function")

    def score_one(
        self, response: str, ground_truth: GroundTruth, prompt: str
    ) -> tuple[float, dict]:
        out = self.fn(response, ground_truth, prompt)
        if isinstance(out, tuple):
            score, info = out
            return float(score), dict(info)
        return float(out), {}


# ---------------------------------------------------------------------------------------------
# Text helpers shared by the format and exact-match rewards.

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def find_boxed(text: str) -> list[str | None]:
    r"""Contents of every ``\boxed{...}`` / ``\fbox{...}`` in ``text``, in order.

    Braces are matched with nesting (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``); an unclosed box
    yields ``None`` in its place.
    """
    out: list[str | None] = []
    pos = 0
    while (m := _BOXED_RE.search(text, pos)) is not None:
        depth, start = 1, m.end()
        i = start
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text):  # skip escaped characters such as \{ and \}
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        out.append(text[start : i - 1] if depth == 0 else None)
        pos = i  # a box nested in this one is part of its content, not a separate box
    return out


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` in ``text``, or None."""
    for content in reversed(find_boxed(text)):
        if content is not None:
            return content
    return None
