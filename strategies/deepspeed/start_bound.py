"""A bound on a trainer rank's start-up (``deepspeed.init_distributed`` + ``deepspeed.initialize``).

A rank whose peer died or never arrived waits in the default group's rendezvous or in a ZeRO
collective (ZeRO-3 partitioning broadcasts at ``initialize``) for the group's timeout
(``fault_tolerance.process_group_timeout_s``, 30 min by default; DeepSpeed's own, where none is
passed, is 10 min), silently. vLLM's start has a bound (``strategies.vllm.start``); this is the
trainer's: past ``timeout_s`` a watchdog

1. raises ``TimeoutError`` in the starting thread (it surfaces as soon as that thread runs Python
   again: a Python-level wait at once, a blocked C++ collective when it returns),
2. aborts the default process group where torch can (NCCL), so a blocked collective returns,
3. after ``grace_s`` more, if the thread is still stuck in C++, writes the message to stderr
   and ends the process (Ray then reports the actor dead; the message is in its log).

The error names the role, the rank and how to raise the bound (``ROLL_DS_DEEPSPEED_START_TIMEOUT_S``
in the role's ``system_envs``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator

START_TIMEOUT_ENV = "ROLL_DS_DEEPSPEED_START_TIMEOUT_S"
START_TIMEOUT_S = 1800.0  # model load, op builds (cpu_adam ~70 s cold), ZeRO-3 partitioning
GRACE_S = 30.0


class StartTimeout(TimeoutError):
    """Raised in the starting thread by the watchdog."""


def start_timeout_s() -> float:
    value = os.environ.get(START_TIMEOUT_ENV, str(START_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"{START_TIMEOUT_ENV} must be a number of seconds, got {value!r}"
        ) from None
    if seconds <= 0:
        raise ValueError(f"{START_TIMEOUT_ENV} must be > 0, got {value!r}")
    return seconds


def start_message(role: str, rank: int | str, timeout_s: float) -> str:
    return (
        f"{role} rank {rank}: DeepSpeed initialisation did not finish within {timeout_s:g} s "
        "(a peer rank that died or never started leaves the others waiting in the process "
        "group's rendezvous or a ZeRO collective; see the other ranks' logs); raise the bound "
        f"with {START_TIMEOUT_ENV} in the role's system_envs if the model needs longer"
    )


@contextlib.contextmanager
def bounded_initialisation(
    timeout_s: float,
    *,
    role: str,
    rank: int | str,
    grace_s: float = GRACE_S,
    abort: Callable[[], None] | None = None,
    exit_process: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Run the block (a rank's DeepSpeed start); past ``timeout_s`` raise ``TimeoutError``
    naming ``role`` and ``rank`` (see the module doc for how a stuck block is ended).
    ``abort`` / ``exit_process`` default to aborting torch's default group / ``os._exit``."""
    message = start_message(role, rank, timeout_s)
    target = threading.get_ident()
    lock = threading.Lock()
    done = threading.Event()
    fired = threading.Event()

    def watchdog() -> None:
        if done.wait(timeout_s):
            return
        with lock:  # either the block finished first, or the exception is sent while it runs
            if done.is_set():
                return
            fired.set()
            _raise_in(target, StartTimeout)
        (abort or _abort_default_group)()
        if not done.wait(grace_s):
            (exit_process or _exit_process)(message)

    def finish() -> None:
        with lock:
            done.set()
            if fired.is_set():
                _raise_in(target, None)  # withdraw it if it has not landed yet

    threading.Thread(target=watchdog, name="roll_ds-start-bound", daemon=True).start()
    try:
        try:
            yield
        finally:
            finish()
    except BaseException as exc:
        finish()  # again: the exception may have landed inside the first one
        if fired.is_set():
            raise TimeoutError(message) from exc
        raise
    if fired.is_set():  # finished after the bound, before the exception landed
        raise TimeoutError(message)


def _raise_in(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Make ``exc_type`` raise in thread ``thread_id`` at its next Python instruction (None:
    withdraw a pending one)."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else ctypes.c_void_p(0)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


def _abort_default_group() -> None:
    with contextlib.suppress(Exception):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if dist.is_initialized() and hasattr(distributed_c10d, "_abort_process_group"):
            distributed_c10d._abort_process_group()


def _exit_process(message: str) -> None:
    sys.stderr.write(f"roll_ds: {message}; the rank is stuck in a collective, ending it\n")
    sys.stderr.flush()
    os._exit(1)
