"""Persistent worker subprocesses that verify samples with a hard per-sample deadline.

Each worker (``python -m roll_ds.rewards.verify_pool IN_FD OUT_FD OPTIONS``) runs
:func:`roll_ds.rewards.verify.verify_with_alarm` in its own main thread, so the soft alarm
works there; :class:`WorkerPool` (the parent side) only waits on pipes, so it works from any
thread. A worker that misses ``timeout_s + kill_grace_s`` is killed and replaced; see the
docstring of :mod:`roll_ds.rewards.math_rule` for the whole timeout story.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
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

from roll_ds.rewards.base import format_error
from roll_ds.rewards.verify import VerifyOptions, verify_with_alarm, warm_up_verifier

logger = logging.getLogger(__name__)


def _set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when the thread that spawned it exits (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _worker_main(argv: list[str]) -> None:
    """Entry point of a worker: ``python -m roll_ds.rewards.verify_pool IN_FD OUT_FD OPTIONS``."""
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
                    "roll_ds.rewards.verify_pool",
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
        round_ = _Round(self, jobs)
        while not round_.finished():
            if round_.cannot_start_workers():
                continue
            round_.spawn_and_feed()
            round_.receive()
            round_.kill_overdue()
        return round_.results_or_placeholders()


_NO_RESULT = {
    "correct": False,
    "timed_out": False,
    "error": "internal: no result",
    "extracted": None,
}


class _Round:
    """The state of one :meth:`WorkerPool.run` call: which jobs wait, which are answered, and
    how often workers failed to start. Each loop of ``_run`` spawns missing workers and feeds
    them, receives what they answered, then kills those that missed a deadline."""

    def __init__(self, pool: WorkerPool, jobs: list[tuple[str, list[str]]]) -> None:
        self.pool = pool
        self.jobs = jobs
        self.results: list[dict[str, Any] | None] = [None] * len(jobs)
        self.pending: deque[int] = deque(range(len(jobs)))
        self.hard_timeout = pool.timeout_s + pool.kill_grace_s if pool.timeout_s else _INF
        self.max_start_failures = 2 * pool.num_procs + 1
        self.start_failures = 0
        self.warming_up = not jobs  # start(): just bring every worker up

    @property
    def slots(self) -> list[_Slot | None]:
        return self.pool._slots

    # -- bookkeeping ----------------------------------------------------------------------------
    def fail(self, job: int, error: str | None, timed_out: bool = False) -> None:
        self.results[job] = {
            "correct": False,
            "timed_out": timed_out,
            "error": error,
            "extracted": None,
        }

    def requeue(self, slot: _Slot) -> None:
        """Give the jobs queued behind the head back, ahead of the rest, in order."""
        for job, _ in reversed(slot.outstanding):
            self.pending.appendleft(job)
        slot.outstanding.clear()

    def finished(self) -> bool:
        busy = any(s is not None and s.outstanding for s in self.slots)
        return (
            not self.pending
            and not busy
            and (
                not self.warming_up
                or all(s is not None and s.ready for s in self.slots)
                or self.start_failures >= self.max_start_failures
            )
        )

    def cannot_start_workers(self) -> bool:
        """Fail every waiting job once workers keep failing to start; True if it did."""
        if self.start_failures < self.max_start_failures or not self.pending:
            return False
        for job in self.pending:
            self.fail(job, "worker_unavailable: math_rule worker processes fail to start")
        self.pending.clear()
        return True

    def results_or_placeholders(self) -> list[dict[str, Any]]:
        return [r if r is not None else dict(_NO_RESULT) for r in self.results]

    # -- one loop ---------------------------------------------------------------------------------
    def feed(self, slot: _Slot, now: float) -> None:
        """Send waiting jobs to ``slot`` up to its in-flight job and byte limits."""
        pool = self.pool
        while self.pending and len(slot.outstanding) < pool.max_inflight:
            job = self.pending[0]
            response, golds = self.jobs[job]
            payload = pickle.dumps((job, response, golds), protocol=pickle.HIGHEST_PROTOCOL)
            if slot.outstanding and (slot.inflight_bytes + len(payload) > pool.max_inflight_bytes):
                return  # would risk blocking on a full pipe; send after some answers
            try:
                slot.outbox.send_bytes(payload)
            except OSError:
                return  # the worker died: its inbox reports EOF in receive()
            self.pending.popleft()
            if not slot.outstanding:
                slot.deadline = now + self.hard_timeout
            slot.outstanding.append((job, len(payload)))
            slot.inflight_bytes += len(payload)

    def spawn_and_feed(self) -> None:
        now = time.monotonic()
        for i in range(self.pool.num_procs):
            if self.slots[i] is None and (self.pending or self.warming_up):
                try:
                    self.pool._spawn(i)
                except OSError as e:
                    logger.error("cannot start a math_rule worker: %s", e)
                    self.start_failures += 1
                    continue
            slot = self.slots[i]
            if slot is not None and slot.ready:
                self.feed(slot, now)

    def receive(self) -> None:
        """Wait until a worker answers or the nearest deadline, then take every answer."""
        live = {s.inbox: i for i, s in enumerate(self.slots) if s is not None}
        if not live:
            return
        due = [
            s.deadline if s.ready else s.started + self.pool.startup_timeout_s
            for s in self.slots
            if s is not None
        ]
        nearest = min(due, default=_INF)
        wait_s = None if nearest == _INF else max(0.0, nearest - time.monotonic())
        for conn in wait(list(live), timeout=wait_s):
            i = live[conn]
            slot = self.slots[i]
            assert slot is not None
            self.drain(i, slot, conn)
            if self.slots[i] is slot and slot.ready:
                self.feed(slot, time.monotonic())  # refill at once, the worker may be idle

    def drain(self, i: int, slot: _Slot, conn: Connection) -> None:
        """Take every message already in ``conn`` (fewer wait() calls); a closed pipe means the
        worker died: its head job fails, the jobs behind it go back to the queue."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.worker_died(i, slot)
                return
            if msg[0] == "ready":
                slot.ready = True
                self.start_failures = 0
            else:
                job, result = msg
                if slot.outstanding and slot.outstanding[0][0] == job:
                    _, size = slot.outstanding.popleft()
                    slot.inflight_bytes -= size
                    self.results[job] = result
                    slot.deadline = (
                        time.monotonic() + self.hard_timeout if slot.outstanding else _INF
                    )
            if not conn.poll(0):
                return

    def worker_died(self, i: int, slot: _Slot) -> None:
        code = slot.proc.poll()
        if code is None:
            with contextlib.suppress(Exception):
                code = slot.proc.wait(timeout=1)
        if slot.outstanding:
            head, _ = slot.outstanding.popleft()
            self.fail(head, f"worker_crashed: exit code {code}")
            self.requeue(slot)
        elif not slot.ready:
            logger.error("a math_rule worker exited while starting (code %s)", code)
            self.start_failures += 1
        self.pool._discard(i)

    def kill_overdue(self) -> None:
        """Kill workers that missed their deadline (hung) or did not start in time."""
        now = time.monotonic()
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            if slot.outstanding and now >= slot.deadline:
                head, _ = slot.outstanding.popleft()
                self.fail(head, None, timed_out=True)
                self.requeue(slot)
                self.pool._discard(i)
            elif not slot.ready and now >= slot.started + self.pool.startup_timeout_s:
                logger.error(
                    "a math_rule worker did not start within %.0f s", self.pool.startup_timeout_s
                )
                self.start_failures += 1
                self.pool._discard(i)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
