"""DeepSpeed's just-in-time built ops (``deepspeed_shm_comm``, ``cpu_adam``, ...) without a silent
hang at start-up.

DeepSpeed builds an op the first time it loads it, through ``torch.utils.cpp_extension.load``,
which serialises builds with a ``FileBaton``: a file named ``lock`` in the op's build directory
(``$TORCH_EXTENSIONS_DIR/<op>/lock``, by default ``~/.cache/torch_extensions/py311_cpu/<op>/lock``),
created with ``O_CREAT | O_EXCL``, held open by the builder and removed when its build ends. A
process that finds the file waits while it exists: forever, printing nothing. A build killed
mid-way (Ctrl-C on a first run, an OOM kill, a CI timeout) leaves the file behind, and every later
start on the machine hung in ``deepspeed.init_distributed`` until someone removed it by hand.

A stale lock, told apart. The file holds no pid and its age says nothing (a build takes a minute
on a quiet box and several on a busy one). But the builder keeps the file open for its whole
build, and the kernel closes it when the builder dies, however it dies. So a lock that no process
has open (``/proc/<pid>/fd`` of the processes of the lock's owner) was left by a dead build. It is
looked at twice, a second apart, and must be the same file both times: torch closes the file just
before removing it, and a lock seen in that instant is a live build ending. Clearing runs under an
``flock`` of ``<root>/.roll_ds_lock_check`` (released by the kernel if the process dies) so two
ranks starting together never clear a lock the other has just taken. Where the holders cannot be
seen (another user's lock, no ``/proc``, a cache on a file system other machines mount: NFS,
Lustre, FUSE, ...) nothing is cleared, and the bounded wait's error names the lock. Not covered: a
local cache directory shared with another PID namespace (containers bind-mounting the same home),
whose builds are invisible here.

Where. ``init_distributed`` (every DeepSpeed rank's first step: DeepSpeed builds
``deepspeed_shm_comm`` there on CPU) first clears every stale lock under the extensions root
(``clear_stale_locks``), then runs DeepSpeed with its lock waits bounded (``bounded_op_builds``):
a wait on a live build's lock fails after ``ROLL_DS_OP_BUILD_TIMEOUT_S`` (900 s) naming the op,
the lock and the process holding it; a lock whose holder dies during the wait is cleared and the
load runs again (``load_ops``). The optimizer (``DeepSpeedCPUAdam``, ``FusedAdam``) and
``deepspeed.initialize`` run under the same bound (set the variable in a role's
``system_envs``).

Arch-specific CUDA targets. DeepSpeed 0.19.8 reads each ``TORCH_CUDA_ARCH_LIST`` entry's minor
version with ``int()``, so an entry such as ``9.0a`` (PyTorch's ``sm_90a``, which CUDA images for
Hopper set) fails every CUDA op build with ``invalid literal for int() with base 10: '0a'`` (seen
on an H100: FusedAdam fell back to torch's AdamW). ``load_ops`` builds with the letter suffixes
dropped (``9.0``: code every Hopper GPU runs) and restores the variable afterwards.

Not prebuilt by ``scripts/setup.sh``: measured on the 2-core box, ``cpu_adam`` took 2 min of CPU
(5.5 min wall with other work running) and ``deepspeed_shm_comm`` about 80 s wall, which would
double the setup for ops built on first use anyway (``cpu_adam`` only by the offload presets); and
a build at setup can be killed as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

OP_BUILD_TIMEOUT_S = 900.0  # a wait on another process's op build
OP_BUILD_TIMEOUT_ENV = "ROLL_DS_OP_BUILD_TIMEOUT_S"
LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton file in each op's build directory
CHECK_LOCK_NAME = ".roll_ds_lock_check"  # our flock while deciding whether a lock is stale
RECHECK_S = 1.0  # a stale lock is seen twice this far apart
STALE_POLL_S = 5.0  # how often a wait looks for a dead holder
LOAD_ATTEMPTS = 3
# File systems that other machines may mount as well: a build there may run on another machine.
SHARED_FILESYSTEMS = frozenset(
    ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
     "afs", "9p", "virtiofs", "fuse")
)  # fmt: skip


class OpBuildTimeout(TimeoutError):
    """A wait on another process's DeepSpeed op build passed its bound."""


class _LockCleared(BaseException):
    """A lock waited on was left by a dead build and has been removed: load again. A
    ``BaseException``, so that no ``except Exception`` on the way (DeepSpeed's, an optimizer
    fallback) takes it for a failed build."""


def extensions_root() -> Path:
    """Where torch builds extensions, as ``torch.utils.cpp_extension._get_build_directory``
    decides: ``$TORCH_EXTENSIONS_DIR``, else ``<default root>/py<ver>_<accelerator>``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{accelerator}"


def op_locks(root: Path | None = None) -> list[Path]:
    """The build locks present under the extensions root (one per op being built)."""
    root = extensions_root() if root is None else root
    return sorted(root.glob(f"*/{LOCK_NAME}"))


def filesystem_type(path: str, mounts: str) -> str | None:
    """The type of the file system holding ``path`` (absolute, resolved), read from a
    ``/proc/mounts`` text: the entry with the longest mount point above it."""
    best, found = -1, None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, found = len(point), fields[2]
    return found


def _shared_filesystem(path: str) -> bool:
    """``path`` is on a file system other machines may mount too (NFS, Lustre, FUSE, ...): their
    builds do not show in this machine's ``/proc``."""
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return True  # cannot tell
    kind = filesystem_type(path, mounts) or ""
    return kind in SHARED_FILESYSTEMS or kind.startswith("fuse.")


def lock_holders(lock: Path) -> list[int] | None:
    """Pids of the processes that have ``lock`` open; None when that cannot be told (no
    ``/proc``, a lock owned by another user whose processes this one cannot read, or a lock on
    a file system other machines share)."""
    try:
        owner = lock.stat().st_uid
    except FileNotFoundError:
        return []
    target = os.path.realpath(lock)
    if not Path("/proc/self/fd").is_dir() or os.geteuid() not in (0, owner):
        return None
    if _shared_filesystem(target):
        return None
    holders = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != owner:
                continue  # the builder created the file: it runs as its owner
            fds = os.scandir(f"/proc/{entry.name}/fd")
            with fds:
                if any(_link(fd.path) == target for fd in fds):
                    holders.append(int(entry.name))
        except FileNotFoundError:
            continue  # the process ended during the scan
        except PermissionError:
            if os.geteuid() == 0:
                continue
            return None  # a process of the owner we cannot read (not dumpable): cannot tell
    return holders


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _unheld(lock: Path, recheck_s: float) -> bool:
    """No process holds ``lock``, the same file looked at twice ``recheck_s`` apart."""
    try:
        first = lock.stat().st_ino
        if lock_holders(lock) != []:
            return False
        time.sleep(recheck_s)
        return lock.stat().st_ino == first and lock_holders(lock) == []
    except FileNotFoundError:
        return False


def clear_if_stale(lock: Path, recheck_s: float = RECHECK_S) -> bool:
    """Remove ``lock`` when no process holds it (``_unheld``); True when it was removed. Logs a
    warning naming the op and the lock."""
    try:
        guard = open(lock.parent.parent / CHECK_LOCK_NAME, "a")  # noqa: SIM115
    except OSError:
        return False  # a root this process cannot write to: it cannot build there either
    with guard:
        # one process decides at a time; the kernel drops an flock whose process dies
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not _unheld(lock, recheck_s):
            return False
        try:
            lock.unlink()
        except FileNotFoundError:
            return False
    logger.warning(
        "removed %s: the build lock of DeepSpeed op %r, left by a build that died (no process "
        "holds it); the op is built again",
        lock,
        lock.parent.name,
    )
    return True


def clear_stale_locks(root: Path | None = None, recheck_s: float = RECHECK_S) -> list[Path]:
    """Remove every stale build lock under the extensions root (see the module docstring);
    returns the ones removed."""
    return [lock for lock in op_locks(root) if clear_if_stale(lock, recheck_s)]


def op_build_timeout_s() -> float:
    return float(os.environ.get(OP_BUILD_TIMEOUT_ENV, OP_BUILD_TIMEOUT_S))


def wait_for_lock(
    lock: Path, timeout_s: float, poll_s: float = 0.1, stale_poll_s: float = STALE_POLL_S
) -> None:
    """What a process does while another builds: wait until ``lock`` is gone. Raises
    ``_LockCleared`` when its holder died (the lock is removed), ``OpBuildTimeout`` past
    ``timeout_s``, naming the op, the lock and its holder."""
    start = time.monotonic()
    next_check = start + min(stale_poll_s, timeout_s)
    while lock.exists():
        now = time.monotonic()
        if now >= next_check:
            if clear_if_stale(lock):
                raise _LockCleared(lock)
            next_check = time.monotonic() + stale_poll_s
        if now - start >= timeout_s:
            holders = lock_holders(lock)
            if holders is None:
                who = "by a process this one cannot see (if no build is running, remove it)"
            else:
                who = f"by pid {', '.join(map(str, holders))}" if holders else "until just now"
            raise OpBuildTimeout(
                f"DeepSpeed op {lock.parent.name!r}: waited {timeout_s:g} s for another process "
                f"to build it; its build lock {lock} is held {who}. Raise {OP_BUILD_TIMEOUT_ENV} "
                "if builds take longer here, or stop that process"
            )
        time.sleep(poll_s)


@contextlib.contextmanager
def bounded_op_builds(timeout_s: float | None = None) -> Iterator[None]:
    """Within the block, torch's wait on an extension build lock is ``wait_for_lock``:
    bounded, and aware of a dead holder."""
    from torch.utils import file_baton

    bound = op_build_timeout_s() if timeout_s is None else timeout_s
    original = file_baton.FileBaton.wait

    def wait(baton: file_baton.FileBaton) -> None:
        wait_for_lock(Path(baton.lock_file_path), bound, poll_s=baton.wait_seconds)

    file_baton.FileBaton.wait = wait
    try:
        yield
    finally:
        file_baton.FileBaton.wait = original


ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"
_ARCH_SUFFIX = re.compile(r"\b(\d+\.\d+)[a-z]\b")  # 9.0a, 10.0f, ... (not the +PTX marker)


def generic_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` with arch-specific suffixes dropped: ``"8.0;9.0a+PTX"`` ->
    ``"8.0;9.0+PTX"`` (see the module doc)."""
    return _ARCH_SUFFIX.sub(r"\1", value)


@contextlib.contextmanager
def arch_list_deepspeed_parses() -> Iterator[None]:
    """``TORCH_CUDA_ARCH_LIST`` without arch-specific suffixes inside, as it was after (DeepSpeed
    also rewrites it while it builds)."""
    before = os.environ.get(ARCH_LIST_ENV)
    if before is None or generic_arch_list(before) == before:
        yield
        return
    os.environ[ARCH_LIST_ENV] = generic_arch_list(before)
    logger.info(
        "building DeepSpeed ops with %s=%s (was %s)",
        ARCH_LIST_ENV,
        generic_arch_list(before),
        before,
    )
    try:
        yield
    finally:
        os.environ[ARCH_LIST_ENV] = before


def load_ops(fn: Callable[[], T], *, retry: bool = True, timeout_s: float | None = None) -> T:
    """``fn()`` (a call that may build DeepSpeed ops) with stale locks cleared first, lock
    waits bounded and a ``TORCH_CUDA_ARCH_LIST`` DeepSpeed can parse. ``retry``: call ``fn``
    again when a lock it waited on was left by a dead build (only for calls that leave nothing
    behind when they fail)."""
    clear_stale_locks()
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            with bounded_op_builds(timeout_s), arch_list_deepspeed_parses():
                return fn()
        except _LockCleared as cleared:
            if not retry or attempt == LOAD_ATTEMPTS:
                raise RuntimeError(
                    f"DeepSpeed op {cleared.args[0].parent.name!r}: the build it waited for died "
                    f"and its lock {cleared.args[0]} was removed; start again to build it"
                ) from None
    raise AssertionError("unreachable")
