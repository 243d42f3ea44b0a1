"""The in-sandbox half of :mod:`roll_ds.sandbox.run`: isolates itself, then runs the program.

Run by the sandbox as ``python -I -S -B launcher.py STATUS_FD CONFIG_JSON`` in a fresh
session (its own process group); it imports only the standard library because ``-I -S`` leaves
``roll_ds`` and site-packages off ``sys.path``. Python 3.11 has no ``os.unshare``, hence ctypes.
It runs under the interpreter the program will run under, so it finds that interpreter's files
(executable, standard library, ``libpython``) from its own ``sys`` / ``sysconfig``.

Steps (each failure is reported on the status pipe as ``{"event": "error", "stage": ...}``):

1. ``PR_SET_PDEATHSIG``: if the reward worker's thread dies, so does this launcher (and, by
   step 5's death signal, the program and its namespaces).
2. Read the program and open its stdin from the host work dir; join the run's cgroup (when the
   sandbox made one).
3. Drop privileges: as root, become ``uid`` / ``gid`` with no supplementary groups, in every
   mode (first ``chdir`` into the interpreter's prefix, which may sit under a directory that
   user cannot enter, such as ``/root``: mounts below reach it relative to the working
   directory). Nothing below needs a privilege of the host: root without CAP_SYS_ADMIN works.
4. Namespaces (``"namespaces": true``): new user (mapping only that uid / gid onto itself),
   mount, pid, IPC and (``"net": true``) network namespaces. The user namespace makes
   RLIMIT_NPROC count only this sandbox's processes (the kernel counts processes per user *per
   user namespace*); the IPC namespace takes System V shared memory, semaphores and message
   queues with it. In the mount namespace a minimal root is built on a tmpfs (see
   :func:`build_root`): the interpreter, the system's shared libraries, four devices, an empty
   ``/proc`` mount point and the work dir, all read-only except the work dir.
5. Fork the program as pid 1 of the new pid namespace: when it exits or is killed, the kernel
   kills every process left in the namespace, including ones that left the process group with
   ``setsid``. It mounts a fresh read-only /proc in the new root (only the sandbox's processes),
   switches to its own mount namespace and ``pivot_root``s into the new root, detaching the
   host's file system; writes ``main.py`` into the work dir, sets the rlimits and
   ``PR_SET_NO_NEW_PRIVS``, and execs ``python -I -S -B main.py`` with a minimal environment.
   Without namespaces (``best_effort`` where the kernel refuses them) it runs in the host's
   file system as the dropped user.
6. Wait for it and report its wait status and CPU time. SIGTERM to the launcher kills the
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

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
#: the shared libraries' directories (a symlink to another, with usrmerge, is kept as one)
LIB_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")
DEVICES = ("null", "zero", "random", "urandom")
#: where the new root is built (a directory every user can reach; covered in the namespace only)
NEW_ROOT = "/tmp"

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


def drop_privileges(uid: int, gid: int) -> None:
    """Root becomes ``uid`` / ``gid`` with no supplementary groups (needs CAP_SETUID/SETGID
    only); anyone else stays who they are."""
    if os.geteuid() != 0:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    prctl(PR_SET_DUMPABLE, 1)  # a uid change clears it; /proc/self/*_map need it


def enter_user_namespace(flags: int) -> None:
    """New user namespace (plus ``flags``) that maps only our own uid/gid onto themselves."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER | flags)
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/uid_map", f"{uid} {uid} 1")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1")


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


def _mount_point(path: str, like: str) -> None:
    """Create ``path`` as a directory, or an empty file when ``like`` is not a directory."""
    if os.path.isdir(like):
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def build_root(cfg: dict, files: dict) -> str:
    """In the current (new) mount namespace: a minimal root on a tmpfs over :data:`NEW_ROOT`,
    returned for :func:`enter_root`; the work dir keeps its host path in it. Host paths below
    the anchor are named relative to the working directory (the anchor), so the dropped user
    needs no access to the anchor's ancestors."""
    new, anchor = NEW_ROOT, files["anchor"]

    def source(path: str) -> str:
        return os.path.relpath(path, anchor) if _inside(path, anchor) else path

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in files["binds"]:
        _mount_point(new + path, source(path))
        mount(source(path), new + path, None, MS_BIND | MS_REC)
    for path, target in files["links"].items():
        os.makedirs(os.path.dirname(new + path), mode=0o755, exist_ok=True)
        os.symlink(target, new + path)
    for path in files["empty"]:
        mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    os.makedirs(new + "/dev", mode=0o755)
    for name in DEVICES:
        _mount_point(f"{new}/dev/{name}", f"/dev/{name}")
        mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{new}/dev/{name}")
    os.symlink("/proc/self/fd/1", f"{new}/dev/stdout")
    os.symlink("/proc/self/fd/2", f"{new}/dev/stderr")
    os.makedirs(new + "/proc", mode=0o555)
    os.makedirs(new + cfg["workdir"], mode=0o755)
    _mount_setattr(new, AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
    opts = f"size={cfg['workdir_mb']}m,mode=0700"
    mount("tmpfs", new + cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, opts)
    return new


def enter_root(new: str) -> None:
    """In the program's process (pid 1 of the pid namespace): a fresh /proc in the new root,
    then its own mount namespace whose root is the new root; the host's is detached."""
    with contextlib.suppress(OSError):  # refused under a container's masked /proc: none
        mount("proc", new + "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    unshare(CLONE_NEWNS)  # the launcher keeps the host's root
    os.chdir(new)
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root")
    os.chdir("/")


def isolate(cfg: dict, files: dict) -> tuple[list[str], str]:
    """Steps 3 and 4 of the module doc: the namespaces entered and the new root."""
    extra = CLONE_NEWNET if cfg["net"] else 0
    os.chdir(files["anchor"])
    drop_privileges(cfg["uid"], cfg["gid"])
    enter_user_namespace(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | extra)
    root = build_root(cfg, files)
    return ["user", "mount", "pid", "ipc"] + (["net"] if cfg["net"] else []), root


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


def run_program(cfg: dict, status_fd: int, source: bytes, stdin_fd: int, root: str | None) -> None:
    """Step 5, in the forked child; never returns."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if root is not None:
            enter_root(root)
        else:
            drop_privileges(cfg["uid"], cfg["gid"])
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
        if cfg["cgroup"]:
            stage = "cgroup"
            write_file(os.path.join(cfg["cgroup"], "cgroup.procs"), str(os.getpid()))
        namespaces: list[str] = []
        root = None
        if cfg["namespaces"]:
            stage = "namespaces"
            namespaces, root = isolate(cfg, interpreter_files())
        elif os.geteuid() == 0:  # the program drops to the sandbox user in the host's files
            os.chown(workdir, cfg["uid"], cfg["gid"])
            os.unlink(os.path.join(workdir, "main.py"))  # it writes its own copy
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
            run_program(cfg, status_fd, source, stdin_fd, root)
        signal.signal(signal.SIGTERM, lambda *_: _kill(pid))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.close(stdin_fd)
        try:  # lets a caller check that nothing of the namespace outlives the run
            pid_ns = os.readlink(f"/proc/{pid}/ns/pid") if namespaces else None
        except OSError:
            pid_ns = None
        started = {"event": "started", "pid": pid, "pid_ns": pid_ns, "namespaces": namespaces}
        _report(status_fd, started)
        _, status, usage = os.wait4(pid, 0)
        # The program is reaped: a stop that comes now (the run's wall-clock deadline racing its
        # CPU limit) has nothing left to kill and must not turn the exit into an error.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cpu_s = usage.ru_utime + usage.ru_stime
        _report(status_fd, {"event": "exit", "status": status, "cpu_s": cpu_s})
        return 0
    except BaseException as e:
        _report(status_fd, {"event": "error", "stage": stage, "error": f"{type(e).__name__}: {e}"})
        return 3


def _kill(pid: int) -> None:
    """SIGKILL the program; it may have just died (its CPU limit), which is not an error."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
