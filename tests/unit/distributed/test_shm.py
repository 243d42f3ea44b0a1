"""The /dev/shm ledger and sweep (``roll_ds/distributed/shm.py``) on real processes: which names
a scan records (mapped or open by the run's process tree), and that the sweep removes exactly
those still pointing at the recorded file, never a file it did not record."""

from __future__ import annotations

import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from roll_ds.distributed.shm import ShmLedger, held_files, process_tree, scan, unlink_recorded

# A child that maps argv[1] (a file it creates), opens argv[2], and, with argv[3] set, starts a
# grandchild that maps argv[3]; it prints "ready" once everything is held, then sleeps.
HOLDER = r"""
import mmap, os, subprocess, sys, time
def hold(path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    return mmap.mmap(fd, 4096)
keep = [hold(sys.argv[1]), open(sys.argv[2], "rb")]
if len(sys.argv) > 3:
    cmd = [sys.executable, "-c", sys.argv[4], sys.argv[3]]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
print("ready", flush=True)
time.sleep(600)
"""
GRANDCHILD = r"""
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A stand-in for /dev/shm holding another run's file, which no scan may ever pick."""
    (tmp_path / "theirs").write_bytes(b"x" * 100)
    return tmp_path


def start_holder(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen) -> None:
    for pid in process_tree([proc.pid]) - {proc.pid}:
        subprocess.run(["kill", "-9", str(pid)], check=False)
    proc.kill()
    proc.wait()


def test_scan_records_what_the_tree_maps_and_opens_and_nothing_else(shm: Path):
    (shm / "opened").write_bytes(b"y" * 10)
    proc = start_holder(str(shm / "mapped"), str(shm / "opened"), str(shm / "grand"), GRANDCHILD)
    try:
        tree = process_tree([proc.pid])
        assert proc.pid in tree and len(tree) == 2  # the holder and its grandchild
        found = scan([proc.pid], shm_dir=shm)
        assert set(found) == {"mapped", "opened", "grand"}  # never "theirs"
        for name, inode in found.items():
            assert inode == (shm / name).stat().st_ino
        # the holder alone, without its descendants, does not hold the grandchild's file
        assert set(held_files([proc.pid], shm_dir=shm)) == {"mapped", "opened"}
    finally:
        stop(proc)


def test_sweep_removes_the_recorded_files_the_dead_run_left_and_keeps_the_rest(shm: Path):
    (shm / "opened").write_bytes(b"y" * 10)
    proc = start_holder(str(shm / "mapped"), str(shm / "opened"))
    ledger = ShmLedger()
    ledger.record("node-a", scan([proc.pid], shm_dir=shm))
    stop(proc)  # SIGKILL, as ray.kill: nothing unlinked
    (shm / "late").write_bytes(b"z")  # made after the scan by someone else: not ours
    removed = ledger.sweep("node-a", shm_dir=shm)
    assert removed == {"mapped": 4096, "opened": 10}
    assert sorted(p.name for p in shm.iterdir()) == ["late", "theirs"]
    assert ledger.sweep("node-a", shm_dir=shm) == {}  # swept once, then forgotten


def test_a_name_reused_by_another_file_is_not_removed(shm: Path):
    (shm / "reused").write_bytes(b"1")
    recorded = {"reused": (shm / "reused").stat().st_ino}
    with open(shm / "reused", "rb"):  # holds the old inode so the new file cannot reuse it
        (shm / "reused").unlink()  # our creator unlinked it properly...
        (shm / "reused").write_bytes(b"2")  # ...and another run made a file of the same name
        assert unlink_recorded(recorded, shm_dir=shm) == {}
        assert (shm / "reused").read_bytes() == b"2"


def test_names_outside_the_directory_are_never_touched(shm: Path):
    (shm / "sub").mkdir()
    (shm / "sub" / "f").write_bytes(b"1")
    outside = shm.parent / f"{shm.name}-outside"
    outside.write_bytes(b"1")
    try:
        bad = {
            "sub/f": (shm / "sub" / "f").stat().st_ino,
            f"../{outside.name}": outside.stat().st_ino,
        }
        assert unlink_recorded(bad, shm_dir=shm) == {}
        assert outside.exists() and (shm / "sub" / "f").exists()
    finally:
        outside.unlink()


def test_the_ledger_keeps_nodes_apart(shm: Path):
    (shm / "a").write_bytes(b"1")
    (shm / "b").write_bytes(b"1")
    ledger = ShmLedger()
    ledger.record("node-a", {"a": (shm / "a").stat().st_ino})
    ledger.record("node-b", {"b": (shm / "b").stat().st_ino})
    assert ledger.sweep("node-a", shm_dir=shm) == {"a": 1}
    assert (shm / "b").exists()
    assert ledger.recorded("node-b") == {"b": (shm / "b").stat().st_ino}


def test_a_real_dev_shm_segment_of_a_child_is_found():
    """Python's shared_memory (what vLLM's message queues use: ``psm_*``), in /dev/shm."""
    code = (
        "from multiprocessing import shared_memory, resource_tracker; import time\n"
        "m = shared_memory.SharedMemory(create=True, size=1 << 16)\n"
        "resource_tracker.unregister(m._name, 'shared_memory')\n"  # its leak is the test's
        "print(m.name, flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip().lstrip("/")
    try:
        deadline = time.monotonic() + 10
        while name not in (found := scan([proc.pid])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert name.startswith("psm_") and name in found
    finally:
        proc.kill()
        proc.wait()
    assert unlink_recorded({name: found[name]}) == {name: 1 << 16}
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def test_the_children_a_killed_process_left_are_ended_and_nothing_else():
    """``descendants`` records a process's children with their start times; once the parent
    is SIGKILLed (its children live on, as vLLM's engine core under a killed actor),
    ``end_processes`` kills those still there, and leaves a pid whose start time differs (a
    later process reusing it) alone."""
    import signal

    from roll_ds.distributed.shm import descendants, end_processes, start_time

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    recorded = descendants(parent.pid)
    assert recorded == {child: start_time(child)}
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert start_time(child) is not None  # the orphan lives on
    assert end_processes({child: recorded[child] + 1}) == []  # not the recorded process
    assert end_processes(recorded) == [child]
