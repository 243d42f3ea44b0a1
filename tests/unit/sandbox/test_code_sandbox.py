"""The code sandbox under attack, with real subprocesses and the real kernel namespaces.

Every attack must score 0 with its error category counted; afterwards the reward keeps serving
(a right program still scores 1), its host work dir is gone, and no process of its pid
namespace is left. Limits are small so each attack ends in about a second.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import uuid

import pyseccomp
import pytest

from roll_ds.rewards.base import RewardSample
from roll_ds.rewards.build import build_reward_fn
from roll_ds.rewards.code_reward import CodeReward
from roll_ds.rewards.registry import REWARD_FNS
from roll_ds.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SQUARE_TESTS = json.dumps({"tests": [{"input": "3\n", "output": "9\n"}]})
SQUARE = "```python\nn = int(input())\nprint(n * n)\n```"


LIMITS = dict(timeout_s=2.0, memory_mb=128, max_processes=8, max_output_bytes=1 << 16)


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    fn = CodeReward(num_workers=1, **LIMITS)
    fn.sandbox.tmp_dir = str(tmp_path_factory.mktemp("sandbox_work"))
    try:
        fn.warmup()  # the probe: the kernel namespaces every attack below is contained by
    except SandboxUnavailable as exc:
        # a host whose kernel refuses them (no user namespaces, a seccomp profile) gets the
        # refusal, tested on every host below by simulating it; the attacks have nothing to hit
        fn.close()
        pytest.skip(f"this host refuses the sandbox's namespaces: {exc}")
    yield fn
    fn.close()


def _processes_in(pid_ns: str) -> list[int]:
    """Host pids whose pid namespace is ``pid_ns``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == pid_ns:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _leftovers(fn: CodeReward, pid_ns: str | None) -> dict:
    deadline = time.monotonic() + 2.0  # the kernel tears a namespace down asynchronously
    while (procs := _processes_in(pid_ns) if pid_ns else []) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"work dirs": os.listdir(fn.sandbox.tmp_dir), "processes": procs}


def attack(fn: CodeReward, program: str, tests: str = SQUARE_TESTS) -> tuple[float, dict, float]:
    """Score ``program``; then check the aftermath: nothing left, a right program scores 1.
    Returns (score, info, seconds); the sandbox results are kept in ``fn.last_results``."""
    seen: list = []
    run = fn.sandbox.run

    def recording_run(*args, **kwargs):
        seen.append(result := run(*args, **kwargs))
        return result

    fn.sandbox.run = recording_run
    try:
        start = time.perf_counter()
        out = fn([RewardSample(program, tests)])
        elapsed = time.perf_counter() - start
    finally:
        del fn.sandbox.run
    assert seen, "the program never ran"
    for result in seen:
        assert _leftovers(fn, result.pid_ns) == {"work dirs": [], "processes": []}
        for pid in result.pids:
            assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} still exists"
    fn.last_results = seen
    after = fn([RewardSample(SQUARE, SQUARE_TESTS)])
    assert after.scores == [1.0], after.infos
    return out.scores[0], out.infos[0], elapsed


def test_right_and_wrong_programs(reward):
    tests = json.dumps(
        {"tests": [{"input": "2\n", "output": "4"}, {"input": "5\n", "output": "25"}]}
    )
    out = reward(
        [
            RewardSample(SQUARE, tests),
            RewardSample("print(4)", tests),
            RewardSample("no fence here, just prose", tests),
            RewardSample("", tests),
        ]
    )
    assert out.scores == [1.0, 0.5, 0.0, 0.0]
    assert out.infos[0]["categories"] == {"passed": 2}
    assert out.infos[1]["categories"] == {"passed": 1, "wrong_answer": 1}
    assert out.infos[2]["error_category"] == "syntax_error"  # and it stopped after one run
    assert out.infos[2]["categories"] == {"syntax_error": 1}
    assert out.infos[3]["error_category"] == "no_code"


def test_assert_tests_and_all_or_nothing(reward):
    tests = json.dumps([{"assert": "assert add(2, 2) == 4"}, {"assert": "assert add(1, 2) == 3"}])
    half = "def add(a, b):\n    return 3"
    out = reward([RewardSample(f"```py\n{half}\n```", tests)])
    assert out.scores == [0.5] and out.infos[0]["error_category"] == "wrong_answer"
    strict = CodeReward(scoring="all_or_nothing", num_workers=1, **LIMITS)
    strict.sandbox = reward.sandbox
    out = strict([RewardSample(half, tests), RewardSample("def add(a, b): return a + b", tests)])
    assert out.scores == [0.0, 1.0]
    assert out.infos[0]["categories"] == {"wrong_answer": 1}  # stopped at the first failure


def test_infinite_loop(reward):
    score, info, elapsed = attack(reward, "while True:\n    pass")
    assert (score, info["error_category"], info["timed_out"]) == (0.0, "timeout", True)
    assert elapsed < 5


def test_fork_fifty_children_stops_at_the_process_limit(reward):
    program = (
        "import os, time\n"
        "for _ in range(50):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
    )
    score, info, _ = attack(reward, program)
    assert (score, info["error_category"]) == (0.0, "process_limit")


def test_fork_bomb_with_escapes_is_contained(reward):
    # Every child also leaves the process group (setsid): the pid namespace still ends them.
    program = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    score, info, elapsed = attack(reward, program)
    assert (score, info["error_category"]) == (0.0, "timeout")
    assert elapsed < 6
    pid = os.fork()  # the host's process budget is untouched
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_memory_bomb(reward):
    program = "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))"
    score, info, _ = attack(reward, program)
    assert (score, info["error_category"]) == (0.0, "memory")


def test_processes_together_over_the_memory_limit(reward):
    """Four processes of 80 MB each: every one is within RLIMIT_AS (memory_mb 128), together
    they are not; only a per-run cgroup (memory.max) stops them."""
    program = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (80 << 20)\n"
        "        time.sleep(0.5)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "if all(os.waitpid(p, 0)[1] == 0 for p in pids):\n"
        "    print('done')\n"
        "else:\n"
        "    raise SystemExit(1)\n"
    )
    score, info, _ = attack(reward, program, json.dumps([{"output": "done"}]))
    if reward.sandbox.cgroup_parent is None:  # rlimits only: it runs ("passed" when unloaded)
        got = info["error_category"]
        pytest.skip(f"no per-run cgroup ({reward.sandbox.cgroup_reason}): 4 x 80 MB gave {got}")
    assert (score, info["error_category"]) == (0.0, "memory")


def test_writing_outside_the_work_dir(reward, tmp_path):
    name = f"pwned-{uuid.uuid4().hex}"
    targets = [
        os.path.join(REPO, name),
        str(tmp_path / name),
        os.path.join(os.path.expanduser("~"), name),
        os.path.join("/dev/shm", name),
        os.path.join("/tmp", name),
    ]
    program = (
        f"errors = []\nfor path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        errors.append(e)\n"
        "if len(errors) == len(" + repr(targets) + "):\n"
        "    raise errors[-1]\n"
    )
    score, info, _ = attack(reward, program)
    assert (score, info["error_category"]) == (0.0, "runtime_error")
    assert [t for t in targets if os.path.exists(t)] == []


def test_host_environment_is_invisible(reward, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ROLL_DS_TEST_SECRET", secret)
    program = (
        "import os\n"
        "found = [os.environ.get('ROLL_DS_TEST_SECRET', '')]\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        found.append(open(f'/proc/{pid}/environ', 'rb').read().decode())\n"
        "    except OSError:\n"
        "        pass\n"
        "print(next((f for f in found if 'secret-' in f), 'nothing'))\n"
    )
    tests = json.dumps({"tests": [{"input": "", "output": secret}]})
    score, info, _ = attack(reward, program, tests)
    assert (score, info["error_category"]) == (0.0, "wrong_answer")
    # bubblewrap adds PWD: the work dir, which the program is in anyway (nothing of the host)
    result = reward.sandbox.run(
        "import os; print(sorted(os.environ), os.getenv('PWD') == os.getcwd())"
    )
    env = "['HOME', 'LANG', 'LC_ALL', 'PATH', 'PWD', 'TMPDIR'] True"
    assert result.stdout.strip() == env


def test_no_network_not_even_the_hosts_loopback(reward):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'pwned')\n"
            "print('connected')\n"
        )
        tests = json.dumps({"tests": [{"input": "", "output": "connected"}]})
        score, info, _ = attack(reward, program, tests)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert (score, info["error_category"]) == (0.0, "runtime_error")


def test_printing_100_mb(reward):
    program = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)"
    score, info, elapsed = attack(reward, program)
    assert (score, info["error_category"]) == (0.0, "output_limit")
    assert len(reward.last_results[0].stdout) == LIMITS["max_output_bytes"]
    assert elapsed < 5


def test_reading_the_hosts_files(reward):
    """The program sees a minimal root: its tests' data, the repository, /etc, home, Ray's
    directory and site-packages are not there; the standard library still works."""
    targets = [
        os.path.join(REPO, "examples", "qwen_rlvr", "data", "code_train.jsonl"),
        os.path.join(REPO, "pyproject.toml"),
        os.path.join(REPO, "output"),
        os.path.join(REPO, ".venv"),
        "/etc/passwd",
        "/etc/hostname",
        os.path.expanduser("~/.cache"),
        "/tmp/ray",
        "/sys/class/net",
        os.path.join(os.path.dirname(os.__file__), "site-packages"),
    ]
    program = (
        "import collections, json, math, re, os\n"
        f"found = []\nfor path in {targets!r}:\n"
        "    try:\n"
        "        found.append(os.listdir(path) and path if os.path.isdir(path) else\n"
        "                     open(path, 'rb').read(1) and path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(json.dumps([f for f in found if f]) if any(found) else 'nothing')\n"
    )
    score, info, _ = attack(reward, program, json.dumps([{"output": "secret"}]))
    assert (score, info["error_category"]) == (0.0, "wrong_answer")
    assert reward.last_results[0].stdout.strip() == "nothing"
    stdlib = "import collections, json, math, re\nprint(json.dumps([math.isqrt(int(input()))]))"
    assert reward.sandbox.run(stdlib, "49\n").stdout.strip() == "[7]"


SHMGET = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "ids = [libc.shmget(0, 64 << 20, 0o1600) for _ in range(4)]\n"  # IPC_PRIVATE, IPC_CREAT
    "print(ids)\n"
)


def _host_shm_ids() -> set[int]:
    with open("/proc/sysvipc/shm") as f:
        return {int(line.split()[1]) for line in f.readlines()[1:] if line.strip()}


def test_sysv_shared_memory_dies_with_the_run(reward):
    import ctypes

    before = _host_shm_ids()
    try:
        result = reward.sandbox.run(SHMGET)
        assert result.category == "ok", result.stderr
        assert all(i >= 0 for i in json.loads(result.stdout)), result.stdout  # it did create
        left = _host_shm_ids() - before
        assert left == set(), f"{len(left)} segments outlived the program"
    finally:  # what an unfixed sandbox left behind
        for shmid in _host_shm_ids() - before:
            ctypes.CDLL(None).shmctl(shmid, 0, None)  # IPC_RMID


def test_best_effort_falls_back_when_namespaces_are_refused(
    monkeypatch, caplog, tmp_path, nobody_python, shared_tmp
):
    """Where the kernel refuses (simulated), ``required`` fails at start-up naming the opt-out
    field, and keeps refusing; ``best_effort`` warns and runs without namespaces."""
    monkeypatch.setattr(Sandbox, "_namespaces_work", lambda self: (False, "refused"))
    strict = Sandbox(SandboxLimits(timeout_s=2), "required", tmp_dir=str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="network_isolation: best_effort"):
        strict.probe()
    with pytest.raises(SandboxUnavailable):
        strict.run("print('never runs')")
    fallback = Sandbox(
        SandboxLimits(timeout_s=2), "best_effort", tmp_dir=shared_tmp, python=nobody_python
    )
    assert fallback.probe() == []
    assert "rlimits and timeouts only" in caplog.text
    assert fallback.run("print(input()[::-1])", "abc\n").stdout == "cba\n"


def test_registered_and_validated():
    assert "code" in REWARD_FNS
    fn = build_reward_fn({"name": "code", "scoring": "all_or_nothing"}, {"timeout_s": 3.0})
    assert isinstance(fn, CodeReward) and fn.sandbox.limits.timeout_s == 3.0
    with pytest.raises(ValueError, match="scoring: 'most'; valid: fraction, all_or_nothing"):
        CodeReward(scoring="most")


# -- the seccomp filter: what bwrap loads before it execs the program ----------------------------

_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
_CHECK = (
    "if ret < 0:\n"
    "    err = ctypes.get_errno()\n"
    "    raise OSError(err, os.strerror(err))\n"
    "print('escaped')\n"
)
#: an attack's first step, each a call that succeeds in a user namespace without the filter
#: (ptrace of itself, a new user namespace, a session keyring) or with a capability it could get
#: from one (mount, a packet socket)
FILTERED = {
    "ptrace": _LIBC + "ret = libc.ptrace(0, 0, None, None)  # PTRACE_TRACEME\n" + _CHECK,
    "unshare": _LIBC + "ret = libc.unshare(0x10000000)  # CLONE_NEWUSER\n" + _CHECK,
    "mount": _LIBC + "ret = libc.mount(b'none', b'.', b'tmpfs', 0, None)\n" + _CHECK,
    "keyctl": _LIBC + "ret = libc.syscall(250, 1, None)  # KEYCTL_JOIN_SESSION_KEYRING\n" + _CHECK,
    "socket(AF_PACKET)": "import socket\nsocket.socket(socket.AF_PACKET, socket.SOCK_RAW)\n"
    "print('escaped')\n",
    "socket(SOCK_RAW)": "import socket\n"
    "socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\nprint('escaped')\n",
}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="keyctl's syscall number: x86_64")
@pytest.mark.parametrize("call", sorted(FILTERED))
def test_the_syscall_filter_refuses(reward, call):
    score, info, _ = attack(reward, FILTERED[call])
    stderr = reward.last_results[0].stderr
    assert (score, info["error_category"]) == (0.0, "runtime_error"), stderr
    assert "Operation not permitted" in stderr and "escaped" not in reward.last_results[0].stdout


def test_the_program_runs_under_the_filter(reward):
    """The refusals above are the filter's, not only the missing capabilities': the program is
    in seccomp filter mode, and a call that a user namespace allows (a new one) is refused
    with the filter's EPERM while the same call outside the filter succeeds."""
    status = reward.sandbox.run("print(open('/proc/self/status').read())").stdout
    assert "Seccomp:\t2" in status, status  # SECCOMP_MODE_FILTER
    unshare = FILTERED["unshare"]
    assert reward.sandbox.run(unshare).category == "runtime_error"
    box = Sandbox(SandboxLimits(timeout_s=5), tmp_dir=reward.sandbox.tmp_dir)
    box.probe()
    allow_all = pyseccomp.SyscallFilter(pyseccomp.ALLOW)  # the same sandbox, no refusals
    with tempfile.TemporaryFile() as f:
        allow_all.export_bpf(f)
        f.seek(0)
        box._seccomp = f.read()
    escaped = box._run_source(unshare, "", namespaces=True)
    assert escaped.stdout.strip() == "escaped", escaped


def test_without_bubblewrap_the_refusal_names_the_package_and_the_opt_out(tmp_path):
    box = Sandbox(SandboxLimits(timeout_s=2), "required", tmp_dir=str(tmp_path))
    box.bwrap = None  # not installed
    with pytest.raises(SandboxUnavailable) as refused:
        box.probe()
    message = str(refused.value)
    assert "apt-get install bubblewrap" in message and "network_isolation: best_effort" in message


def test_bwraps_own_failure_is_a_sandbox_error_not_the_programs(reward):
    """bwrap fails after it started the program's process (here: a filter it cannot load):
    the run is the sandbox's error, with bwrap's message, never a program's runtime_error."""
    box = Sandbox(SandboxLimits(timeout_s=5), tmp_dir=reward.sandbox.tmp_dir)
    box.probe()
    box._seccomp = b"\0" * 3  # not a BPF program
    res = box.run("print('never runs')")
    assert (res.category, res.stdout) == ("sandbox_error", ""), res
    assert "bwrap could not start the program" in res.detail and "seccomp" in res.stderr
