"""Run an untrusted Python program with stdin; get its output, exit status and an error category.

What a program in the sandbox meets (the launcher, :mod:`roll_ds.sandbox.launcher`,
sets it up; see its doc for the order of the steps):

* **User**: never the worker's: when the worker is root the program runs as ``sandbox_uid`` /
  ``sandbox_gid`` (``nobody``) with no supplementary groups, in every mode; otherwise as the
  worker's own (unprivileged) user.
* **Processes**: its own session / process group, and pid 1 of a fresh pid namespace, so when
  it ends or is stopped every process it started dies with it (also ones that ``setsid``).
  ``RLIMIT_NPROC`` inside a fresh user namespace counts only the sandbox's own processes: a
  fork bomb stalls at ``max_processes`` instead of eating the host's (shared) process budget.
* **Resources**: ``RLIMIT_CPU`` (the wall timeout rounded up), ``RLIMIT_AS`` (``memory_mb``),
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``; a wall-clock timeout after which the
  run is killed; stdout and stderr read up to ``max_output_bytes`` each, killed beyond. Where
  the host offers cgroup v2 with memory, pids and cpu (:mod:`roll_ds.sandbox.cgroup`),
  a cgroup per run bounds its processes together (``memory_mb``, ``max_processes``, one core);
  elsewhere :meth:`Sandbox.probe` logs once that limits are per process only.
* **Files**: a minimal root of its own, made by bubblewrap (``bwrap``): the interpreter's
  executable, standard library and ``libpython`` (site-packages covered), the system's shared
  library directories (``/lib*``, ``/usr/lib*``), bwrap's minimal ``/dev`` (``null``, ``zero``,
  ``full``, ``random``, ``urandom``, ``tty``, a private ``pts``), a fresh
  read-only ``/proc`` showing only the sandbox's processes, and the work dir, a fresh tmpfs of
  ``workdir_mb`` (it vanishes with the namespace; the host-side temporary directory is removed
  after every run, also after a kill). All read-only but the work dir. Not there: the
  repository, data, outputs, models, ``/etc``, home, ``/tmp`` (Ray's sockets), ``/sys``.
* **IPC**: its own IPC namespace: System V shared memory, semaphores and message queues die
  with the run.
* **Syscalls**: a seccomp filter (:mod:`roll_ds.sandbox.seccomp`, built once per sandbox with
  libseccomp, loaded by bwrap before the exec) refuses with ``EPERM`` what a scoring program
  never needs: ``ptrace``, mounts, ``unshare`` / ``setns`` / ``clone`` with namespace flags,
  the keyring, ``bpf``, ``perf_event_open``, raw and packet sockets, io_uring, module and
  kernel loading. The program is a ``runtime_error`` and the reward serves on.
* **Environment**: only ``PATH``, ``LANG``, ``LC_ALL``, ``HOME``, ``TMPDIR`` (the work dir) and
  bwrap's ``PWD`` (the work dir too);
  ``python -I -S -B`` ignores ``PYTHON*`` variables, the user site and site-packages (the
  program gets the standard library only).
* **Network**: a fresh network namespace with only a loopback device that is down, so nothing
  (not even the host's 127.0.0.1) is reachable.

The namespaces need bubblewrap (the package ``bubblewrap``; ``scripts/setup.sh`` and the
cluster image install it), libseccomp (``pyseccomp`` over ``libseccomp2``) and unprivileged
user namespaces (Linux; ``user.max_user_namespaces`` > 0, not disabled by
``kernel.unprivileged_userns_clone=0``, an AppArmor restriction or a seccomp profile, such as
Docker's default, that refuses ``unshare``); no privilege of the host: root without
CAP_SYS_ADMIN drops to ``sandbox_uid`` first (which must reach the interpreter: one under
``/root`` is replaced by the system's ``python3``, see ``Sandbox._choose_python``).
:meth:`Sandbox.probe` checks once; ``network_isolation`` says what happens where the kernel
refuses: ``required`` (default) raises :class:`SandboxUnavailable` naming the container
options (cluster/README.md); ``best_effort`` warns and runs with the unprivileged user, the
rlimits, the cgroup, the process group and the timeouts only (no network, file-system or IPC
isolation: the program can read what ``nobody`` can read; ``RLIMIT_NPROC`` then counts all
processes of that user); ``off`` uses the namespaces but no network namespace (and falls back
like ``best_effort``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from roll_ds.sandbox import cgroup as cgroups
from roll_ds.sandbox import seccomp
from roll_ds.sandbox.limits import NETWORK_ISOLATION, SandboxLimits
from roll_ds.sandbox.result import SandboxResult, classify

logger = logging.getLogger(__name__)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
SETUP_TIMEOUT_S = 30.0  # launcher start + namespaces, before the program's own clock starts
KILL_GRACE_S = 2.0  # after SIGTERM to the launcher, SIGKILL to the whole process group
_CHUNK = 1 << 16
#: what runs a program's isolation, and where to get it
BWRAP_PACKAGE = "bubblewrap"
#: interpreters tried when the sandbox user cannot run this one (e.g. a Python under /root)
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


#: what a refusal says to do in a container (cluster/README.md, "The code sandbox")
REFUSAL_HINT = (
    "in a container, allow unshare and mount: Docker `--security-opt seccomp=unconfined "
    "--security-opt apparmor=unconfined`, Kubernetes seccompProfile and appArmorProfile "
    "Unconfined (no CAP_SYS_ADMIN or --privileged needed; see cluster/README.md)"
)


class SandboxUnavailable(RuntimeError):
    """The kernel refuses the isolation the configuration requires."""


class Sandbox:
    """Runs programs under :class:`SandboxLimits`; thread-safe (each run is its own process).

    ``sandbox_uid`` / ``sandbox_gid``: who the program runs as when this process is root;
    ``tmp_dir``: where the host-side work dirs are made (default: the system temp dir);
    ``python``: the interpreter of the programs (default: this one's base interpreter).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        network_isolation: str = "required",
        sandbox_uid: int = 65534,
        sandbox_gid: int = 65534,
        tmp_dir: str | None = None,
        python: str | None = None,
    ) -> None:
        if network_isolation not in NETWORK_ISOLATION:
            raise ValueError(
                f"network_isolation: {network_isolation!r}; valid: {', '.join(NETWORK_ISOLATION)}"
            )
        self.limits = limits or SandboxLimits()
        self.network_isolation = network_isolation
        self.uid, self.gid = sandbox_uid, sandbox_gid
        self.tmp_dir = tmp_dir
        # the base interpreter, not a venv's: programs get the standard library only
        base = python or getattr(sys, "_base_executable", "") or sys.executable
        self.python = os.path.realpath(base)
        self._python_given = python is not None
        self.bwrap = shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin")
        self._seccomp: bytes | None = None  # the filter's BPF program, after probe()
        self._proc = True  # a fresh /proc in the sandbox (not under a masked /proc)
        self._bwrap_sized = True  # bwrap >= 0.7 sizes the work dir's tmpfs (--size)
        self._namespaces: bool | None = None  # decided by probe()
        self._refusal: SandboxUnavailable | None = None
        self._probe_lock = threading.Lock()
        self.isolation: list[str] = []  # namespaces in use after probe()
        self.cgroup_parent: str | None = None  # where run cgroups go, after probe()
        self.cgroup_reason = "not probed"  # why there are none

    # -- start-up -------------------------------------------------------------------------
    def probe(self) -> list[str]:
        """Check once that the kernel allows the isolation; returns the namespaces in use.

        Raises :class:`SandboxUnavailable` (``network_isolation: required``; then every later
        run raises it too, so nothing ever runs less isolated than configured) or warns and
        falls back to rlimits only (``best_effort`` / ``off``), still as an unprivileged user:
        where that cannot run either, it raises too.
        """
        with self._probe_lock:
            if self._refusal is not None:
                raise self._refusal
            if self._namespaces is not None:
                return self.isolation
            self._probe_cgroup()
            works, detail = self._namespaces_work()
            if not works and detail.startswith("cgroup:"):  # made, but cannot be joined
                self._no_cgroup(f"cannot join a run's cgroup ({detail})")
                works, detail = self._namespaces_work()
            if works:
                self._namespaces = True
                return self.isolation
            msg = (
                f"code sandbox: this host refuses the sandbox's namespaces ({detail}). They "
                "need bubblewrap and unprivileged user namespaces (sysctl user.max_user_namespaces "
                "> 0, kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_"
                "userns=0); " + REFUSAL_HINT
            )
            if self.network_isolation == "required":
                self._refusal = SandboxUnavailable(
                    f"{msg}. Allow them, or opt out explicitly with the code reward's "
                    "network_isolation: best_effort (then programs run as an unprivileged user "
                    "with rlimits and timeouts only: network, files and IPC are NOT isolated)"
                )
                raise self._refusal
            res = self._run_source("print('ok')", "", namespaces=False)
            if res.category != "ok" or res.stdout.strip() != "ok":
                self._refusal = SandboxUnavailable(
                    f"{msg}. The fallback of network_isolation: {self.network_isolation} "
                    f"cannot run either ({res.detail or res.stderr.strip()[-300:]}): it runs "
                    f"{self.python} as uid {self.uid} when the worker is root, so that user "
                    "must be able to read it, its standard library and the work dirs' parent "
                    f"({self.tmp_dir or tempfile.gettempdir()})"
                )
                raise self._refusal
            logger.warning("%s; running programs with rlimits and timeouts only", msg)
            self._namespaces, self.isolation = False, []
            return self.isolation

    def _namespaces_work(self) -> tuple[bool, str]:
        if self.bwrap is None:
            return False, (
                f"bubblewrap (bwrap) is not installed: install the package {BWRAP_PACKAGE} "
                f"(apt-get install {BWRAP_PACKAGE}; dnf install {BWRAP_PACKAGE}), as "
                "scripts/setup.sh and cluster/Dockerfile do"
            )
        try:
            self._seccomp = seccomp.build_filter()
        except seccomp.SeccompUnavailable as e:
            return False, str(e)
        self._choose_python()
        self._bwrap_sized = _bwrap_version(self.bwrap) >= (0, 7)
        if not self._bwrap_sized:
            logger.warning(
                "code sandbox: %s is older than 0.7 (no --size): the work dir's tmpfs is not "
                "held to workdir_mb (RLIMIT_FSIZE still bounds each file)",
                self.bwrap,
            )
        res = self._run_source("print('ok')", "", namespaces=True)
        if self._proc and "Can't mount proc" in res.stderr:  # a container's masked /proc
            self._proc = False
            logger.warning("code sandbox: this host refuses a fresh /proc; programs get none")
            res = self._run_source("print('ok')", "", namespaces=True)
        ok = res.category == "ok" and res.stdout.strip() == "ok"
        detail = "; ".join(x for x in (res.detail, res.stderr.strip()[-300:]) if x)
        return ok, detail

    def _choose_python(self) -> None:
        """As root, programs run as ``sandbox_uid``, which must reach the interpreter's files
        (bwrap resolves them as that user): one under a directory it cannot enter, such as
        ``/root``, is replaced by the system's (unless given explicitly)."""
        if os.geteuid() != 0 or self._python_given or self._runs_as_sandbox_user(self.python):
            return
        for python in SYSTEM_PYTHONS:
            if self._runs_as_sandbox_user(python):
                logger.warning(
                    "code sandbox: the sandbox user (uid %d) cannot run %s; programs run "
                    "under %s (the standard library only, as always)",
                    self.uid,
                    self.python,
                    python,
                )
                self.python = os.path.realpath(python)
                return

    def _runs_as_sandbox_user(self, python: str) -> bool:
        who = dict(user=self.uid, group=self.gid, extra_groups=[], cwd="/")
        try:
            cmd = [python, "-I", "-S", "-c", "import json"]
            return subprocess.run(cmd, capture_output=True, timeout=30, **who).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    def _probe_cgroup(self) -> None:
        """Decide once whether runs get a cgroup; say once when they do not."""
        try:
            parent, reason = cgroups.find_parent()
            if parent is not None:
                cgroups.RunCgroup.create(parent, self.limits).remove()
        except OSError as e:
            parent, reason = None, f"cannot make a cgroup ({e})"
        self.cgroup_parent, self.cgroup_reason = parent, reason
        if parent is None:
            self._no_cgroup(reason)

    def _no_cgroup(self, reason: str) -> None:
        self.cgroup_parent, self.cgroup_reason = None, reason
        lim = self.limits
        logger.warning(
            "code sandbox: no per-run cgroup (%s); limits are per process (rlimits): a run's "
            "%d processes may each use %d MB, and every reward worker's runs add up",
            reason,
            lim.max_processes,
            lim.memory_mb,
        )

    # -- one run ---------------------------------------------------------------------------
    def run(self, source: str, stdin: str = "") -> SandboxResult:
        """Run ``source`` as ``main.py`` with ``stdin``; never raises for what the program does
        (only :class:`SandboxUnavailable`, see :meth:`probe`)."""
        self.probe()
        return self._run_source(source, stdin, namespaces=bool(self._namespaces))

    def _run_source(self, source: str, stdin: str, namespaces: bool) -> SandboxResult:
        try:
            cgroup = self._new_cgroup()
        except OSError as e:
            return SandboxResult("", "", "sandbox_error", detail=f"cgroup: {e}")
        workdir = tempfile.mkdtemp(prefix="roll_ds_sandbox_", dir=self.tmp_dir)
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(source)
            with open(os.path.join(workdir, "stdin.txt"), "w", encoding="utf-8") as f:
                f.write(stdin)
            result = self._run_in(workdir, namespaces, cgroup)
            if cgroup is not None and result.category == "runtime_error" and cgroup.oom_killed():
                result.category = "memory"  # memory.max: the kernel killed one of its processes
            return result
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if cgroup is not None:
                try:
                    cgroup.remove()
                except OSError as e:  # its processes are killed; only the directory is left
                    logger.warning("code sandbox: cannot remove %s (%s)", cgroup.path, e)

    def _new_cgroup(self) -> cgroups.RunCgroup | None:
        if self.cgroup_parent is None:
            return None
        return cgroups.RunCgroup.create(self.cgroup_parent, self.limits)

    def _config(self, workdir: str, namespaces: bool, cgroup_path: str | None) -> dict:
        lim = self.limits
        return {
            "workdir": workdir,
            "parent_pid": os.getpid(),
            "namespaces": namespaces,
            "net": self.network_isolation != "off",
            "bwrap": self.bwrap,
            "seccomp": self._seccomp.hex() if self._seccomp else "",
            "proc": self._proc,
            "sized": self._bwrap_sized,
            "uid": self.uid,
            "gid": self.gid,
            "cgroup": cgroup_path,
            "workdir_mb": lim.workdir_mb,
            "python": self.python,
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                "HOME": workdir,
                "TMPDIR": workdir,
            },
            "limits": {
                "cpu_s": self.cpu_limit_s,
                "memory_mb": lim.memory_mb,
                "file_size_mb": lim.file_size_mb,
                # in bwrap's user namespace: the program and its children only; without
                # namespaces, + the launcher
                "nproc": lim.max_processes + (0 if namespaces else 1),
                "nofile": lim.max_open_files,
            },
        }

    @property
    def cpu_limit_s(self) -> int:
        return max(1, math.ceil(self.limits.timeout_s))

    def _run_in(
        self, workdir: str, namespaces: bool, cgroup: cgroups.RunCgroup | None
    ) -> SandboxResult:
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [
                    self.python,
                    "-I",
                    "-S",
                    "-B",
                    LAUNCHER,
                    str(status_w),
                    json.dumps(self._config(workdir, namespaces, cgroup and cgroup.path)),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                cwd=workdir,
            )
        except OSError as e:
            os.close(status_r)
            return SandboxResult("", "", "sandbox_error", detail=f"launcher: {e}")
        finally:
            os.close(status_w)
        with os.fdopen(status_r, "rb", buffering=0) as status:
            return _Run(self, proc, status).collect()


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    """``bwrap --version`` as numbers ("bubblewrap 0.8.0" -> (0, 8, 0)); () when unreadable."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10)
        return tuple(int(x) for x in out.stdout.split()[-1].split("."))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return ()


class _Run:
    """Reads a running launcher's pipes until it ends, a deadline passes or output overflows."""

    def __init__(self, sandbox: Sandbox, proc: subprocess.Popen, status) -> None:
        self.sandbox, self.proc, self.status = sandbox, proc, status
        self.out = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        self.started_at: float | None = None
        self.stopped_for: str | None = None

    def _events(self) -> list[dict]:
        text = bytes(self.out["status"]).decode(errors="replace")
        complete = text[: text.rfind("\n") + 1]  # each event is one atomic line
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def collect(self) -> SandboxResult:
        cap = self.sandbox.limits.max_output_bytes
        spawned = time.monotonic()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(self.proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(self.status, selectors.EVENT_READ, "status")
        try:
            while sel.get_map():
                if self.started_at is None and any(e["event"] == "started" for e in self._events()):
                    self.started_at = time.monotonic()
                if self.started_at is None:
                    deadline = spawned + SETUP_TIMEOUT_S
                else:
                    deadline = self.started_at + self.sandbox.limits.timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop("timeout" if self.started_at is not None else "sandbox_error")
                    break
                for key, _ in sel.select(timeout=left):
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = self.out[key.data]
                    buf += chunk
                    if key.data != "status" and len(buf) > cap:
                        del buf[cap:]
                        self.stop("output_limit")
                        break
                if self.stopped_for:
                    break
        finally:
            sel.close()
            ended = time.monotonic()
            self.reap()
        return self.result(ended)

    def stop(self, reason: str) -> None:
        """SIGTERM the launcher (it kills the program, whose namespace dies with it)."""
        self.stopped_for = reason
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        """Wait for the launcher; SIGKILL its whole process group if it lingers or if the run
        was stopped (nothing of the run may outlive this call)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=KILL_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()
        # the status pipe: read what the launcher wrote after we stopped reading
        try:
            os.set_blocking(self.status.fileno(), False)
            while chunk := self.status.read(_CHUNK):
                self.out["status"] += chunk
        except (BlockingIOError, OSError, TypeError):
            pass

    def result(self, ended: float) -> SandboxResult:
        stdout = bytes(self.out["stdout"]).decode(errors="replace")
        stderr = bytes(self.out["stderr"]).decode(errors="replace")
        events = self._events()
        error = next((e for e in events if e["event"] == "error"), None)
        exit_ev = next((e for e in events if e["event"] == "exit"), None)
        start_ev = next((e for e in events if e["event"] == "started"), None)
        wall = ended - self.started_at if self.started_at is not None else 0.0
        if error is not None or (start_ev is None and self.stopped_for is None):
            detail = error["error"] if error else f"launcher exited {self.proc.returncode}"
            stage = error["stage"] if error else "start"
            return SandboxResult(
                stdout, stderr, "sandbox_error", wall_s=wall, detail=f"{stage}: {detail}"
            )
        pids: tuple[int, ...] = (self.proc.pid,)
        if start_ev is not None:
            self.sandbox.isolation = start_ev["namespaces"]
            pids += (start_ev["pid"],)
        exit_code = sig = cpu_s = None
        if exit_ev is not None:
            exit_code, sig, cpu_s = exit_ev["exit_code"], exit_ev["signal"], exit_ev["cpu_s"]
        category = classify(
            stopped_for=self.stopped_for,
            exit_code=exit_code,
            sig=sig,
            cpu_s=cpu_s,
            cpu_limit_s=self.sandbox.cpu_limit_s,
            stderr=stderr,
        )
        pid_ns = start_ev.get("pid_ns") if start_ev else None
        return SandboxResult(
            stdout, stderr, category, exit_code, sig, wall, cpu_s, pids=pids, pid_ns=pid_ns
        )
