"""The leak watch of the fault tests (``_leaks.py``) keeps an orphan in view: a process whose
parent dies between two polls (a killed actor's vLLM EngineCore, a rank's helper) is
re-parented to the watched run when it is a subreaper, so it is recorded and, still alive at
the end, reported. No Ray: a plain script that orphans a sleeping grandchild (~1 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _leaks import LeakWatch, become_subreaper

# Waits for a line on stdin, then forks a child that forks a sleeping grandchild and exits at
# once (orphaning it); prints the grandchild's pid, then waits for stdin to close.
ORPHANING = """
import os, sys, time
sys.stdin.readline()
read, write = os.pipe()
child = os.fork()
if child == 0:
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(120)
        os._exit(0)
    os.write(write, str(grandchild).encode())
    os._exit(0)
os.waitpid(child, 0)
print(os.read(read, 32).decode(), flush=True)
sys.stdin.read()
"""


def orphan_under_watch(subreaper: bool) -> tuple[int, LeakWatch]:
    """The orphan's pid, and a watch that polled the run once before and once after."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHANING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=become_subreaper if subreaper else None,
    )
    watch = LeakWatch(proc.pid, interval_s=3600)  # polls once now; the next one is ours
    try:
        while not watch.polls:
            time.sleep(0.01)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        orphan = int(proc.stdout.readline())
        watch.poll()
        return orphan, watch
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl subreaper is Linux's")
def test_an_orphan_of_a_subreaper_run_is_recorded_and_reported_alive():
    orphan, watch = orphan_under_watch(subreaper=True)
    try:
        left = watch.leftovers(grace_s=0)
        assert orphan in left.processes, (orphan, watch.processes)
    finally:
        os.kill(orphan, signal.SIGKILL)
    # Without the subreaper the same orphan leaves the tree before the poll that would see it.
    orphan, watch = orphan_under_watch(subreaper=False)
    try:
        assert orphan not in watch.processes
    finally:
        os.kill(orphan, signal.SIGKILL)
