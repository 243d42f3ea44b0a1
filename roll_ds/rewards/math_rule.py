r"""``math_rule``: answer correctness checked with math-verify.

The gold answer and the response are parsed with ``math_verify.parse`` and compared with
``math_verify.verify`` (in :mod:`roll_ds.rewards.verify`). The response's answer is the last
``\boxed{...}`` if there is one, else what math-verify's extraction finds (LaTeX environments,
"the final answer is ...", the last number / expression). A short bare response written in LaTeX
without delimiters (``2\pi``, ``\frac{1}{2}``, ``x+1``) is parsed as LaTeX too, so the tiny
model's bare answers are understood.

The module is split in three: :mod:`roll_ds.rewards.verify` verifies one sample (under the
alarm described below), :mod:`roll_ds.rewards.verify_pool` runs the worker subprocesses, and
this module holds the reward function, :class:`MathRuleReward`.

Timeouts
--------
math-verify's own timeouts (``parsing_timeout`` / ``timeout_seconds``) are switched off here:
they use ``signal.alarm`` (whole seconds, main thread only: elsewhere ``parse`` raises
ValueError), they swallow the timeout (a timed-out sample just looks wrong, so it cannot be
counted), and each call's ``signal.alarm(0)`` cancels any alarm set around it. Instead one float
``setitimer`` alarm covers the whole sample (gold parse, answer parse, verify) and raises a
BaseException that no ``except Exception`` in math-verify or sympy swallows. Such an alarm stops
pure-Python sympy work and also CPython's own long loops (a big-integer power such as
``2^{2^{40}}``, a backtracking regex); it cannot stop C extensions that never check for signals
(gmpy2 / python-flint, which sympy uses as ground types where installed), nor survive a crash.
``timeout_backend`` picks where that runs:

* ``"process"`` (default): samples are verified in persistent worker subprocesses
  (``python -m roll_ds.rewards.verify_pool``, ``num_procs`` of them), each running the alarm
  in its own main thread, so a slow sample costs only ``timeout_s``. A worker that has still not
  answered ``kill_grace_s`` later is stuck (C code) and is killed (SIGKILL) and replaced; the
  jobs queued behind it go to a fresh worker. A crashed worker (segfault, OOM kill) fails only
  the sample it was on; ``memory_limit_mb`` caps a worker's address space, so a runaway
  expression ends in a MemoryError, reported as that sample's error. The parent only waits on
  pipes, so this works from any thread (Ray threaded / async actors). Costs ~0.2-0.3 ms CPU
  per sample of IPC.
* ``"signal"``: in-process, same alarm; cheapest, but no crash / memory isolation and no
  defence against C extensions; needs the main thread (elsewhere it falls back to
  ``"process"`` with a warning).
* ``"none"``: in-process, no timeout (debugging only).

A failure or timeout scores ``incorrect_score`` and is recorded in the sample's info
(``timed_out`` / ``error``); nothing is raised.

Repeated answers
----------------
The samples of a GRPO group often give the same response (a small model's bare answers nearly
always do). A verdict depends only on the response, the gold answers and the verify options, so
completed verdicts (not timed out, no error) are kept in an LRU of ``cache_size`` entries, and a
response seen before with the same gold is not verified again, nor sent to a worker; within a
batch each distinct (response, gold) pair is verified once. ``cache_size: 0`` turns it off.

Integer answers
---------------
Where the extracted answer (a bare response, or a lone ``\boxed{}``) and every gold answer are
canonical integers, equal integers are correct and math-verify is not called
(``verify.integer_verdict``, tested to give math-verify's verdict and extraction): grade-school
maths is mostly such pairs, and each cost about 0.5 ms through a worker process.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

from roll_ds.rewards.base import (
    GroundTruth,
    RewardFn,
    RewardOutput,
    RewardSample,
    ground_truth_list,
)
from roll_ds.rewards.verify import (
    VerifyOptions,
    can_use_signals,
    integer_verdict,
    verify_with_alarm,
    warm_up_verifier,
)
from roll_ds.rewards.verify_pool import WorkerPool

logger = logging.getLogger(__name__)

TIMEOUT_BACKENDS = ("process", "signal", "none")


class MathRuleReward(RewardFn):
    """``correct_score`` if math-verify judges the response's answer equal to the ground truth
    (any of them, for a list), else ``incorrect_score``.

    Info per sample: ``correct``, ``timed_out``, ``error``, ``extracted`` (the answer string that
    was compared, or None if none was found).
    """

    name = "math_rule"
    failure_info = {"correct": False, "extracted": None}  # noqa: RUF012

    def __init__(
        self,
        correct_score: float = 1.0,
        incorrect_score: float = 0.0,
        timeout_s: float | None = 5.0,
        timeout_backend: str = "process",
        num_procs: int = 1,
        kill_grace_s: float = 1.0,
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
        float_rounding: int = 6,
        numeric_precision: int = 15,
        strict: bool = True,
        cache_size: int = 65536,
    ) -> None:
        super().__init__(correct_score, incorrect_score)
        if timeout_backend not in TIMEOUT_BACKENDS:
            raise ValueError(
                f"unknown timeout_backend {timeout_backend!r}; valid: {', '.join(TIMEOUT_BACKENDS)}"
            )
        if timeout_s is not None and timeout_s <= 0:
            timeout_s = None
        self.timeout_s = timeout_s
        self.timeout_backend = timeout_backend
        self.opts = VerifyOptions(float_rounding, numeric_precision, strict)
        self._pool_args = dict(
            num_procs=num_procs,
            kill_grace_s=kill_grace_s,
            memory_limit_mb=memory_limit_mb,
            startup_timeout_s=startup_timeout_s,
        )
        self._pool: WorkerPool | None = None
        self._warned_thread = False
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.cache_size = cache_size
        self._verdicts: OrderedDict[tuple[str, tuple[str, ...]], dict] = OrderedDict()

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            args = dict(self._pool_args)
            self._pool = WorkerPool(args.pop("num_procs"), self.timeout_s, self.opts, **args)
        return self._pool

    def _backend_now(self) -> str:
        if self.timeout_backend == "signal" and not can_use_signals():
            if not self._warned_thread:
                logger.warning(
                    "math_rule: timeout_backend='signal' needs the main thread; "
                    "using worker processes from this thread"
                )
                self._warned_thread = True
            return "process"
        return self.timeout_backend

    def warmup(self) -> None:
        if self._backend_now() == "process":
            self.pool.start()
        else:
            warm_up_verifier()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def score_batch(self, samples: list[RewardSample]) -> RewardOutput:
        keys = [
            (
                "" if s.response is None else str(s.response),
                tuple(ground_truth_list(s.ground_truth)),
            )
            for s in samples
        ]
        verdicts = {key: self._verdicts[key] for key in keys if key in self._verdicts}
        for key in verdicts:
            self._verdicts.move_to_end(key)
        todo = list(dict.fromkeys(key for key in keys if key not in verdicts))
        for key, result in zip(todo, self._verify([(r, list(g)) for r, g in todo]), strict=True):
            verdicts[key] = result
            if self.cache_size and not result["timed_out"] and result["error"] is None:
                self._verdicts[key] = result
                if len(self._verdicts) > self.cache_size:
                    self._verdicts.popitem(last=False)
        results = [verdicts[key] for key in keys]
        scores, infos = [], []
        for res in results:
            correct = bool(res["correct"]) and not res["timed_out"]
            scores.append(self.correct_score if correct else self.incorrect_score)
            infos.append(
                {
                    "correct": correct,
                    "timed_out": bool(res["timed_out"]),
                    "error": res["error"],
                    "extracted": res["extracted"],
                }
            )
        return RewardOutput(scores, infos)

    def _verify(self, jobs: list[tuple[str, list[str]]]) -> list[dict]:
        """The verdict on each (response, gold answers) job: integer answers in place
        (``integer_verdict``), the rest by math-verify under the timeout."""
        quick = [integer_verdict(r, g) for r, g in jobs]
        left = [job for job, v in zip(jobs, quick, strict=True) if v is None]
        rest = iter(self._math_verify(left))
        return [next(rest) if v is None else v for v in quick]

    def _math_verify(self, jobs: list[tuple[str, list[str]]]) -> list[dict]:
        """math-verify's verdict on each job, under the timeout."""
        if not jobs:
            return []
        backend = self._backend_now()
        if backend == "process":
            return self.pool.run(jobs)
        timeout = self.timeout_s if backend == "signal" else None
        return [verify_with_alarm(r, g, self.opts, timeout) for r, g in jobs]

    def score_one(
        self, response: str, ground_truth: GroundTruth, prompt: str = ""
    ) -> tuple[float, dict]:
        out = self.score_batch([RewardSample(response, ground_truth, prompt)])
        return out.scores[0], out.infos[0]
