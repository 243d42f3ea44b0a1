"""What one run of the sandbox gave (:class:`SandboxResult`) and its error category
(:func:`classify`, pure)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

#: error categories of a run ("ok": exited 0); the code reward adds "passed" / "wrong_answer"
CATEGORIES = (
    "ok",
    "timeout",
    "memory",
    "output_limit",
    "process_limit",
    "syntax_error",
    "runtime_error",
    "sandbox_error",
)


@dataclass
class SandboxResult:
    """What a run gave. ``category`` is one of :data:`CATEGORIES`; ``wall_s`` counts from the
    program's start (after the sandbox setup); ``exit_code`` / ``signal`` are None when unknown
    (killed launcher, setup failure)."""

    stdout: str
    stderr: str
    category: str
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    cpu_s: float | None = None
    detail: str = ""
    pids: tuple[int, ...] = ()  # host pids of the launcher and the program
    pid_ns: str | None = None  # the program's pid namespace, e.g. "pid:[4026532291]"


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def last_exception(stderr: str) -> str | None:
    """Name of the exception that ended a Python program (last line of its traceback)."""
    lines = stderr.strip().splitlines()
    m = _EXC_LINE.match(lines[-1].strip()) if lines else None
    return m.group(1) if m else None


def classify(
    *,
    stopped_for: str | None,
    exit_code: int | None,
    sig: int | None,
    cpu_s: float | None,
    cpu_limit_s: int,
    stderr: str,
) -> str:
    """The error category of a finished run (pure; see :data:`CATEGORIES`)."""
    if stopped_for is not None:
        return stopped_for
    if sig is not None:
        over_cpu = cpu_s is not None and cpu_s >= cpu_limit_s - 0.05
        return "timeout" if over_cpu or sig == signal.SIGXCPU else "runtime_error"
    if exit_code == 0:
        return "ok"
    exc = last_exception(stderr)
    if exc == "MemoryError":
        return "memory"
    if exc in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax_error"
    if exc == "BlockingIOError" and "Resource temporarily unavailable" in stderr:
        return "process_limit"  # fork() refused by RLIMIT_NPROC
    return "runtime_error"
