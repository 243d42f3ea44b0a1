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
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PROC = Path("/proc")


def process_tree(roots: Iterable[int], proc: Path = PROC) -> set[int]:
    """``roots`` and every live descendant of them (vLLM's worker processes, the engine core,
    the resource tracker are children of the actor process)."""
    children: dict[int, list[int]] = {}
    for entry in _pid_dirs(proc):
        ppid = _parent(proc / entry)
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry))
    seen: set[int] = set()
    todo = [p for p in roots if (proc / str(p)).exists()]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return seen


def descendants(pid: int, proc: Path = PROC) -> dict[int, int]:
    """``pid``'s live descendants, each with its start time (``/proc/<pid>/stat`` field 22):
    what tells a process from a later one that reuses its pid."""
    tree = process_tree([pid], proc) - {pid}
    return {p: t for p in tree if (t := start_time(p, proc)) is not None}


def start_time(pid: int, proc: Path = PROC) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # from field 3 (state) on
    return int(fields[19]) if len(fields) > 19 else None


def end_processes(recorded: Mapping[int, int], proc: Path = PROC) -> list[int]:
    """SIGKILL the ``recorded`` processes (pid -> start time) that are still those processes:
    the children a killed actor left (vLLM's engine core, which holds its KV cache and message
    queues, has no parent left to stop it). Returns the pids killed."""
    killed = []
    for pid, started in recorded.items():
        if start_time(pid, proc) != started:
            continue  # gone, or the pid is another process's now
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return killed


def running(pid: int, started: int | None = None, proc: Path = PROC) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it holds no memory, no GPU context,
    and a parent that never reaps it must not hold anything up) and, with ``started``, still
    the process that started then."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return False
    return started is None or (len(fields) > 19 and int(fields[19]) == started)


def wait_ended(
    recorded: Mapping[int, int | None], timeout_s: float, proc: Path = PROC, poll_s: float = 0.05
) -> list[int]:
    """Wait up to ``timeout_s`` until none of ``recorded`` (pid -> start time, None: any) runs;
    returns the pids still running then (``[]``: all gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, started in recorded.items() if running(pid, started, proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(poll_s)


def end_and_wait(
    recorded: Mapping[int, int], timeout_s: float, proc: Path = PROC
) -> tuple[list[int], list[int]]:
    """``end_processes``, then wait (bounded) until the killed processes are gone: a SIGKILLed
    process still frees its memory (a GPU's too) on its way out. ``(killed, still running)``."""
    killed = end_processes(recorded, proc)
    return killed, wait_ended({pid: recorded[pid] for pid in killed}, timeout_s, proc)


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
    return held_files(process_tree(pids, proc), shm_dir, proc)


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


def _pid_dirs(proc: Path) -> list[str]:
    try:
        return [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:  # no /proc (not Linux): nothing to record
        return []


def _parent(pid_dir: Path) -> int | None:
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


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
