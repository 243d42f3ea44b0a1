"""Run a function on N local processes that form a torchrun-style process group (no Ray).

    results = run_distributed(check_something, world_size=2, args=(path,))

``fn(*args)`` runs in every rank with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
set (the strategies create the gloo group from them); its return value (picklable) comes back
per rank. A rank that raises fails the call with that rank's traceback; a hang is killed after
``timeout_s``. ``fn`` must be importable by name (a module-level function of a test module).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from roll_ds.distributed.shm import held_files, scan, unlink_recorded


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any], rank: int, env: dict[str, str], args: Sequence[Any], out
) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        import torch

        torch.set_num_threads(1)
        out.put((rank, True, fn(*args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    base_env = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, base_env, tuple(args), out), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"{fn.__name__}: ranks {sorted(set(range(world_size)) - set(results))} "
                    f"gave no result within {timeout_s:.0f} s"
                ) from None
            (results if ok else errors)[rank] = value
            if errors:  # peers of a failed rank usually hang in a collective
                break
    finally:
        # /dev/shm files the ranks hold (on a GPU the CUDA driver's cuda.shm.*, which a rank
        # that is killed, or exits while a peer still maps it, leaves behind), removed once the
        # ranks are gone unless this process holds them too
        held = scan([p.pid for p in procs if p.pid is not None])
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        ours = held_files([os.getpid()])
        unlink_recorded({n: i for n, i in held.items() if n not in ours})
    if errors:
        rank, tb = min(errors.items())
        raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{tb}")
    return [results[r] for r in range(world_size)]
