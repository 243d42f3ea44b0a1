"""The sandbox's launcher, between :mod:`roll_ds.sandbox.run` and the program: it starts the
program under bubblewrap (``bwrap``), then reports and waits for it.

Run by the sandbox as ``python -I -S -B launcher.py STATUS_FD CONFIG_JSON`` in a fresh
session (its own process group); it imports only the standard library because ``-I -S`` leaves
``roll_ds`` and site-packages off ``sys.path``. It runs under the interpreter the program will
run under, so it finds that interpreter's files (executable, standard library, ``libpython``)
from its own ``sys`` / ``sysconfig``.

Steps (each failure is reported on the status pipe as ``{"event": "error", "stage": ...}``):

1. ``PR_SET_PDEATHSIG``: if the reward worker's thread dies, so does this launcher (and, by
   bwrap's ``--die-with-parent``, the program and its namespaces).
2. Open the program and its stdin from the host work dir; join the run's cgroup (when the
   sandbox made one).
3. Drop privileges: as root, become ``uid`` / ``gid`` with no supplementary groups, in every
   mode. Nothing below needs a privilege of the host: root without CAP_SYS_ADMIN works.
4. Namespaces (``"namespaces": true``): fork and exec ``bwrap`` (:func:`bwrap_argv`): new user
   (the uid / gid mapped onto themselves), mount, pid, IPC, UTS, cgroup and (``"net": true``)
   network namespaces; a read-only root of its own with the interpreter, the system's shared
   libraries, ``/dev`` (bwrap's minimal one), a fresh ``/proc`` and the work dir, a tmpfs of
   ``workdir_mb`` holding ``main.py``; the program is pid 1 of its pid namespace
   (``--as-pid-1``): when it exits or is killed the kernel kills every process left in the
   namespace. bwrap holds the program before its exec (``--block-fd``) while this launcher sets
   its rlimits (``prlimit``: inside the new user namespace, RLIMIT_NPROC counts only the
   sandbox's processes), then loads the seccomp filter (``--seccomp``,
   :mod:`roll_ds.sandbox.seccomp`, built by the sandbox) and execs ``python -I -S -B main.py``
   with a minimal environment. Without namespaces (``best_effort`` where the kernel refuses
   them) the program runs in the host's file system as the dropped user, its rlimits set before
   its exec.
5. Wait for it and report its exit status and CPU time. SIGTERM to the launcher kills the
   program first (how the sandbox stops a run that is over time or over its output cap).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import sysconfig

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
#: the shared libraries' directories (a symlink to another, with usrmerge, is kept as one)
LIB_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")
#: bwrap's exit status for a program killed by signal n (as a shell reports it)
SIGNAL_EXIT_BASE = 128

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int) -> None:
    _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def drop_privileges(uid: int, gid: int) -> None:
    """Root becomes ``uid`` / ``gid`` with no supplementary groups (needs CAP_SETUID/SETGID
    only); anyone else stays who they are."""
    if os.geteuid() != 0:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    prctl(PR_SET_DUMPABLE, 1)  # a uid change clears it; /proc/self/*_map need it


def interpreter_files() -> dict:
    """What this interpreter needs, found from itself: ``anchor`` (the directory they share,
    entered before the privilege drop), ``binds`` (host paths bound at the same path),
    ``links`` (symlinks among the library dirs) and ``empty`` (site-packages, covered)."""
    exe = os.path.realpath(sys.executable)
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}  # never a venv's
    own = [exe, stdlib, os.path.realpath(sysconfig.get_path("platstdlib", vars=base))]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):  # libpython, by the name the linker uses
        libdir = os.path.realpath(sysconfig.get_config_var("LIBDIR"))
        lib = os.path.join(libdir, sysconfig.get_config_var("INSTSONAME"))
        if os.path.exists(lib):
            own.append(lib)
    links, binds = {}, []
    for d in LIB_DIRS:
        if os.path.islink(d):
            links[d] = os.readlink(d)
        elif os.path.isdir(d):
            binds.append(d)
    binds += [p for p in dict.fromkeys(own) if not any(_inside(p, b) for b in binds)]
    site = os.path.join(stdlib, "site-packages")
    return {
        "exe": exe,
        "anchor": os.path.commonpath(own),
        "binds": binds,
        "links": links,
        "empty": [site] if os.path.isdir(site) else [],
    }


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def bwrap_argv(cfg: dict, files: dict, fds: dict) -> list[str]:
    """bwrap's command line (step 4 of the module doc); ``fds``: the descriptors it reads
    (``seccomp``, ``status``, ``block``, ``main``, all inherited)."""
    workdir = cfg["workdir"]
    argv = [cfg["bwrap"], "--unshare-all", "--unshare-user"]  # the user namespace required
    if not cfg["net"]:
        argv.append("--share-net")
    argv += ["--die-with-parent", "--as-pid-1"]
    for path in files["binds"]:
        argv += ["--ro-bind", path, path]
    for path, target in files["links"].items():
        argv += ["--symlink", target, path]
    for path in files["empty"]:  # site-packages: covered, empty and read-only
        small = ["--size", "4096"] if cfg["sized"] else []
        argv += ["--perms", "0555", *small, "--tmpfs", path, "--remount-ro", path]
    argv += ["--dev", "/dev", "--remount-ro", "/dev"]
    if cfg["proc"]:
        argv += ["--proc", "/proc", "--remount-ro", "/proc"]
    else:  # refused under a container's masked /proc: none
        argv += ["--dir", "/proc"]
    size = ["--size", str(cfg["workdir_mb"] << 20)] if cfg["sized"] else []  # bwrap >= 0.7
    argv += ["--perms", "0700", *size, "--tmpfs", workdir]
    argv += ["--perms", "0600", "--file", str(fds["main"]), os.path.join(workdir, "main.py")]
    argv += ["--remount-ro", "/", "--chdir", workdir, "--clearenv"]
    for name, value in cfg["env"].items():
        argv += ["--setenv", name, value]
    argv += ["--seccomp", str(fds["seccomp"]), "--json-status-fd", str(fds["status"])]
    argv += ["--block-fd", str(fds["block"])]
    return [*argv, "--", cfg["python"], "-I", "-S", "-B", "main.py"]


def set_limits(limits: dict, pid: int = 0) -> None:
    """The program's rlimits, on ``pid`` (0: this process)."""
    # CPU: soft == hard, so the kernel sends SIGKILL (pid 1 of a namespace ignores SIGXCPU).
    for name, value in (
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_AS", limits["memory_mb"] << 20),
        ("RLIMIT_FSIZE", limits["file_size_mb"] << 20),
        ("RLIMIT_NPROC", limits["nproc"]),
        ("RLIMIT_NOFILE", limits["nofile"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.prlimit(pid, getattr(resource, name), (value, value))


def _report(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _seccomp_fd(program: bytes) -> int:
    fd = os.memfd_create("roll_ds_seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_child_pid(fd: int) -> int | None:
    """bwrap's first status document (``{"child-pid": N, ...}``), None when bwrap ends first."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    return int(json.loads(data.split(b"\n", 1)[0])["child-pid"])


class Child:
    """The launcher's child (bwrap, or the program itself without namespaces) and, once known,
    the program's host pid; SIGTERM to the launcher kills the child (the program dies with
    bwrap: ``--die-with-parent``). The child is unreaped until :meth:`wait`, so its pid cannot
    be reused."""

    def __init__(self) -> None:
        self.pid = 0
        self.block_w: int | None = None  # bwrap waits on it before the exec (namespaces)
        self.status_r: int | None = None  # bwrap's JSON status documents (namespaces)

    def release(self) -> None:
        """Let bwrap exec the program."""
        if self.block_w is not None:
            os.write(self.block_w, b"x")
            os.close(self.block_w)
            self.block_w = None

    def kill(self, *_: object) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):  # it may have just died (CPU limit)
                os.kill(self.pid, signal.SIGKILL)


def _fork(child: Child, exec_child) -> None:
    """Fork ``exec_child`` (never returns) as ``child``. SIGTERM stays blocked until the
    handler knows the pid: this launcher cannot die between the fork and the child's
    PR_SET_PDEATHSIG."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        exec_child()
    child.pid = pid
    signal.signal(signal.SIGTERM, child.kill)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _exec(status_fd: int, stdin_fd: int, argv: list[str], env: dict, setup=None) -> None:
    """In the forked child: stdin, optional ``setup``, exec; never returns."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.dup2(stdin_fd, 0)
        if setup is not None:
            setup()
        os.execve(argv[0], argv, env)
    except BaseException as e:  # report anything, then die
        _report(status_fd, {"event": "error", "stage": "exec", "error": f"{type(e).__name__}: {e}"})
    os._exit(127)


def start_bwrap(
    cfg: dict, status_fd: int, stdin_fd: int, main_fd: int, child: Child
) -> tuple[int, str | None]:
    """Step 4: bwrap started and holding the program before its exec (``child.release``),
    the program's rlimits set; returns the program's host pid and pid namespace."""
    seccomp = _seccomp_fd(bytes.fromhex(cfg["seccomp"]))
    status_r, status_w = os.pipe()
    block_r, block_w = os.pipe()
    fds = {"seccomp": seccomp, "status": status_w, "block": block_r, "main": main_fd}
    for fd in fds.values():
        os.set_inheritable(fd, True)
    argv = bwrap_argv(cfg, interpreter_files(), fds)
    _fork(child, lambda: _exec(status_fd, stdin_fd, argv, {"PATH": "/usr/bin:/bin"}))
    for fd in fds.values():
        os.close(fd)
    child.status_r = status_r
    try:
        pid = _read_child_pid(status_r)
        if pid is None:
            raise RuntimeError("bwrap ended before it started the program (its message: stderr)")
        set_limits(cfg["limits"], pid)
        try:  # lets a caller check that nothing of the namespace outlives the run
            pid_ns = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            pid_ns = None
    except BaseException:
        child.kill()  # first: bwrap goes on to the exec once block_w closes
        os.close(block_w)
        raise
    child.block_w = block_w
    return pid, pid_ns


def program_ran(status_r: int) -> bool:
    """Whether bwrap exec'd the program: it writes ``{"exit-code": N}`` then, and only then
    (a failure in its setup after the child started, e.g. a mount, does not)."""
    os.set_blocking(status_r, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(status_r, 4096):
            data += chunk
    os.close(status_r)
    return b'"exit-code"' in data


def exit_event(status: int, usage, bwrap: bool) -> dict:
    """The program's exit code or signal from a wait status (bwrap's exit status for a program
    killed by signal n is 128 + n)."""
    cpu_s = usage.ru_utime + usage.ru_stime
    code = sig = None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
        if bwrap and SIGNAL_EXIT_BASE < code <= SIGNAL_EXIT_BASE + signal.NSIG:
            code, sig = None, code - SIGNAL_EXIT_BASE
    return {"event": "exit", "exit_code": code, "signal": sig, "cpu_s": cpu_s}


def main() -> int:
    status_fd, cfg = int(sys.argv[1]), json.loads(sys.argv[2])
    os.set_inheritable(status_fd, False)  # the program must not inherit it
    stage = "start"
    child = Child()
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != cfg["parent_pid"]:  # the parent died before the line above
            return 1
        workdir = cfg["workdir"]
        stdin_fd = os.open(os.path.join(workdir, "stdin.txt"), os.O_RDONLY)
        if cfg["cgroup"]:
            stage = "cgroup"
            write_file(os.path.join(cfg["cgroup"], "cgroup.procs"), str(os.getpid()))
        namespaces: list[str] = []
        if cfg["namespaces"]:
            stage = "namespaces"
            os.chdir("/")
            main_fd = os.open(os.path.join(workdir, "main.py"), os.O_RDONLY)
            drop_privileges(cfg["uid"], cfg["gid"])
            pid, pid_ns = start_bwrap(cfg, status_fd, stdin_fd, main_fd, child)
            namespaces = ["user", "mount", "pid", "ipc", "uts"] + (["net"] if cfg["net"] else [])
        else:
            stage = "fork"
            if os.geteuid() == 0:  # the program runs as the sandbox user in the host's files
                os.chown(workdir, cfg["uid"], cfg["gid"])
                os.chown(os.path.join(workdir, "main.py"), cfg["uid"], cfg["gid"])

            def setup() -> None:
                drop_privileges(cfg["uid"], cfg["gid"])
                os.chdir(workdir)
                set_limits(cfg["limits"])
                prctl(PR_SET_NO_NEW_PRIVS, 1)

            python = cfg["python"]
            argv = [python, "-I", "-S", "-B", "main.py"]
            _fork(child, lambda: _exec(status_fd, stdin_fd, argv, cfg["env"], setup))
            pid, pid_ns = child.pid, None
        os.close(stdin_fd)
        started = {"event": "started", "pid": pid, "pid_ns": pid_ns, "namespaces": namespaces}
        _report(status_fd, started)
        child.release()  # the program may exec now (its clock runs from "started")
        stage = "wait"
        _, status, usage = os.wait4(child.pid, 0)
        # The program is reaped: a stop that comes now (the run's wall-clock deadline racing its
        # CPU limit) has nothing left to kill and must not turn the exit into an error.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ran = child.status_r is None or program_ran(child.status_r)
        if not ran and os.WIFEXITED(status):  # not killed by the sandbox's stop: bwrap failed
            stage = "exec"
            code = os.WEXITSTATUS(status)
            raise RuntimeError(f"bwrap could not start the program (exit {code}; stderr)")
        _report(status_fd, exit_event(status, usage, bool(cfg["namespaces"])))
        return 0
    except BaseException as e:
        _report(status_fd, {"event": "error", "stage": stage, "error": f"{type(e).__name__}: {e}"})
        child.kill()
        return 3


if __name__ == "__main__":
    sys.exit(main())
