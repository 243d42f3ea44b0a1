"""Per-run cgroup v2 limits for the code sandbox: one cgroup per run with ``memory.max``,
``pids.max`` and ``cpu.max``, so the run's processes *together* stay within the limits (rlimits
are per process: without a cgroup, ``max_processes`` processes may each use ``memory_mb``).

Where it goes: the worker's own cgroup when its ``cgroup.subtree_control`` already enables
memory, pids and cpu (a delegated cgroup), else beside it (its parent enables what the worker's
``cgroup.controllers`` lists). :func:`find_parent` says where, or why not (no cgroup v2, a
hierarchy without those controllers such as cgroup v1 hosts, a read-only ``/sys/fs/cgroup`` in
a container); the sandbox then keeps the rlimits only and says so once.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import dataclass

NEEDED = ("memory", "pids", "cpu")
_names = itertools.count()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def find_parent(
    mountinfo: str | None = None, own_cgroup: str | None = None
) -> tuple[str | None, str]:
    """``(directory to create run cgroups in, "")`` or ``(None, why not)``. The arguments are
    the texts of ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` (read when None)."""
    if mountinfo is None:
        mountinfo = _read("/proc/self/mountinfo")
    if own_cgroup is None:
        own_cgroup = _read("/proc/self/cgroup")
    mount = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" in fields and fields[fields.index("-") + 1] == "cgroup2":
            mount = (fields[3], fields[4])  # (root within the hierarchy, mount point)
            break
    own = next((ln[3:] for ln in own_cgroup.splitlines() if ln.startswith("0::")), None)
    if mount is None or own is None:
        return None, "no cgroup v2 hierarchy is mounted (cgroup v1 or none)"
    root, point = mount
    if root != "/" and (own == root or own.startswith(root + "/")):
        own = own[len(root) :] or "/"
    own_dir = os.path.normpath(point + own)
    try:
        offered = _read(os.path.join(own_dir, "cgroup.controllers")).split()
        enabled = _read(os.path.join(own_dir, "cgroup.subtree_control")).split()
    except OSError as e:
        return None, f"cannot read the worker's cgroup {own_dir} ({e})"
    if missing := [c for c in NEEDED if c not in offered]:
        return None, (
            f"the cgroup v2 hierarchy at {point} offers {' '.join(offered) or 'no controller'} "
            f"to {own}; memory, pids, cpu are needed (missing: {', '.join(missing)})"
        )
    if all(c in enabled for c in NEEDED):
        parent = own_dir
    elif own != "/":
        parent = os.path.dirname(own_dir)
    else:
        return None, f"the root cgroup at {point} does not enable memory, pids and cpu"
    if not os.access(parent, os.W_OK):
        return None, f"{parent} is not writable (a read-only /sys/fs/cgroup?)"
    return parent, ""


@dataclass
class RunCgroup:
    """One run's cgroup: made before the launcher starts (it joins it first), removed after."""

    path: str

    @classmethod
    def create(cls, parent: str, limits) -> RunCgroup:
        """A new cgroup under ``parent`` with the limits of a
        :class:`~roll_ds.sandbox.limits.SandboxLimits`."""
        path = os.path.join(parent, f"roll_ds_sandbox-{os.getpid()}-{next(_names)}")
        os.mkdir(path)
        try:
            _write(os.path.join(path, "memory.max"), str(limits.memory_mb << 20))
            _write(os.path.join(path, "pids.max"), str(limits.max_processes + 1))  # + launcher
            _write(os.path.join(path, "cpu.max"), "100000 100000")  # one core
            with contextlib.suppress(OSError):  # only where swap is accounted
                _write(os.path.join(path, "memory.swap.max"), "0")
        except OSError:
            os.rmdir(path)
            raise
        return cls(path)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for ``memory.max``."""
        try:
            events = _read(os.path.join(self.path, "memory.events"))
        except OSError:
            return False
        counts = dict(line.split() for line in events.splitlines() if line.strip())
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill what is left in it (``cgroup.kill``, Linux >= 5.14) and remove it."""
        kill = os.path.join(self.path, "cgroup.kill")
        if os.path.exists(kill):
            with contextlib.suppress(OSError):
                _write(kill, "1")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while the killed processes exit
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
