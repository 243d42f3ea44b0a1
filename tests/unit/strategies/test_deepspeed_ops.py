"""DeepSpeed op builds at start-up (issue 19): a build lock left by a killed build is cleared,
and a wait on a live build is bounded and names what it waits for, instead of a silent hang."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from strategies.deepspeed import ops

REPO = Path(__file__).resolve().parents[3]


def stale_lock(root: Path, op: str = "deepspeed_shm_comm") -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # as torch's FileBaton makes it, then dies
    return lock


def holder(lock: Path) -> subprocess.Popen:
    """A live builder: a process that has the lock file open."""
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time; f = open({str(lock)!r}); print(1, flush=True); "
         "time.sleep(120)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    child.stdout.readline()  # the file is open
    return child


def test_the_extensions_root_is_torchs(tmp_path, monkeypatch):
    torch_ext = pytest.importorskip("torch.utils.cpp_extension")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert ops.extensions_root() == tmp_path / "ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(torch_ext, "get_default_build_root", lambda: str(tmp_path / "default"))
    assert ops.extensions_root() == Path(torch_ext._get_build_directory("probe", False)).parent


def test_a_lock_no_process_holds_is_cleared_with_a_warning(tmp_path, caplog):
    lock = stale_lock(tmp_path)
    with caplog.at_level(logging.WARNING, logger=ops.__name__):
        assert ops.clear_stale_locks(tmp_path, recheck_s=0.05) == [lock]
    assert not lock.exists()
    assert f"removed {lock}" in caplog.text and "'deepspeed_shm_comm'" in caplog.text


def test_a_lock_a_live_build_holds_is_kept_and_the_wait_is_bounded(tmp_path):
    lock = stale_lock(tmp_path, "cpu_adam")
    child = holder(lock)
    try:
        assert ops.lock_holders(lock) == [child.pid]
        assert ops.clear_stale_locks(tmp_path, recheck_s=0.05) == []
        assert lock.exists()
        start = time.monotonic()
        with pytest.raises(ops.OpBuildTimeout) as err:
            ops.wait_for_lock(lock, timeout_s=1.0, stale_poll_s=0.2)
        assert time.monotonic() - start < 10
        message = str(err.value)
        assert "'cpu_adam'" in message and str(lock) in message and f"pid {child.pid}" in message
        assert ops.OP_BUILD_TIMEOUT_ENV in message
    finally:
        child.kill()
        child.wait()


def test_a_wait_whose_builder_dies_clears_the_lock(tmp_path):
    lock = stale_lock(tmp_path)
    child = holder(lock)
    child.kill()  # an OOM kill mid-build, while another rank waits
    child.wait()
    with pytest.raises(ops._LockCleared):
        ops.wait_for_lock(lock, timeout_s=60, stale_poll_s=0.1)
    assert not lock.exists()


def test_a_lock_released_normally_ends_the_wait(tmp_path):
    lock = stale_lock(tmp_path)
    child = holder(lock)
    lock.unlink()  # the build finished
    ops.wait_for_lock(lock, timeout_s=5)
    child.kill()
    child.wait()


# The start-up path itself: a DeepSpeed rank's init_distributed, which builds deepspeed_shm_comm
# on CPU. The compiler step is stubbed (it records that the build lock was taken); a stale lock
# used to make it wait forever before that point.
STARTUP = textwrap.dedent(
    """
    import sys
    from torch.utils import cpp_extension

    def build(**kwargs):
        print("BUILD", kwargs["name"], flush=True)
        sys.exit(0)

    cpp_extension._write_ninja_file_and_build_library = build
    from strategies._common import init_distributed
    init_distributed()
    """
)


@pytest.mark.parametrize("held_by_live_build", [False, True])
def test_startup_with_a_stale_lock_builds_instead_of_hanging(tmp_path, held_by_live_build):
    lock = stale_lock(tmp_path)
    child = holder(lock) if held_by_live_build else None
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), **{ops.OP_BUILD_TIMEOUT_ENV: "3"})
    # the CPU path on any machine: DeepSpeed builds deepspeed_shm_comm for its CPU accelerator
    env.update(ROLL_DS_DEVICE="cpu", DS_ACCELERATOR="cpu")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    try:
        run = subprocess.run(
            [sys.executable, "-c", STARTUP], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
    finally:
        if child is not None:
            child.kill()
            child.wait()
    if held_by_live_build:  # a live build past the bound: an error naming it, not a hang
        assert run.returncode != 0
        assert "OpBuildTimeout" in run.stderr and str(lock) in run.stderr, run.stderr[-2000:]
    else:
        assert "BUILD deepspeed_shm_comm" in run.stdout, run.stderr[-2000:]
        assert f"removed {lock}" in run.stderr


MOUNTS = """\
overlay / overlay rw,relatime 0 0
server:/export/home /home nfs4 rw,relatime 0 0
/dev/sda1 /home/me/local ext4 rw 0 0
gcsfuse /mnt/bucket fuse.gcsfuse rw 0 0
/dev/sdb /mnt/my\\040disk xfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/tmp/x/lock", "overlay"),
        ("/home/me/.cache/torch_extensions/py311_cpu/cpu_adam/lock", "nfs4"),
        ("/home/me/local/lock", "ext4"),
        ("/home/me/localx/lock", "nfs4"),
        ("/mnt/bucket/a/lock", "fuse.gcsfuse"),
        ("/mnt/my disk/lock", "xfs"),
    ],
)
def test_the_file_system_of_a_lock(path, kind):
    assert ops.filesystem_type(path, MOUNTS) == kind


def test_a_lock_on_a_shared_file_system_is_never_cleared(tmp_path, monkeypatch):
    # a build on another machine mounting the same cache does not show in this /proc
    lock = stale_lock(tmp_path)
    monkeypatch.setattr(ops, "_shared_filesystem", lambda path: True)
    assert ops.lock_holders(lock) is None
    assert ops.clear_stale_locks(tmp_path, recheck_s=0.05) == []
    with pytest.raises(ops.OpBuildTimeout, match="cannot see"):
        ops.wait_for_lock(lock, timeout_s=0.5, stale_poll_s=0.1)
    assert lock.exists()


@pytest.mark.parametrize(
    ("value", "generic"),
    [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("8.6 10.0f", "8.6 10.0"), ("8.0", "8.0")],
)
def test_arch_specific_targets_are_made_generic(value, generic):
    assert ops.generic_arch_list(value) == generic


def test_deepspeed_parses_the_arch_list_inside_load_ops_and_it_is_restored(monkeypatch):
    """DeepSpeed's own CUDA op builder fails on ``9.0a`` (as FusedAdam did on an H100 whose image
    sets it); inside ``load_ops`` it reads ``9.0``, and the variable is back afterwards."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    def arch_args() -> str:
        builder = FusedAdamBuilder()
        builder.jit_mode = True  # as in a JIT load: the targets come from TORCH_CUDA_ARCH_LIST
        builder.compute_capability_args()
        return os.environ[ops.ARCH_LIST_ENV]

    monkeypatch.setenv(ops.ARCH_LIST_ENV, "8.0;9.0a")
    with pytest.raises(ValueError, match="invalid literal for int"):
        arch_args()
    assert ops.load_ops(arch_args) == "8.0;9.0+PTX"  # as DeepSpeed rewrote it while building
    assert os.environ[ops.ARCH_LIST_ENV] == "8.0;9.0a"
