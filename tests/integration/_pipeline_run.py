"""Running the real pipeline through run.py in a subprocess (shared by the pipeline tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _leaks import LeakWatch, Leftovers, become_subreaper

from roll_ds.config.compose import PROJECT_ROOT

SMALL = [
    "max_steps=4",
    "save_steps=2",
    "eval_steps=4",
    "rollout_batch_size=4",
    "num_return_sequences_in_group=4",
    "actor_train.training_args.per_device_train_batch_size=8",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "validation.max_prompts=32",
    "tracking.tensorboard=false",
    # Not the default 1.0: the trainer must score the rollouts at the temperature they were
    # sampled at, which the mismatch check below then covers.
    "actor_infer.generating_args.temperature=0.8",
]
# Wall-clock and what derives from it (throughput, FLOP/s, MFU) differ between runs, under any
# role's prefix (critic/perf/mfu); everything else must not.
VOLATILE_SECTIONS = ("time", "throughput", "perf")
VOLATILE_KEYS = ("seconds", "gbps")


def is_volatile(key: str) -> bool:
    return any(s in VOLATILE_SECTIONS for s in key.split("/")[:-1]) or any(
        w in key for w in VOLATILE_KEYS
    )


def command(out_dir: Path, *extra: str, config: str = "rlvr_lora_zero3") -> list[str]:
    """run.py on ``config``; the RLVR default gets the small settings above."""
    small = SMALL if config == "rlvr_lora_zero3" else []
    return [
        sys.executable,
        "run.py",
        "--config-name",
        config,
        f"output_dir={out_dir}",
        *small,
        *extra,
    ]


def run(
    out_dir: Path, *extra: str, timeout: float = 600, config: str = "rlvr_lora_zero3"
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(out_dir, *extra, config=config),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def run_watched(
    out_dir: Path,
    *extra: str,
    timeout: float = 600,
    config: str = "rlvr_lora_zero3",
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess, Leftovers, LeakWatch]:
    """``run`` under a ``LeakWatch`` (``_leaks.py``): also what the run left behind, and what
    it held while it ran. ``env``: variables added to the run's environment (test hooks)."""
    cmd = command(out_dir, *extra, config=config)
    proc = subprocess.Popen(
        cmd,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=become_subreaper,  # its orphans stay in the watched tree (_leaks.py)
    )
    watch = LeakWatch(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = watch.leftovers()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), left, watch


def metrics(out_dir: Path, exp_name: str = "rlvr_lora_zero3") -> list[dict]:
    path = out_dir / exp_name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not is_volatile(k)}


def wait_for_checkpoint(proc: subprocess.Popen, latest: Path, timeout: float) -> None:
    """Until the run ``proc`` marks its first checkpoint complete (``latest``)."""
    deadline = time.monotonic() + timeout
    while not latest.exists():
        assert proc.poll() is None, "run ended before writing a checkpoint"
        assert time.monotonic() < deadline, f"no checkpoint within {timeout:g} s"
        time.sleep(0.2)


def sigkill_after_first_checkpoint(
    out_dir: Path, *extra: str, timeout: float = 600, config: str = "rlvr_lora_zero3"
) -> str:
    """Start a run, SIGKILL it (and everything it started) once its first checkpoint is
    complete; returns the checkpoint's name (the experiment is named like ``config``)."""
    proc = subprocess.Popen(
        command(out_dir, *extra, config=config),
        cwd=PROJECT_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest = out_dir / config / "checkpoints" / "latest"
    try:
        wait_for_checkpoint(proc, latest, timeout)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return latest.read_text()


def sigkill_worker_after_first_checkpoint(
    out_dir: Path,
    *extra: str,
    worker: str = "ActorTrainWorker",
    timeout: float = 600,
    config: str = "rlvr_lora_zero3",
) -> tuple[subprocess.CompletedProcess, Leftovers, str]:
    """Start a run, SIGKILL one ``worker`` actor's process (one rank) once the run's first
    checkpoint is complete, and let the run go on to its end (under a ``LeakWatch``); returns
    the run, what it left behind and the killed process's command line (the experiment is
    named like ``config``)."""
    cmd = command(out_dir, *extra, config=config)
    proc = subprocess.Popen(
        cmd,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=become_subreaper,  # the killed rank's orphans stay in the watched tree
    )
    watch = LeakWatch(proc.pid)
    latest = out_dir / config / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    try:
        wait_for_checkpoint(proc, latest, timeout)
        import psutil

        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if f"ray::{worker}" in " ".join(p.cmdline())
        ]
        assert ranks, f"no {worker} process under the run"
        killed = " ".join(ranks[-1].cmdline())
        ranks[-1].kill()
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = watch.leftovers()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), left, killed


def assert_same_metrics(
    got_dir: Path,
    want_dir: Path,
    steps: tuple[int, ...],
    exp_name: str = "rlvr_lora_zero3",
    ignore: tuple[str, ...] = (),
) -> None:
    """Both runs logged the same steps, and at ``steps`` the same stable metrics (a resumed run
    against an uninterrupted one); keys starting with one of ``ignore`` are left out."""
    import pytest

    def kept(row: dict) -> dict:
        return {k: v for k, v in stable(row).items() if not k.startswith(ignore)}

    got = {r["step"]: kept(r) for r in metrics(got_dir, exp_name)}
    want = {r["step"]: kept(r) for r in metrics(want_dir, exp_name)}
    assert sorted(got) == sorted(want)
    for step in steps:
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


def served_syncs(rows: list[dict]) -> dict[int, dict]:
    """For each train step's row, the ``sync/*`` metrics of the sync that put the weights it
    sampled with into the engines: the step's own or, where an evaluation at the end of the
    step before had synced them already (``eval/sync/*`` in that row), that evaluation's."""
    by_step = {r["step"]: r for r in rows}
    out = {}
    for row in rows:
        if row["step"] == 0:
            continue
        if "sync/parity_max_abs_diff" in row:
            out[row["step"]] = {k: v for k, v in row.items() if k.startswith("sync/")}
        else:
            before = by_step[row["step"] - 1]
            out[row["step"]] = {
                k.removeprefix("eval/"): v for k, v in before.items() if k.startswith("eval/sync/")
            }
    return out
