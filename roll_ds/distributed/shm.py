"""The ``/dev/shm`` files a run's workers hold, recorded while they live, and the narrow sweep
that removes exactly those once the workers are gone.

Who puts files there (read from the sources; sizes measured on the CPU box):

- vLLM's ``MessageQueue`` (``shm_broadcast.ShmRingBuffer``) through Python's
  ``multiprocessing.shared_memory``: ``psm_<8 hex>``, 160-240 MB each, whenever vLLM runs its
  multiprocess executor (tensor parallel, or the engine core in its own process). The creator
  unlinks it when the object is collected, and the ``multiprocessing`` resource tracker (a child
  process) unlinks what is left when its clients exit.
- vLLM-CPU's shared-memory communicator (``csrc/cpu/shm.cpp``, tensor- and pipeline-parallel
  groups): ``vllm_dist_<uuid>-<group>-cpushm...``, unlinked by its C++ destructor at exit.
- DeepSpeed's ``deepspeed_shm_comm`` op when ``LOCAL_SIZE`` equals the world size:
  ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 66 MB, never unlinked.
- ``multiprocessing`` named semaphores of spawn-context locks: ``sem.mp-*``.

All of these survive when their process is SIGKILLed, which is what ``ray.kill`` does, and the
raylet then SIGKILLs the actor's children, the resource tracker among them. ``Cluster`` closes
its workers before it kills them (``Worker.close``) so most never outlive a run; this sweep is
the last resort for the rest (a worker that died, or did not close in time).

Safety: a file is removed only if one of the run's own processes mapped it or held it open
(``/proc/<pid>/maps`` and ``/proc/<pid>/fd``), and only while the name still points at that very
file (the inode recorded then). Another run's files, made concurrently on the same machine, are
never recorded and so never removed; a name reused after ours was unlinked is another inode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PROC = Path("/proc")
# psutil statuses of a process that has ended (a zombie waits only to be reaped)
DEAD_STATES = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def process_tree(roots: Iterable[int]) -> set[int]:
    """``roots`` and every live descendant of them (vLLM's worker processes, the engine core,
    the resource tracker are children of the actor process)."""
    seen: set[int] = set()
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(pid).children(recursive=True)
            seen.add(pid)
            seen.update(child.pid for child in children)
    return seen


def descendants(pid: int) -> dict[int, float]:
    """``pid``'s live descendants, each with its start time (``create_time``): what tells a
    process from a later one that reuses its pid."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    found = {}
    for child in children:
        with contextlib.suppress(psutil.Error):
            found[child.pid] = child.create_time()
    return found


def start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _same(pid: int, started: float | None) -> psutil.Process | None:
    """The process ``pid`` if it is alive and (with ``started``) still the one that started
    then; None otherwise."""
    try:
        process = psutil.Process(pid)
        if started is not None and process.create_time() != started:
            return None  # the pid is another process's now
        return process
    except psutil.Error:
        return None


def end_processes(recorded: Mapping[int, float]) -> list[int]:
    """SIGKILL the ``recorded`` processes (pid -> start time) that are still those processes:
    the children a killed actor left (vLLM's engine core, which holds its KV cache and message
    queues, has no parent left to stop it). Returns the pids killed."""
    killed = []
    for pid, started in recorded.items():
        process = _same(pid, started)
        if process is None:
            continue  # gone, or the pid is another process's now
        try:
            process.kill()
            killed.append(pid)
        except psutil.Error:
            continue
    return killed


def running(pid: int, started: float | None = None) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it holds no memory, no GPU context,
    and a parent that never reaps it must not hold anything up) and, with ``started``, still
    the process that started then."""
    process = _same(pid, started)
    try:
        return process is not None and process.status() not in DEAD_STATES
    except psutil.Error:
        return False


def wait_ended(
    recorded: Mapping[int, float | None], timeout_s: float, poll_s: float = 0.05
) -> list[int]:
    """Wait up to ``timeout_s`` until none of ``recorded`` (pid -> start time, None: any) runs;
    returns the pids still running then (``[]``: all gone). Polled, not ``psutil.wait_procs``:
    that waits for a zombie whose parent (not us) never reaps it."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, started in recorded.items() if running(pid, started)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(poll_s)


def end_and_wait(recorded: Mapping[int, float], timeout_s: float) -> tuple[list[int], list[int]]:
    """``end_processes``, then wait (bounded) until the killed processes are gone: a SIGKILLed
    process still frees its memory (a GPU's too) on its way out. ``(killed, still running)``."""
    killed = end_processes(recorded)
    return killed, wait_ended({pid: recorded[pid] for pid in killed}, timeout_s)


def held_files(pids: Iterable[int], shm_dir: Path = SHM_DIR, proc: Path = PROC) -> dict[str, int]:
    """``{name: inode}`` of the files directly under ``shm_dir`` that ``pids`` map or hold open
    (not those already unlinked: the kernel marks them ``(deleted)``)."""
    prefix = f"{shm_dir}/"
    held: dict[str, int] = {}
    for pid in pids:
        held.update(_mapped(proc / str(pid) / "maps", prefix))
        held.update(_open(proc / str(pid) / "fd", prefix))
    return held


def scan(pids: Iterable[int], shm_dir: Path = SHM_DIR, proc: Path = PROC) -> dict[str, int]:
    """``held_files`` of ``pids`` and their descendants (run on the node of ``pids``)."""
    return held_files(process_tree(pids), shm_dir, proc)


def unlink_recorded(files: Mapping[str, int], shm_dir: Path = SHM_DIR) -> dict[str, int]:
    """Unlink each recorded ``name`` whose file is still the recorded inode; returns
    ``{name: bytes}`` of those removed."""
    removed: dict[str, int] = {}
    for name, inode in files.items():
        path = shm_dir / name
        if "/" in name or name in ("", ".", ".."):
            continue  # only ever a file directly under shm_dir
        try:
            st = path.stat()
        except OSError:
            continue  # gone already: its creator unlinked it
        if st.st_ino != inode:
            continue  # the name now belongs to another file
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed[name] = st.st_size
    return removed


class ShmLedger:
    """The files each node's run processes were seen holding; ``sweep`` removes those left."""

    def __init__(self) -> None:
        self.files: dict[str | None, dict[str, int]] = {}  # node id -> {name: inode}

    def record(self, node_id: str | None, files: Mapping[str, int]) -> None:
        self.files.setdefault(node_id, {}).update(files)

    def recorded(self, node_id: str | None) -> dict[str, int]:
        return dict(self.files.get(node_id, {}))

    def sweep(self, node_id: str | None, shm_dir: Path = SHM_DIR) -> dict[str, int]:
        """Unlink what the run's processes on ``node_id`` held and left; forget the node."""
        return unlink_recorded(self.files.pop(node_id, {}), shm_dir)


def _mapped(maps: Path, prefix: str) -> dict[str, int]:
    """From ``/proc/<pid>/maps`` lines ``addr perms offset dev inode path``."""
    out: dict[str, int] = {}
    try:
        text = maps.read_text()
    except OSError:
        return out
    if prefix not in text:  # the usual case: a torch process maps thousands of other files
        return out
    for line in text.splitlines():
        if prefix not in line:
            continue
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith(prefix) or parts[5].endswith("(deleted)"):
            continue
        name = parts[5][len(prefix) :]
        if "/" not in name:
            out[name] = int(parts[4])
    return out


def _open(fd_dir: Path, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
            if not target.startswith(prefix) or target.endswith("(deleted)"):
                continue
            name = target[len(prefix) :]
            if "/" not in name:
                out[name] = (fd_dir / fd).stat().st_ino
        except OSError:
            continue
    return out
