"""The GPU check's ``nccl`` stage (scripts/gpu/check.sh): what one GPU shows of NCCL's answer to a
weight-sync timeout, of the weight-sync group's join and of a dead rank's GPU memory coming back
(issue 41, items 1, 2, 4 and 5).

    python scripts/gpu/nccl_check.py WORK      WORK/nccl.json; without a CUDA GPU: skipped, rc 0

``watchdog``: two processes at once, each with a first NCCL group (uid 0, as DeepSpeed's world in a
trainer or vLLM's in an engine worker) and then a one-member weight-sync group
(``roll_ds.weight_sync.group.TransferGroup``, blocking wait) whose broadcast is made to time out
(the GPU stream held by a sleep kernel past the group's timeout). One runs with torch's defaults
(``TORCH_NCCL_DUMP_ON_TIMEOUT`` on), one with roll_ds's device-rank env
(``roll_ds.platform.CUDA.process_env()``); the heartbeat window is shortened
(``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) and each process waits past it, then runs a collective on
its first group. Expected: torch's default ends its process (the dump-and-abort), roll_ds's
survives and its first group still works.

``join``: a weight-sync group whose second member never comes fails the join within its timeout
(the store rendezvous), and a group that formed has its communicator initialised when join
returns (``ProcessGroupNCCL._is_initialized``), before any broadcast.

``release``: a child holding ``HOLD_GIB`` of GPU memory is SIGKILLed, and
``roll_ds.distributed.devices.wait_released`` waits until its pid holds nothing and free memory
stopped rising (what a replacement engine waits for before it starts); the JSON has the free
memory at the kill and when the wait returned, and how long it took.

Each part runs in a child process of its own (``child ...``), bounded; the JSON holds their
events, return codes and the tail of their stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HEARTBEAT_S = 10  # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC in the watchdog children
GROUP_TIMEOUT_S = 3.0  # the weight-sync group's timeout there
SURVIVE_S = 3 * HEARTBEAT_S  # how long past the timeout a child waits before its last collective
CHILD_TIMEOUT_S = 120.0
HOLD_GIB = 16  # what the ``release`` child allocates (a vLLM engine's share is tens of GiB)
DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": round(time.monotonic(), 2), **fields}), flush=True)


def first_group():
    """This process's first NCCL group (uid 0), a world of one on its own store."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    return store


def child_watchdog() -> None:
    import torch
    import torch.distributed as dist

    from roll_ds.weight_sync.base import TransferError
    from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store

    torch.cuda.set_device(0)
    first = first_group()
    ones = torch.ones(4, device="cuda:0")
    dist.all_reduce(ones)
    torch.cuda.synchronize()
    store, host, port = open_store(30.0)
    spec = GroupSpec(host, port, 1, "nccl", GROUP_TIMEOUT_S, prefix="nccl_check/watchdog")
    group = TransferGroup(spec, 0, device="cuda:0", store=store)
    emit("joined", initialised=bool(group.pg._is_initialized()))
    props = torch.cuda.get_device_properties(0)
    rate_hz = getattr(props, "clock_rate", 2_000_000) * 1000  # kHz -> cycles per second
    torch.cuda._sleep(int(rate_hz * (GROUP_TIMEOUT_S + 5)))  # the stream busy past the timeout
    started = time.monotonic()
    try:
        group.broadcast(torch.zeros(1 << 10, device="cuda:0"), "the timed-out probe")
        emit("no_timeout", seconds=round(time.monotonic() - started, 2))
    except TransferError as exc:
        emit("timed_out", seconds=round(time.monotonic() - started, 2), error=str(exc)[:300])
    group.close()
    for waited in range(SURVIVE_S):
        time.sleep(1)
        if waited % 5 == 4:
            emit("alive", seconds_after=waited + 1)
    dist.all_reduce(ones)  # the first group still works
    torch.cuda.synchronize()
    emit("survived", first_group_sum=float(ones.sum()))
    dist.destroy_process_group()
    del first


def child_join() -> None:
    import torch

    from roll_ds.weight_sync.base import TransferError
    from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store

    torch.cuda.set_device(0)
    store, host, port = open_store(30.0)
    spec = GroupSpec(host, port, 2, "nccl", 5.0, prefix="nccl_check/absent")
    started = time.monotonic()
    try:
        TransferGroup(spec, 0, device="cuda:0", store=store)
        emit("absent_member_joined_anyway")
    except TransferError as exc:
        emit(
            "absent_member_fails_join",
            seconds=round(time.monotonic() - started, 2),
            timeout_s=spec.timeout_s,
            error=str(exc)[:300],
        )
    store, host, port = open_store(30.0)
    spec = GroupSpec(host, port, 1, "nccl", 30.0, prefix="nccl_check/formed")
    started = time.monotonic()
    group = TransferGroup(spec, 0, device="cuda:0", store=store)
    emit(
        "formed",
        join_seconds=round(time.monotonic() - started, 2),
        initialised_at_join=bool(group.pg._is_initialized()),
    )
    tensor = torch.full((8,), 3.0, device="cuda:0")
    group.broadcast(tensor, "probe")
    emit("broadcast", value=float(tensor[0]))
    group.close()


def child_hold() -> None:
    import torch

    held = torch.empty(HOLD_GIB << 30, dtype=torch.uint8, device="cuda:0")
    held.fill_(1)
    torch.cuda.synchronize()
    emit("holding", gib=HOLD_GIB)
    time.sleep(CHILD_TIMEOUT_S)


def release_check() -> dict:
    """SIGKILL a process holding GPU memory, then ``wait_released`` as the replacement does."""
    import signal

    from roll_ds.distributed.devices import gpu_usage, visible_gpu_uuids, wait_released

    uuids = visible_gpu_uuids()[:1]
    proc = subprocess.Popen(
        [sys.executable, __file__, "child", "hold"], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline() if proc.stdout else ""
    holding = usage_before = None
    if '"holding"' in line:
        holding = json.loads(line)
        usage_before = gpu_usage(uuids)
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    at_kill = gpu_usage(uuids)
    waited = wait_released(uuids, [proc.pid], 60.0)
    proc.wait(10)

    def free(usage):
        return {u: use.free_mib for u, use in (usage or {}).items()}

    return {
        "holding": holding,
        "pid_held_memory_before_kill": bool(
            usage_before and any(proc.pid in use.pids for use in usage_before.values())
        ),
        "free_mib_before_kill": free(usage_before),
        "free_mib_at_kill": free(at_kill),
        "wait": waited,
        "seconds_after_kill": round(time.monotonic() - killed_at, 2),
    }


def run_child(what: str, env: dict[str, str]) -> dict:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "child", what],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = None, exc.stdout or "", exc.stderr or ""
        out, err = (s.decode(errors="replace") if isinstance(s, bytes) else s for s in (out, err))
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    killed_by_torch = any(w in err for w in ("terminateProcess", "Terminating the process"))
    return {
        "rc": rc,
        "seconds": round(time.monotonic() - started, 1),
        "events": events,
        "survived": any(e["event"] == "survived" for e in events),
        "stderr_mentions_termination": killed_by_torch,
        "stderr_tail": err[-1500:],
    }


def watchdog_env(dump: str | None) -> dict[str, str]:
    """The child's env: a short heartbeat window and dump wait; ``dump`` None: torch's default."""
    env = dict(os.environ)
    env.update(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=str(HEARTBEAT_S))
    env.update(TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="1000")
    env.pop(DUMP, None)
    if dump is not None:
        env[DUMP] = dump
    return env


def check() -> dict:
    try:
        import torch
    except ImportError as exc:
        return {"skipped": f"no torch: {exc}"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU (torch.cuda.is_available() is False)"}
    from roll_ds.platform import CUDA

    roll_ds_env = CUDA.process_env()
    out: dict = {"roll_ds_env": roll_ds_env, "heartbeat_s": HEARTBEAT_S}
    # the two watchdog children at once (one GPU, a process group each), then the join
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        torch_default = pool.submit(run_child, "watchdog", watchdog_env(None))
        ours = pool.submit(run_child, "watchdog", watchdog_env(roll_ds_env[DUMP]))
        out["watchdog_torch_default"] = torch_default.result()
        out["watchdog_roll_ds_env"] = ours.result()
    out["join"] = run_child("join", dict(os.environ))
    out["release"] = release_check()
    out["ok"] = {
        "released_before_replacement": out["release"]["wait"]["released"] is True,
        "roll_ds_env_survives": out["watchdog_roll_ds_env"]["survived"],
        "torch_default_ended": not out["watchdog_torch_default"]["survived"],
        "absent_member_fails_join": any(
            e["event"] == "absent_member_fails_join" for e in out["join"]["events"]
        ),
        "initialised_at_join": any(e.get("initialised_at_join") for e in out["join"]["events"]),
    }
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["child"]:
        {"watchdog": child_watchdog, "join": child_join, "hold": child_hold}[argv[1]]()
        return 0
    work = Path(argv[0])
    work.mkdir(parents=True, exist_ok=True)
    result = check()
    (work / "nccl.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result.get("ok", result), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
