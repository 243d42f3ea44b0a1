"""What a run (or the whole test session) leaves behind: ``/dev/shm`` files and processes.

Other runs on the same machine make files in /dev/shm at the same time, so a before/after
listing cannot tell whose a file is. ``LeakWatch`` attributes by ownership instead: while the
watched process runs, a thread polls its process tree (``roll_ds.distributed.shm``: the Ray
processes a local run starts are its children, the actors theirs) and records every /dev/shm
file one of them maps or holds open, and every process in the tree. ``leftovers`` then lists
the recorded files still there (the same inode) and the recorded processes still alive.

A process whose parent dies is re-parented, by default to init, out of the watched tree: one
orphaned between two polls (a killed actor's vLLM EngineCore, a rank's helper) would go unseen.
Run the watched process as a subreaper (``Popen(preexec_fn=become_subreaper)``) and its
orphans are re-parented to it instead, so they stay in the tree and are recorded.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from roll_ds.distributed.shm import SHM_DIR, held_files, process_tree

# The multiprocessing resource tracker a test's spawned processes start as a child of the watched
# process itself (pytest): it lives until that process exits, by design, and holds no files.
OWN_HELPER = "multiprocessing.resource_tracker"
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux; a no-op elsewhere): they
    are re-parented here instead of to init. Kept across ``exec``, so it serves as a ``Popen``
    ``preexec_fn`` for a watched run."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@dataclass
class Leftovers:
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes
    processes: dict[int, str] = field(default_factory=dict)  # pid -> command line
    holders: dict[str, set[str]] = field(default_factory=dict)  # name -> "pid command"

    def __bool__(self) -> bool:
        return bool(self.files or self.processes)

    def describe(self) -> str:
        lines = [
            f"/dev/shm/{n} ({b / 2**20:.1f} MiB; held by {', '.join(sorted(self.holders[n]))})"
            for n, b in sorted(self.files.items())
        ]
        lines += [
            f"process {pid} still alive: {cmd}" for pid, cmd in sorted(self.processes.items())
        ]
        return "\n".join(lines)


class LeakWatch:
    """Poll ``root``'s process tree every ``interval_s`` until ``stop``; see the module doc.
    A poll costs ~75 ms of CPU with a run's ~20 processes (every ``/proc/<pid>/stat`` is read to
    find the tree): 1 s is ample for files that live as long as an engine, and a file missed
    (made and leaked within one interval) is only ever a leak not reported, never a false one."""

    def __init__(self, root: int, interval_s: float = 1.0) -> None:
        self.root = root
        self.interval_s = interval_s
        self.files: dict[str, int] = {}  # name -> inode
        self.holders: dict[str, set[str]] = {}
        self.processes: dict[int, tuple[float, str]] = {}  # pid -> (create time, cmd)
        self.poll_s, self.polls = 0.0, 0  # the watch's own cost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="leak-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval_s)

    def poll(self) -> None:
        start = time.perf_counter()
        self._poll()
        self.poll_s += time.perf_counter() - start
        self.polls += 1

    def _poll(self) -> None:
        for pid in process_tree([self.root]) - {self.root}:
            if pid not in self.processes:
                try:
                    proc = psutil.Process(pid)
                    cmd = " ".join(proc.cmdline())
                    if proc.ppid() == self.root and OWN_HELPER in cmd:
                        continue  # the watched process's own; it exits with it
                    self.processes[pid] = (proc.create_time(), cmd[:160])
                except psutil.Error:
                    continue
            for name, inode in held_files([pid]).items():
                self.files[name] = inode
                self.holders.setdefault(name, set()).add(f"{pid} {self.processes[pid][1][:60]}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def leftovers(self, grace_s: float = 15.0) -> Leftovers:
        """What is still there after up to ``grace_s`` for the processes to exit (a killed
        actor's children are ended by the raylet shortly after it)."""
        self.stop()
        deadline = time.monotonic() + grace_s
        while (alive := self._alive()) and time.monotonic() < deadline:
            time.sleep(0.25)
        out = Leftovers(processes=alive, holders=self.holders)
        for name, inode in self.files.items():
            try:
                st = (SHM_DIR / name).stat()
            except OSError:
                continue
            if st.st_ino == inode:
                out.files[name] = st.st_size
        return out

    def _alive(self) -> dict[int, str]:
        alive = {}
        for pid, (created, cmd) in self.processes.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - created) < 1e-3 and proc.status() != "zombie":
                    alive[pid] = cmd
            except psutil.Error:
                continue
        return alive
