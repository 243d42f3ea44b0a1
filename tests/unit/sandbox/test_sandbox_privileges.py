"""The code sandbox's privileges and the container it runs in: who the program runs as in every
mode, starting as root without CAP_SYS_ADMIN, the refusal under Docker's default seccomp
profile, and the per-run cgroup (with a fake cgroup v2 tree; the real one where the host has it).

Each case runs the code reward in a child process whose privileges are cut the way a container
cuts them (``setpriv`` drops CAP_SYS_ADMIN; a seccomp filter refuses ``unshare`` as Docker's
default profile does without CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from roll_ds.sandbox import Sandbox, SandboxLimits
from roll_ds.sandbox import cgroup as sandbox_cgroup
from roll_ds.sandbox.run import REFUSAL_HINT

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the worker runs as root only in images")

# The code reward's start-up as a worker does it: probe, then score one right program.
START = """
import json, sys
from roll_ds.rewards.base import RewardSample
from roll_ds.rewards.code_reward import CodeReward
from roll_ds.sandbox import SandboxUnavailable
fn = CodeReward(num_workers=1, timeout_s=5.0, network_isolation=sys.argv[1])
if len(sys.argv) > 2:  # an interpreter the sandbox user can run (the fallback's)
    fn.sandbox.python = sys.argv[2]
try:
    fn.warmup()
except SandboxUnavailable as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
tests = json.dumps([{"input": "3\\n", "output": "9\\n"}])
out = fn([RewardSample("print(int(input()) ** 2)", tests)])
who = fn.sandbox.run("import os; print(os.getuid(), os.getgid(), os.getgroups())").stdout
print(json.dumps({"score": out.scores[0], "who": who.strip(), "isolation": fn.sandbox.isolation}))
"""

# Docker's default seccomp profile refuses unshare(2) to a container without CAP_SYS_ADMIN
# (EPERM): the same, as a two-rule filter installed before the worker starts.
SECCOMP_NO_UNSHARE = """
import ctypes, os, sys
NR_UNSHARE = {"x86_64": 272, "aarch64": 97}[os.uname().machine]
class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
rules = (Filter * 4)(
    Filter(0x20, 0, 0, 0),                  # load the syscall number
    Filter(0x15, 0, 1, NR_UNSHARE),         # unshare?
    Filter(0x06, 0, 0, 0x00050000 | 1),     #   -> EPERM
    Filter(0x06, 0, 0, 0x7FFF0000),         # else allow
)
prog = Prog(4, rules)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0      # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
os.execv(sys.argv[1], sys.argv[1:])  # the command after this script
"""


def start_reward(prefix: list[str], isolation: str = "required", python: str | None = None) -> dict:
    out = subprocess.run(
        [*prefix, sys.executable, "-c", START, isolation, *([python] if python else [])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def nobody_may_unshare() -> bool:
    """Whether this kernel lets an unprivileged user create the sandbox's namespaces."""
    probe = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe += ["unshare", "--user", "--mount", "--pid", "--fork", "--net", "--ipc", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


#: Docker's default capability set (no CAP_SYS_ADMIN) and its masks over /proc
DOCKER_CAPS = (
    "-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,"
    "+net_bind_service,+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap"
)
DOCKER_PROC_MASKS = (
    "for f in /proc/kcore /proc/keys /proc/timer_list; do "
    "[ ! -e $f ] || mount --bind /dev/null $f || exit 1; done; "
    "for d in /proc/acpi /proc/scsi; do [ ! -d $d ] || mount -t tmpfs -o ro tmpfs $d || exit 1; "
    "done; mount -o bind,ro /proc/sys /proc/sys"
)


@as_root
@pytest.mark.skipif(
    not (shutil.which("setpriv") and shutil.which("unshare")), reason="needs util-linux"
)
def test_starts_as_root_without_cap_sys_admin_under_the_documented_container_options():
    """The shipped image runs the worker as root with Docker's default capabilities (no
    CAP_SYS_ADMIN) and a masked /proc; with seccomp and AppArmor unconfined (cluster/README.md)
    the namespaces come from a user namespace and the program runs as nobody."""
    docker = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    docker += [f'{DOCKER_PROC_MASKS} && exec setpriv --bounding-set={DOCKER_CAPS} "$@"', "sh"]
    got = start_reward(docker)
    if not nobody_may_unshare():
        assert REFUSAL_HINT in got.get("refused", ""), got
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {got['refused']}")
    assert got.get("score") == 1.0, got
    assert got["who"] == "65534 65534 []"
    assert set(got["isolation"]) >= {"user", "mount", "pid", "net", "ipc"}


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="syscall numbers for x86_64/aarch64"
)
def test_docker_default_seccomp_gives_the_documented_refusal(nobody_python):
    """Under a seccomp filter that refuses unshare (Docker's default without CAP_SYS_ADMIN),
    ``required`` stops at start naming the container options; ``best_effort`` runs, and as root
    still drops to the unprivileged sandbox user."""
    seccomp = [sys.executable, "-c", SECCOMP_NO_UNSHARE]
    refused = start_reward(seccomp)["refused"]
    assert REFUSAL_HINT in refused
    assert "network_isolation: best_effort" in refused
    fallback = start_reward(seccomp, "best_effort", nobody_python)
    assert fallback["score"] == 1.0 and fallback["isolation"] == []
    if os.geteuid() == 0:
        assert fallback["who"] == "65534 65534 []"


def test_cluster_files_state_the_container_options_of_the_refusal():
    """The options the refusal names are the ones both cluster configurations set."""
    cluster = os.path.join(REPO, "cluster")
    with open(os.path.join(cluster, "ray_up.yaml")) as f:
        run_options = yaml.safe_load(f)["docker"]["run_options"]
    for option in ("seccomp=unconfined", "apparmor=unconfined"):
        assert f"--security-opt {option}" in run_options and option in REFUSAL_HINT
    with open(os.path.join(cluster, "kuberay_raycluster.yaml")) as f:
        spec = yaml.safe_load(f)["spec"]
    for group in (spec["headGroupSpec"], *spec["workerGroupSpecs"]):
        for container in group["template"]["spec"]["containers"]:
            context = container["securityContext"]
            assert context["seccompProfile"] == context["appArmorProfile"] == {"type": "Unconfined"}
            assert "privileged" not in context and "capabilities" not in context
    with open(os.path.join(cluster, "README.md")) as f:
        readme = f.read()
    assert "## The code sandbox" in readme and "no CAP_SYS_ADMIN" in readme


@as_root
def test_best_effort_runs_the_program_as_the_sandbox_user(monkeypatch, shared_tmp, nobody_python):
    """Namespaces refused (simulated) and the worker is root: the program is nobody anyway."""
    monkeypatch.setattr(Sandbox, "_namespaces_work", lambda self: (False, "refused"))
    box = Sandbox(
        SandboxLimits(timeout_s=5), "best_effort", tmp_dir=shared_tmp, python=nobody_python
    )
    assert box.probe() == []
    res = box.run("import os; print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())")
    assert res.stdout.strip() == "65534 65534 65534 []", res
    assert os.listdir(shared_tmp) == []


# -- cgroups -----------------------------------------------------------------------------------


def fake_cgroup_tree(tmp_path, controllers: str = "cpu memory pids", subtree: str = ""):
    """A cgroup v2 mount at ``tmp_path/cg`` with this process in ``/worker``."""
    root = tmp_path / "cg"
    (root / "worker").mkdir(parents=True)
    (root / "worker" / "cgroup.controllers").write_text(controllers + "\n")
    (root / "worker" / "cgroup.subtree_control").write_text(subtree + "\n")
    mountinfo = f"30 1 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n"
    mountinfo = "22 1 0:20 / /proc rw - proc proc rw\n" + mountinfo
    return root, mountinfo, "0::/worker\n"


def test_cgroup_parent_found_and_limits_written(tmp_path):
    root, mountinfo, own = fake_cgroup_tree(tmp_path)
    parent, reason = sandbox_cgroup.find_parent(mountinfo, own)
    assert parent == str(root) and reason == ""  # a sibling of the worker's own cgroup
    limits = SandboxLimits(memory_mb=128, max_processes=8)
    run = sandbox_cgroup.RunCgroup.create(parent, limits)
    files = {f.name: f.read_text() for f in sorted(Path(run.path).iterdir())}
    assert files == {
        "cpu.max": "100000 100000",
        "memory.max": str(128 << 20),
        "memory.swap.max": "0",
        "pids.max": "9",
    }
    for f in files:  # a real cgroup's interface files vanish with rmdir
        os.remove(os.path.join(run.path, f))
    run.remove()
    assert not os.path.exists(run.path)


def test_cgroup_fallback_names_its_reason(tmp_path):
    _, mountinfo, own = fake_cgroup_tree(tmp_path, controllers="hugetlb")
    parent, reason = sandbox_cgroup.find_parent(mountinfo, own)
    assert parent is None
    assert "memory, pids, cpu" in reason and "hugetlb" in reason
    parent, reason = sandbox_cgroup.find_parent("22 1 0:20 / /proc rw - proc proc rw\n", own)
    assert parent is None and "no cgroup v2" in reason


def test_a_cgroup_that_cannot_be_joined_falls_back_instead_of_refusing(monkeypatch, tmp_path):
    """A cgroup parent where runs' cgroups can be made but not joined (here: a plain directory,
    no cgroup.procs) costs the cgroup, not the sandbox."""
    root = fake_cgroup_tree(tmp_path)[0]
    monkeypatch.setattr(sandbox_cgroup, "find_parent", lambda: (str(root), ""))
    # a real cgroup's files vanish with rmdir
    monkeypatch.setattr(sandbox_cgroup.RunCgroup, "remove", lambda run: shutil.rmtree(run.path))
    box = Sandbox(SandboxLimits(timeout_s=5), "required", tmp_dir=str(tmp_path))
    assert "pid" in box.probe()
    assert box.cgroup_parent is None and "cannot join" in box.cgroup_reason
    assert box.run("print(6 * 7)").stdout == "42\n"


def test_this_hosts_cgroup_is_used_or_the_fallback_is_stated(tmp_path, caplog):
    box = Sandbox(SandboxLimits(timeout_s=5), "required", tmp_dir=str(tmp_path))
    box.probe()
    if box.cgroup_parent is None:
        assert "cgroup" in caplog.text and "rlimits" in caplog.text, caplog.text
        pytest.skip(f"no cgroup v2 here: {box.cgroup_reason}")
    before = set(os.listdir(box.cgroup_parent))
    res = box.run("import os\nprint(open('/proc/self/cgroup').read())")
    assert res.category == "ok", res
    assert set(os.listdir(box.cgroup_parent)) == before  # removed after the run
