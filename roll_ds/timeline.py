"""Where a run's start-up goes: wall-clock phases, recorded in each process and gathered into
``<output_dir>/<exp_name>/startup.json`` when the first step ends.

Every process of a run (the driver, each rank of each role) records its own phases here with
``phase(name)``; the process's own start (its creation time, read from the OS) is the origin of
its first phase, so the time Python, Ray's worker boot and the module imports took before any
roll_ds code ran is counted too. Times are ``time.time()`` seconds: one clock on one machine,
NTP-close across the nodes of a cluster, which is as good as a start-up profile of tens of
seconds needs.

    with timeline.phase("deepspeed.initialize"):
        engine, *_ = deepspeed.initialize(...)
    ...
    timeline.drain()  # [{"name": ..., "start": ..., "end": ...}, ...], cleared

A worker drains its phases into what ``initialize`` returns; the driver adds its own
(``pipeline/startup_report.py``) and writes the report. Nothing here imports more than the
standard library and psutil: a reward worker records its start-up without torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# The libraries whose import dominates a worker's start (what each role loaded tells whether it
# imports only what it uses).
HEAVY_LIBRARIES = ("torch", "transformers", "deepspeed", "vllm", "peft", "ray")

_lock = threading.Lock()
_phases: list[dict[str, Any]] = []
_recording = True


def process_started() -> float:
    """When this process was created (``time.time()`` seconds), per the OS. On Linux from its
    age in clock ticks (``/proc/self/stat`` against ``/proc/uptime``, one clock, 10 ms):
    psutil's ``create_time`` adds that age to the boot time, which it has to the whole second,
    so every phase measured from it came out up to 1 s long."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_ticks = int(after_name[19])  # field 22, starttime, in ticks since boot
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        return psutil.Process(os.getpid()).create_time()


def record(name: str, start: float, end: float, **extra: Any) -> None:
    """A phase that ran from ``start`` to ``end`` (``time.time()`` seconds) in this process
    (nothing once ``stop()`` was called: the per-step phases of a long run are not kept)."""
    with _lock:
        if _recording:
            _phases.append({"name": name, "start": start, "end": end, **extra})


def stop() -> None:
    """Record nothing more in this process (the start-up is over and reported)."""
    global _recording
    with _lock:
        _recording = False


@contextlib.contextmanager
def phase(name: str, **extra: Any) -> Iterator[None]:
    """Record the body as phase ``name`` (also when it raises: a failed start's profile shows
    where it stopped)."""
    start = time.time()
    try:
        yield
    finally:
        record(name, start, time.time(), **extra)


def drain() -> list[dict[str, Any]]:
    """This process's phases so far, oldest first; the list is emptied."""
    with _lock:
        out = sorted(_phases, key=lambda p: p["start"])
        _phases.clear()
    return out


def loaded_libraries() -> list[str]:
    """Which of ``HEAVY_LIBRARIES`` this process has imported."""
    return [name for name in HEAVY_LIBRARIES if name in sys.modules]
