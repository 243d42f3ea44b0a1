"""A run's orderly end over its clusters: record the ``/dev/shm`` files the workers hold, close
the workers (so their libraries unlink what they made), kill them, and sweep what a worker that
died or did not close in time left (``shm.py``: what creates each file, why it survives).

    cluster.record_shm()                  # after initialize: every rank is alive and idle
    ...
    cluster.shutdown()                    # record again, close (bounded), ray.kill, sweep
    shutdown_clusters(clusters)           # the same for several roles, one shared bound

The scan reads ``/proc`` of the actor processes and their children, on the actor's node: in the
driver for its own node, in a pinned 0-CPU task elsewhere. It never calls the actors, so a
worker busy in (or stuck on) a call is scanned all the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from roll_ds.distributed import devices
from roll_ds.distributed.shm import (
    ShmLedger,
    descendants,
    end_and_wait,
    scan,
    unlink_recorded,
    wait_ended,
)

logger = logging.getLogger(__name__)

REMOTE_TIMEOUT_S = 30.0  # a scan or sweep task on another node
# How long a shutdown waits for the ranks' ``close``: a vLLM engine's shutdown waits up to 5 s
# for its worker processes; a rank stuck in a call (a failed run) is killed after it.
CLOSE_TIMEOUT_S = 30.0
# How long a dead rank's GPUs may take to be free of it once its processes ended (the driver
# frees a CUDA context after its process exits; vLLM's KV cache is most of a GPU).
GPU_RELEASE_TIMEOUT_S = 60.0

# The functions take ``Cluster``s (``cluster.py`` imports this module, not the other way):
# ``.name``, ``.actors``, ``.infos``, ``.shm``, ``.record_shm()``, ``.shutdown()``.
Cluster = Any


def worker_pids(clusters: Iterable[Cluster]) -> dict[str | None, list[int]]:
    """``{node id: [pid]}`` of every started rank (``Cluster.infos``, filled at start-up)."""
    by_node: dict[str | None, list[int]] = {}
    for cluster in clusters:
        for info in cluster.infos:
            if info.get("pid"):
                by_node.setdefault(info.get("node_id"), []).append(int(info["pid"]))
    return by_node


def record_shm(ledger: ShmLedger, clusters: Iterable[Cluster]) -> None:
    """Add to ``ledger`` the files the clusters' processes (and their children) hold now."""
    for node, pids in worker_pids(clusters).items():
        try:
            ledger.record(node, _on_node(node, scan, pids))
        except Exception as exc:  # a node that is gone: its files went with it
            logger.warning("could not list the /dev/shm files held on node %s: %s", node, exc)


def record_children(cluster: Cluster) -> None:
    """Each rank's child processes now (``cluster.children``: rank -> {pid: start time}), so
    a rank that is killed and replaced does not leave them running (``end_children``)."""
    for rank, info in enumerate(cluster.infos):
        if not info.get("pid"):
            continue
        try:
            cluster.children[rank] = _on_node(info.get("node_id"), descendants, int(info["pid"]))
        except Exception as exc:  # a node that is gone: its processes went with it
            logger.warning("could not list the child processes on node %s: %s", info, exc)


def end_children(info: dict[str, Any], recorded: dict[int, int]) -> list[int]:
    """SIGKILL what a killed rank (``info``) had started that still runs (``recorded``:
    ``record_children``'s) and wait (bounded) until it is gone: a SIGKILLed process's children
    are not killed with it, and vLLM's engine core would hold its memory and message queues
    for the rest of the run (or the GPU a replacement is about to claim)."""
    if not recorded:
        return []
    try:
        killed, alive = _on_node(info.get("node_id"), end_and_wait, recorded, REMOTE_TIMEOUT_S / 2)
    except Exception as exc:
        logger.warning("could not end a dead worker's child processes %s: %s", recorded, exc)
        return []
    if killed:
        logger.warning("ended %d process(es) a dead worker left: pids %s", len(killed), killed)
    if alive:
        logger.warning("processes a dead worker left still run after SIGKILL: pids %s", alive)
    return killed


def retire_ranks(ranks: Sequence[tuple[dict[str, Any], dict[int, int]]]) -> list[dict[str, Any]]:
    """What must be gone before killed ranks' replacements start on their bundles (``ranks``:
    each one's ``Cluster.infos`` entry and ``record_children``'s processes): its process
    (``ray.kill`` only asks for it), the processes it started (``end_children``) and, on GPUs,
    their memory (``devices.wait_released``, once per node; vLLM refuses to start below its
    share of free memory). Each wait is bounded; what was still there is logged and the
    replacement then starts anyway (its own start fails with its own error). Per rank
    ``{"gone", "ended_children"}``, and ``"gpu"`` (its node's wait; None without GPUs)."""
    out, by_node = [], {}
    for info, recorded in ranks:
        try:
            gone = wait_gone(info)
        except Exception as exc:  # its node is gone, and the process with it
            logger.warning("could not watch a killed worker's process %s: %s", info.get("pid"), exc)
            gone = True
        if not gone:
            logger.warning(
                "a killed worker (pid %s) still runs after %.0f s",
                info.get("pid"),
                REMOTE_TIMEOUT_S,
            )
        out.append({"gone": gone, "ended_children": end_children(info, recorded)})
        if info.get("gpu_uuids"):
            node = by_node.setdefault(info.get("node_id"), {"uuids": set(), "pids": set()})
            node["uuids"].update(info["gpu_uuids"])
            node["pids"].update([*recorded, *([info["pid"]] if info.get("pid") else [])])
    waited = {
        node: wait_gpu_released(
            {"node_id": node, "gpu_uuids": sorted(g["uuids"])}, sorted(g["pids"])
        )
        for node, g in by_node.items()
    }
    for (info, _), result in zip(ranks, out, strict=True):
        result["gpu"] = waited.get(info.get("node_id")) if info.get("gpu_uuids") else None
    return out


def wait_gpu_released(
    info: dict[str, Any], pids: list[int], timeout_s: float = GPU_RELEASE_TIMEOUT_S
) -> dict[str, Any] | None:
    """On the rank's node, wait (bounded) until its GPUs (``info["gpu_uuids"]``) are free of
    ``pids`` and their free memory stopped rising; None for a rank without GPUs."""
    uuids = list(info.get("gpu_uuids") or ())
    if not uuids:
        return None
    try:
        out = _on_node(
            info.get("node_id"),
            devices.wait_released,
            uuids,
            pids,
            timeout_s,
            wait_s=timeout_s + REMOTE_TIMEOUT_S,  # its own bound, and the task's start
        )
    except Exception as exc:
        logger.warning("could not watch a dead worker's GPUs %s: %s", uuids, exc)
        return None
    if out["released"] is False:
        logger.warning(
            "a dead worker's GPUs %s still held after %.0f s (free MiB %s); starting its "
            "replacement anyway",
            uuids,
            timeout_s,
            out["free_mib"],
        )
    return out


def sweep_shm(ledger: ShmLedger) -> dict[str, int]:
    """Unlink the recorded files still there (the workers are dead); ``{name: bytes}``."""
    removed: dict[str, int] = {}
    for node in list(ledger.files):
        try:
            removed.update(_on_node(node, unlink_recorded, ledger.files.pop(node)))
        except Exception as exc:
            logger.warning("could not sweep /dev/shm on node %s: %s", node, exc)
    _log_removed(removed, "the run's workers")
    return removed


def _log_removed(removed: dict[str, int], who: str) -> None:
    if removed:
        logger.warning(
            "removed %d /dev/shm file(s) (%.1f MB) %s left: %s",
            len(removed),
            sum(removed.values()) / 1e6,
            who,
            ", ".join(sorted(removed)),
        )


def sweep_rank_shm(
    ledger: ShmLedger, live: Iterable[dict[str, Any]], dead: dict[str, Any]
) -> dict[str, int]:
    """After one rank died (``Cluster.replace_rank``): unlink the files ``ledger`` recorded on
    its node that no live rank of the cluster (``live``: their infos) holds now; those stay
    recorded for the sweep at shutdown. ``{name: bytes}`` removed."""
    node = dead.get("node_id")
    recorded = ledger.recorded(node)
    if not recorded:
        return {}
    pids = [int(i["pid"]) for i in live if i.get("pid") and i.get("node_id") == node]
    try:
        held = _on_node(node, scan, pids) if pids else {}
        orphans = {name: inode for name, inode in recorded.items() if name not in held}
        removed = _on_node(node, unlink_recorded, orphans)
    except Exception as exc:  # the node is gone, and its files with it
        logger.warning("could not sweep /dev/shm of a dead worker on node %s: %s", node, exc)
        return {}
    ledger.files[node] = {n: i for n, i in recorded.items() if n not in orphans}
    _log_removed(removed, "a dead worker")
    return removed


def wait_gone(info: dict[str, Any], timeout_s: float = REMOTE_TIMEOUT_S) -> bool:
    """Wait (bounded) until the process of a killed rank (``info``: its ``Cluster.infos``
    entry) has exited, on its node; ``ray.kill`` only asks for it. False if still there."""
    if not info.get("pid"):
        return True
    pid = int(info["pid"])
    return _on_node(info.get("node_id"), _wait_exit, pid, timeout_s, wait_s=timeout_s + 10.0)


def _wait_exit(pid: int, timeout_s: float) -> bool:
    return not wait_ended({pid: None}, timeout_s)


def close_clusters(clusters: Iterable[Cluster], timeout_s: float) -> list[str]:
    """Call ``close`` on every idle rank of every cluster at once and wait at most
    ``timeout_s`` in all; returns the ``role rank`` of those that did not close (busy in a
    call of the cluster's, dead, failed, or late: the kill that follows ends them, the sweep
    removes their files)."""
    pending = {}
    unclosed = []
    for cluster in clusters:
        busy = cluster.busy_ranks()
        for rank, actor in enumerate(cluster.actors):
            if rank in busy:  # its close would wait behind the call, maybe a stuck one
                unclosed.append(f"{cluster.name} rank {rank}")
                continue
            try:
                pending[actor.close.remote()] = f"{cluster.name} rank {rank}"
            except Exception:  # a handle Ray already dropped: nothing to close
                continue
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(
            list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
        )
        if not ready:
            break
        ref = ready[0]
        who = pending.pop(ref)
        try:
            ray.get(ref)
        except Exception as exc:
            unclosed.append(who)
            logger.info("%s did not close cleanly: %s", who, str(exc).splitlines()[0])
    unclosed += pending.values()
    if pending:
        logger.warning(
            "%s did not close within %.0f s; killing them",
            ", ".join(pending.values()),
            timeout_s,
        )
    return unclosed


def shutdown_clusters(clusters: Sequence[Cluster], close_timeout_s: float | None = None) -> None:
    """``Cluster.shutdown`` of every cluster with their idle ranks closed at once, under one
    bound (``CLOSE_TIMEOUT_S`` by default): late ranks cost one wait, not one per role."""
    if not clusters or not ray.is_initialized():
        for cluster in clusters:
            cluster.shutdown(close_timeout_s=0)
        return
    for cluster in clusters:
        cluster.record_shm()  # what was made since start-up, by the ranks still alive
    close_clusters(clusters, CLOSE_TIMEOUT_S if close_timeout_s is None else close_timeout_s)
    for cluster in clusters:
        cluster.shutdown(close_timeout_s=0)


def _on_node(node: str | None, fn, *args, wait_s: float = REMOTE_TIMEOUT_S):
    """``fn(*args)`` on ``node``: here when it is the driver's node (or unknown), else in a
    0-CPU task pinned there, waited for at most ``wait_s``."""
    if node is None or node == ray.get_runtime_context().get_node_id():
        return fn(*args)
    task = ray.remote(fn).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    )
    return ray.get(task.remote(*args), timeout=wait_s)
