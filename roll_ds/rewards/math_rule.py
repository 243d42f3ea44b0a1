r"""``math_rule``: answer correctness checked with math-verify.

The gold answer and the response are parsed with ``math_verify.parse`` and compared with
``math_verify.verify``. The response's answer is the last ``\boxed{...}`` if there is one, else
what math-verify's extraction finds (LaTeX environments, "the final answer is ...", the last
number / expression). A short bare response written in LaTeX without delimiters (``2\pi``,
``\frac{1}{2}``, ``x+1``) is parsed as LaTeX too, so the tiny model's bare answers are understood.

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
  (``python -m roll_ds.rewards.math_rule``, ``num_procs`` of them), each running the alarm in
  its own main thread, so a slow sample costs only ``timeout_s``. A worker that has still not
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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from roll_ds.rewards.base import (
    GroundTruth,
    RewardFn,
    RewardOutput,
    RewardSample,
    find_boxed,
    format_error,
    ground_truth_list,
)

logger = logging.getLogger(__name__)

TIMEOUT_BACKENDS = ("process", "signal", "none")
_MAX_EXTRACTED_CHARS = 200
_BARE_MAX_CHARS = 200


# ---------------------------------------------------------------------------------------------
# Verification of one sample, no timeout (runs in a worker process or in-process).


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


# ---------------------------------------------------------------------------------------------
# Worker subprocesses.


def _set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when the thread that spawned it exits (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _worker_main(argv: list[str]) -> None:
    """Entry point of a worker: ``python -m roll_ds.rewards.math_rule IN_FD OUT_FD OPTIONS``."""
    in_fd, out_fd, options = int(argv[0]), int(argv[1]), json.loads(argv[2])
    if options.pop("pdeathsig", False):
        _set_parent_death_signal()
    memory_limit_mb = options.pop("memory_limit_mb", None)
    if memory_limit_mb:
        import resource

        limit = int(memory_limit_mb) * 1024 * 1024
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    timeout_s = options.pop("timeout_s", None)
    opts = VerifyOptions(**options)
    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which kills us
    warm_up_verifier()  # before announcing readiness
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job_id, response, golds = msg
        try:
            result = verify_with_alarm(response, golds, opts, timeout_s)
        except BaseException as e:  # MemoryError and friends: report, keep serving
            result = {
                "correct": False,
                "timed_out": False,
                "error": format_error(e),
                "extracted": None,
            }
        outbox.send((job_id, result))


_INF = float("inf")


@dataclass
class _Slot:
    proc: subprocess.Popen
    inbox: Connection  # the parent reads results here
    outbox: Connection  # the parent sends jobs here
    started: float  # spawn time (monotonic)
    ready: bool = False
    # Jobs sent and not answered, in order: (job index, pickled size). The worker answers them
    # in order, so the head is the one it is working on.
    outstanding: deque[tuple[int, int]] = field(default_factory=deque)
    inflight_bytes: int = 0
    deadline: float = _INF  # the head's answer is due by then (hard timeout)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerPool:
    """``num_procs`` persistent verification subprocesses with a hard per-sample deadline.

    Jobs are pipelined (up to ``max_inflight`` per worker, ``max_inflight_bytes`` of pickled
    jobs beyond the first, so a send never blocks on a full pipe): a worker answers in order,
    and each answer must come within ``timeout_s + kill_grace_s`` of the previous one (or of
    the send, for the first). A worker that misses that is killed: its current job is reported
    timed out, the jobs queued behind it go to other / fresh workers.
    """

    def __init__(
        self,
        num_procs: int,
        timeout_s: float | None,
        opts: VerifyOptions,
        *,
        kill_grace_s: float = 1.0,
        memory_limit_mb: int | None = None,
        startup_timeout_s: float = 120.0,
        max_inflight: int = 32,
        max_inflight_bytes: int = 32 * 1024,
    ) -> None:
        if num_procs < 1:
            raise ValueError(f"num_procs must be >= 1, got {num_procs}")
        self.num_procs = num_procs
        self.timeout_s = timeout_s
        self.opts = opts
        self.kill_grace_s = kill_grace_s
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self.max_inflight = max(1, max_inflight)
        self.max_inflight_bytes = max_inflight_bytes
        self._slots: list[_Slot | None] = [None] * num_procs
        self._lock = threading.Lock()
        self.num_spawned = 0
        self.num_killed = 0
        self._finalizer = weakref.finalize(self, WorkerPool._kill_all, self._slots)

    # -- process management -------------------------------------------------------------------
    def _spawn(self, i: int) -> None:
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        options = {
            **self.opts.__dict__,
            "timeout_s": self.timeout_s,
            "memory_limit_mb": self.memory_limit_mb,
            "pdeathsig": threading.current_thread() is threading.main_thread(),
        }
        env = dict(os.environ)
        root = _package_root()
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "roll_ds.rewards.math_rule",
                    str(p2c_r),
                    str(c2p_w),
                    json.dumps(options),
                ],
                pass_fds=(p2c_r, c2p_w),
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=root,
            )
        except BaseException:
            for fd in (p2c_w, c2p_r):
                os.close(fd)
            raise
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        self._slots[i] = _Slot(
            proc,
            Connection(c2p_r, writable=False),
            Connection(p2c_w, readable=False),
            started=time.monotonic(),
        )
        self.num_spawned += 1

    def _discard(self, i: int, *, count_kill: bool = True) -> None:
        slot = self._slots[i]
        self._slots[i] = None
        if slot is None:
            return
        if slot.proc.poll() is None:
            slot.proc.kill()
            self.num_killed += int(count_kill)
        for conn in (slot.inbox, slot.outbox):
            with contextlib.suppress(OSError):
                conn.close()
        with contextlib.suppress(Exception):
            slot.proc.wait(timeout=5)

    @staticmethod
    def _kill_all(slots: list[_Slot | None]) -> None:
        for slot in slots:
            if slot is not None and slot.proc.poll() is None:
                slot.proc.kill()
                with contextlib.suppress(Exception):
                    slot.proc.wait(timeout=5)

    def close(self) -> None:
        """Stop every worker (they hold no state: SIGKILL, no shutdown wait)."""
        with self._lock:
            for i in range(self.num_procs):
                self._discard(i, count_kill=False)

    def pids(self) -> list[int | None]:
        """Process ids of the current workers (None where none runs)."""
        return [s.proc.pid if s is not None else None for s in self._slots]

    def start(self) -> None:
        """Start every worker and wait until all are ready; raise if one cannot start."""
        self.run([])
        not_ready = [i for i, s in enumerate(self._slots) if s is None or not s.ready]
        if not_ready:
            raise RuntimeError(
                f"math_rule worker processes {not_ready} did not start (their stderr is above)"
            )

    # -- scheduling ---------------------------------------------------------------------------
    def run(self, jobs: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
        """Verify every ``(response, golds)``; index-aligned result dicts. Never raises for a bad
        job: one that hangs or kills its worker gets a ``timed_out`` / ``error`` result."""
        with self._lock:
            return self._run(jobs)

    def _run(self, jobs: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | None] = [None] * len(jobs)
        pending: deque[int] = deque(range(len(jobs)))
        hard_timeout = self.timeout_s + self.kill_grace_s if self.timeout_s else _INF
        max_start_failures = 2 * self.num_procs + 1
        start_failures = 0
        warming_up = not jobs  # start(): just bring every worker up

        def fail(job: int, error: str | None, timed_out: bool = False) -> None:
            results[job] = {
                "correct": False,
                "timed_out": timed_out,
                "error": error,
                "extracted": None,
            }

        def requeue(slot: _Slot) -> None:
            """Give the jobs queued behind the head back, ahead of the rest, in order."""
            for job, _ in reversed(slot.outstanding):
                pending.appendleft(job)
            slot.outstanding.clear()

        def feed(slot: _Slot, now: float) -> None:
            while pending and len(slot.outstanding) < self.max_inflight:
                job = pending[0]
                response, golds = jobs[job]
                payload = pickle.dumps((job, response, golds), protocol=pickle.HIGHEST_PROTOCOL)
                if slot.outstanding and (
                    slot.inflight_bytes + len(payload) > self.max_inflight_bytes
                ):
                    return  # would risk blocking on a full pipe; send after some answers
                try:
                    slot.outbox.send_bytes(payload)
                except OSError:
                    return  # the worker died: its inbox reports EOF below
                pending.popleft()
                if not slot.outstanding:
                    slot.deadline = now + hard_timeout
                slot.outstanding.append((job, len(payload)))
                slot.inflight_bytes += len(payload)

        while True:
            busy = any(s is not None and s.outstanding for s in self._slots)
            if (
                not pending
                and not busy
                and (
                    not warming_up
                    or all(s is not None and s.ready for s in self._slots)
                    or start_failures >= max_start_failures
                )
            ):
                break
            if start_failures >= max_start_failures and pending:
                for job in pending:
                    fail(job, "worker_unavailable: math_rule worker processes fail to start")
                pending.clear()
                continue
            now = time.monotonic()
            for i in range(self.num_procs):
                if self._slots[i] is None and (pending or warming_up):
                    try:
                        self._spawn(i)
                    except OSError as e:
                        logger.error("cannot start a math_rule worker: %s", e)
                        start_failures += 1
                        continue
                slot = self._slots[i]
                if slot is not None and slot.ready:
                    feed(slot, now)
            live = {s.inbox: i for i, s in enumerate(self._slots) if s is not None}
            if not live:
                continue
            due = [
                s.deadline if s.ready else s.started + self.startup_timeout_s
                for s in self._slots
                if s is not None
            ]
            nearest = min(due, default=_INF)
            wait_s = None if nearest == _INF else max(0.0, nearest - time.monotonic())
            for conn in wait(list(live), timeout=wait_s):
                i = live[conn]
                slot = self._slots[i]
                assert slot is not None
                while True:  # drain everything already there: fewer wait() calls
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        code = slot.proc.poll()
                        if code is None:
                            with contextlib.suppress(Exception):
                                code = slot.proc.wait(timeout=1)
                        if slot.outstanding:
                            head, _ = slot.outstanding.popleft()
                            fail(head, f"worker_crashed: exit code {code}")
                            requeue(slot)
                        elif not slot.ready:
                            logger.error("a math_rule worker exited while starting (code %s)", code)
                            start_failures += 1
                        self._discard(i)
                        break
                    if msg[0] == "ready":
                        slot.ready = True
                        start_failures = 0
                    else:
                        job, result = msg
                        if slot.outstanding and slot.outstanding[0][0] == job:
                            _, size = slot.outstanding.popleft()
                            slot.inflight_bytes -= size
                            results[job] = result
                            slot.deadline = (
                                time.monotonic() + hard_timeout if slot.outstanding else _INF
                            )
                    if not conn.poll(0):
                        break
                if self._slots[i] is slot and slot.ready:
                    feed(slot, time.monotonic())  # refill at once, the worker may be idle
            # Kill workers that missed their deadline (hung) or did not start in time.
            now = time.monotonic()
            for i, slot in enumerate(self._slots):
                if slot is None:
                    continue
                if slot.outstanding and now >= slot.deadline:
                    head, _ = slot.outstanding.popleft()
                    fail(head, None, timed_out=True)
                    requeue(slot)
                    self._discard(i)
                elif not slot.ready and now >= slot.started + self.startup_timeout_s:
                    logger.error(
                        "a math_rule worker did not start within %.0f s", self.startup_timeout_s
                    )
                    start_failures += 1
                    self._discard(i)
        return [
            r
            if r is not None
            else {
                "correct": False,
                "timed_out": False,
                "error": "internal: no result",
                "extracted": None,
            }
            for r in results
        ]


# ---------------------------------------------------------------------------------------------
# The reward function.


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
        jobs = [
            ("" if s.response is None else str(s.response), ground_truth_list(s.ground_truth))
            for s in samples
        ]
        backend = self._backend_now()
        if backend == "process":
            results = self.pool.run(jobs)
        else:
            timeout = self.timeout_s if backend == "signal" else None
            results = [verify_with_alarm(r, g, self.opts, timeout) for r, g in jobs]
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

    def score_one(
        self, response: str, ground_truth: GroundTruth, prompt: str = ""
    ) -> tuple[float, dict]:
        out = self.score_batch([RewardSample(response, ground_truth, prompt)])
        return out.scores[0], out.infos[0]


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
