"""The in-sandbox half of :mod:`roll_ds.rewards.sandbox`: isolates itself, then runs the program.

Run by the sandbox as ``python -I -S -B sandbox_launcher.py STATUS_FD CONFIG_JSON`` in a fresh
session (its own process group); it imports only the standard library because ``-I -S`` leaves
``roll_ds`` and site-packages off ``sys.path``. Python 3.11 has no ``os.unshare``, hence ctypes.

Steps (each failure is reported on the status pipe as ``{"event": "error", "stage": ...}``):

1. ``PR_SET_PDEATHSIG``: if the reward worker's thread dies, so does this launcher (and, by
   step 5's death signal, the program and its namespace).
2. Read the program and open its stdin from the host work dir.
3. Namespaces (``"namespaces": true``). As root: a private mount namespace in which the home
   directory (and any directory the sandbox user cannot enter on the way to the interpreter) is
   covered by an empty tmpfs with only the interpreter's prefix bound back, every mount is made
   read-only, and the work dir becomes a small tmpfs; then drop to the sandbox uid/gid. Then, as
   that unprivileged user: new user, mount, pid and (``"net": true``) network namespaces. Not
   root: the same, all inside the new user namespace. The user namespace makes RLIMIT_NPROC
   count only this sandbox's processes (the kernel counts processes per user *per user
   namespace*), so a fork bomb hits its own limit without touching the host's budget.
4. Fork the program as pid 1 of the new pid namespace: when it exits or is killed, the kernel
   kills every process left in the namespace, including ones that left the process group with
   ``setsid``. It mounts a fresh /proc (host processes and their environments are invisible),
   writes ``main.py`` into the tmpfs work dir, sets the rlimits and ``PR_SET_NO_NEW_PRIVS``, and
   execs ``python -I -S -B main.py`` with a minimal environment.
5. Wait for it and report its wait status and CPU time. SIGTERM to the launcher kills the
   program first (how the sandbox stops a run that is over time or over its output cap).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    ret = libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data or None))
    _check(ret, f"mount {fstype or source} on {target}")


def unshare(flags: int) -> None:
    _check(libc.unshare(ctypes.c_int(flags)), "unshare")


def prctl(option: int, arg: int) -> None:
    _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_user_namespace(flags: int) -> None:
    """New user namespace (plus ``flags``) that maps only our own uid/gid onto themselves."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER | flags)
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/uid_map", f"{uid} {uid} 1")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1")


def hide(path: str, keep: list[str], make: list[str]) -> None:
    """Cover ``path`` with an empty tmpfs, binding back the directories in ``keep`` below it and
    creating the (mount point) directories in ``make``."""
    fds = [os.open(k, os.O_PATH | os.O_DIRECTORY) for k in keep]
    try:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for k, fd in zip(keep, fds, strict=True):
            os.makedirs(k, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
        for m in make:
            os.makedirs(m, mode=0o755, exist_ok=True)
    finally:
        for fd in fds:
            os.close(fd)


def _mount_setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    attr = MountAttr(attr_set, attr_clr, 0, 0)
    ret = libc.syscall(
        SYS_MOUNT_SETATTR,
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, f"mount_setattr({path})")


def read_only_everywhere() -> None:
    """Every mount read-only (recursively, ``mount_setattr``; Linux >= 5.12), except /proc
    itself: the uid/gid maps of the user namespace are written there (the program gets a fresh
    read-only procfs of its own)."""
    _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
    _mount_setattr("/proc", 0, 0, MOUNT_ATTR_RDONLY)


def private_filesystem(cfg: dict, owner: tuple[int, int] | None) -> None:
    """In the current (new) mount namespace: hide directories, read-only everything, and a
    size-limited tmpfs on the work dir (owned by ``owner`` when given)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for h in cfg["hide"]:
        hide(h["path"], h["keep"], h["make"])
    read_only_everywhere()
    opts = f"size={cfg['workdir_mb']}m,mode=0700"
    if owner is not None:
        opts += f",uid={owner[0]},gid={owner[1]}"
    mount("tmpfs", cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, opts)


def isolate(cfg: dict) -> list[str]:
    """Step 3 of the module doc; returns the namespaces entered."""
    extra = CLONE_NEWNET if cfg["net"] else 0
    names = ["user", "mount", "pid"] + (["net"] if cfg["net"] else [])
    if os.geteuid() == 0:
        uid, gid = cfg["uid"], cfg["gid"]
        unshare(CLONE_NEWNS)
        private_filesystem(cfg, owner=(uid, gid))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        prctl(PR_SET_DUMPABLE, 1)  # a uid change clears it; /proc/self/*_map need it
        enter_user_namespace(CLONE_NEWNS | CLONE_NEWPID | extra)
    else:
        enter_user_namespace(CLONE_NEWNS | CLONE_NEWPID | extra)
        private_filesystem(cfg, owner=None)
    return names


def set_limits(limits: dict) -> None:
    # CPU: soft == hard, so the kernel sends SIGKILL (pid 1 of a namespace ignores SIGXCPU).
    for name, value in (
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_AS", limits["memory_mb"] << 20),
        ("RLIMIT_FSIZE", limits["file_size_mb"] << 20),
        ("RLIMIT_NPROC", limits["nproc"]),
        ("RLIMIT_NOFILE", limits["nofile"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def run_program(cfg: dict, status_fd: int, source: bytes, stdin_fd: int, namespaced: bool) -> None:
    """Step 4, in the forked child; never returns."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if namespaced:
            try:
                mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:  # the kernel refuses a new procfs: hide the host's instead
                mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
        os.chdir(cfg["workdir"])
        fd = os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, source)
        os.close(fd)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        set_limits(cfg["limits"])
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        python = cfg["python"]
        os.execve(python, [python, "-I", "-S", "-B", "main.py"], cfg["env"])
    except BaseException as e:  # report anything, then die
        _report(status_fd, {"event": "error", "stage": "exec", "error": f"{type(e).__name__}: {e}"})
    os._exit(127)


def _report(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def main() -> int:
    status_fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    os.set_inheritable(status_fd, False)  # the program must not inherit it
    stage = "start"
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != cfg["parent_pid"]:  # the parent died before the line above
            return 1
        workdir = cfg["workdir"]
        with open(os.path.join(workdir, "main.py"), "rb") as f:
            source = f.read()
        stdin_fd = os.open(os.path.join(workdir, "stdin.txt"), os.O_RDONLY)
        namespaces: list[str] = []
        if cfg["namespaces"]:
            stage = "namespaces"
            namespaces = isolate(cfg)
        stage = "fork"
        # The sandbox stops a run with SIGTERM: kill the program (its namespace dies with it),
        # then reap and report as usual. The child is unreaped, so its pid cannot be reused.
        # SIGTERM stays blocked until the handler knows the pid: this launcher cannot die
        # between the fork and the child's PR_SET_PDEATHSIG.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            run_program(cfg, status_fd, source, stdin_fd, bool(namespaces))
        signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.close(stdin_fd)
        try:  # lets a caller check that nothing of the namespace outlives the run
            pid_ns = os.readlink(f"/proc/{pid}/ns/pid") if namespaces else None
        except OSError:
            pid_ns = None
        started = {"event": "started", "pid": pid, "pid_ns": pid_ns, "namespaces": namespaces}
        _report(status_fd, started)
        _, status, usage = os.wait4(pid, 0)
        cpu_s = usage.ru_utime + usage.ru_stime
        _report(status_fd, {"event": "exit", "status": status, "cpu_s": cpu_s})
        return 0
    except BaseException as e:
        _report(status_fd, {"event": "error", "stage": stage, "error": f"{type(e).__name__}: {e}"})
        return 3


if __name__ == "__main__":
    sys.exit(main())
