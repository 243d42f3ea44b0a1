"""Asynchronous rollouts (``async_generation.max_staleness=1``) on the real pipeline.

vLLM generates step t+1's batch while the trainer trains step t: from the second step on each
batch is one policy version old, TIS corrects for it, and a run SIGKILLed after a checkpoint
resumes to exactly the uninterrupted run's metrics (the batch generated ahead is stored in the
checkpoint). A rollout actor killed mid-overlap stops the run with an error naming it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from _leaks import LeakWatch, become_subreaper
from _pipeline_run import (
    assert_same_metrics,
    command,
    metrics,
    run,
    served_syncs,
    sigkill_after_first_checkpoint,
    sigkill_worker_after_first_checkpoint,
)

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = pytest.mark.integration

ASYNC = ("async_generation.max_staleness=1",)
# vLLM's engine core in a process of its own, as on GPU (the CPU default keeps it in the actor)
MULTIPROC = '+actor_infer.system_envs.ROLL_DS_VLLM_MULTIPROC="1"'


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async_straight")
    result = run(out, *ASYNC)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_batches_are_one_version_old_and_corrected(straight: Path):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    train_rows = rows[1:]
    # Step 1 trains on the batch the initial weights generated: on-policy. Every later batch
    # was generated while the step before it trained, by the weights before that step.
    assert [r["rollout/staleness"] for r in train_rows] == [0.0, 1.0, 1.0, 1.0]
    served = served_syncs(rows)
    for row in train_rows:
        assert served[row["step"]]["sync/parity_max_abs_diff"] < 1e-4
        # pi_t, not the stale rollout's; on-policy (step 1) the default's auto reuses vLLM's
        assert row["actor/old_logprobs_recomputed"] == float(row["rollout/staleness"] > 0)
        assert "actor/tis_weight_mean" in row  # TIS is on (tis_cap null -> 2.0 under async)
        assert "time/rollout_wait" in row  # mode batch: the sync waits for the step ahead
    # On-policy, the rollout's log-probs are the trainer's; one version later they are not.
    assert train_rows[0]["rollout/mismatch_abs_logprob_diff"] < 1e-4
    assert all(r["rollout/mismatch_abs_logprob_diff"] > 1e-3 for r in train_rows[1:])
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]


# Slow (CI keeps the kill -9 / resume of async batch k=1 in test_mixed_pipeline.py, where rows and
# episodes share one batch): each such test is a killed run plus a resumed one, ~100 s.
@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_matches(straight: Path, tmp_path: Path):
    assert sigkill_after_first_checkpoint(tmp_path, *ASYNC) == "step_000002"
    checkpoint = tmp_path / "rlvr_lora_zero3" / "checkpoints" / "step_000002"
    assert (checkpoint / "rollouts_in_flight.json").is_file()  # step 3's, played ahead
    resumed = run(tmp_path, *ASYNC, "resume_from_checkpoint=latest")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_metrics(tmp_path, straight, steps=(3, 4))


def assert_restarted_once(result, left, rows: dict) -> None:
    """The run ended by itself after one automatic restart, leaving nothing behind."""
    assert result.returncode == 0, result.stderr[-4000:]
    assert not left, left.describe()
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert [rows[s]["faults/restarts"] for s in (3, 4)] == [1.0, 1.0]
    assert "faults/restarts" not in rows[2]


# Slow (CI restarts the synchronous run in test_rlvr_pipeline.py): a run and its restart.
@pytest.mark.slow
def test_a_killed_trainer_rank_restarts_with_the_batch_played_ahead(straight: Path, tmp_path):
    """mode batch, one step ahead: the restart resumes step 2's checkpoint with step 3's batch
    that was in flight, and steps 3 and 4 log the uninterrupted run's metrics."""
    result, left, _ = sigkill_worker_after_first_checkpoint(tmp_path, *ASYNC)
    assert_restarted_once(result, left, {r["step"]: r for r in metrics(tmp_path)})
    assert_same_metrics(tmp_path, straight, steps=(3, 4), ignore=("faults/",))


def test_rollout_actor_killed_mid_overlap_fails_fast_naming_it(tmp_path: Path):
    """With ``fault_tolerance.max_restarts=0`` a dead engine stops the run (a replaced one:
    ``test_a_rollout_engine_killed_under_stream_is_replaced_and_its_requests_redone``). The
    engine core runs in a process of its own (as on GPU) so the killed rollout actor
    leaves vLLM's message queues in /dev/shm, with nobody left to unlink them: the failed
    run's shutdown sweeps them, and no process of the run outlives it."""
    proc = subprocess.Popen(
        command(
            tmp_path,
            *ASYNC,
            "max_steps=200",
            "save_steps=0",
            "eval_steps=0",
            "fault_tolerance.max_restarts=0",
            MULTIPROC,
        ),
        cwd=PROJECT_ROOT,
        stdout=(log := tmp_path / "stdout.log").open("w"),  # Hydra logs there
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=become_subreaper,  # the killed actor's orphans stay in the watched tree
    )
    watch = LeakWatch(proc.pid)
    metrics_file = tmp_path / "rlvr_lora_zero3" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2):
            assert proc.poll() is None, "run ended early"
            assert time.monotonic() < deadline, "no training step within 600 s"
            time.sleep(0.2)
        [rollout] = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "RolloutWorker" in " ".join(p.cmdline())
        ]
        rollout.kill()
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=180)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "actor_infer" in stderr and "rank 0" in stderr, stderr[-3000:]
    assert took < 120, took
    start = time.monotonic()
    left = watch.leftovers()
    assert any(name.startswith("psm_") for name in watch.files), watch.files
    print(
        f"\nleak watch: {watch.polls} polls, {watch.poll_s:.1f} s; waited "
        f"{time.monotonic() - start:.1f} s for the run's processes to exit; run took {took:.0f} s"
        " from the kill"
    )
    assert not left, left.describe()
    swept = [line for line in log.read_text().splitlines() if "/dev/shm file(s)" in line]
    print(f"\n/dev/shm held by the run: {sorted(watch.files)}; swept at its end: {swept}")


STREAM = ("async_generation.max_staleness=2", "async_generation.mode=stream")


# Slow (CI restarts the synchronous run in test_rlvr_pipeline.py): a run and its restart.
@pytest.mark.slow
def test_a_killed_trainer_rank_restarts_the_stream(tmp_path: Path):
    """mode stream, two versions ahead: the batches in flight at step 2's checkpoint are
    trained on after the restart, staleness stays bounded and every sync reaches parity. (No
    comparison with an uninterrupted run: where a sync pauses the stream is timing's.)"""
    result, left, _ = sigkill_worker_after_first_checkpoint(tmp_path, *STREAM)
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert_restarted_once(result, left, rows)
    served = served_syncs(list(rows.values()))
    for step in (3, 4):
        assert 0.0 <= rows[step]["rollout/staleness"] <= 2.0, rows[step]
        assert served[step]["sync/parity_max_abs_diff"] < 1e-4


# Slow (CI keeps the kill -9 / resume of stream k=2 in test_mixed_pipeline.py, where rows and
# episodes share one batch): each such test is a killed run plus a resumed one, ~100 s.
@pytest.mark.slow
def test_streaming_two_versions_ahead_then_sigkill_and_resume(tmp_path: Path):
    """``mode=stream``: batches of steps t+1 and t+2 generate in the engine's request stream
    while step t trains; each sync pauses it between decode steps. Staleness is bounded by
    admission (<= 2, measured per token), parity holds after every sync, and the batches in
    flight at a checkpoint are stored with it: the resumed run trains on them."""
    assert sigkill_after_first_checkpoint(tmp_path, *STREAM) == "step_000002"
    checkpoint = tmp_path / "rlvr_lora_zero3" / "checkpoints" / "step_000002"
    import json

    saved = json.loads((checkpoint / "rollouts_in_flight.json").read_text())
    assert [s["step"] for s in saved] == [2, 3]  # played ahead, every token's version kept
    assert all(len(e["token_versions"]) == len(e["token_ids"]) for e in saved[0]["episodes"])
    resumed = run(tmp_path, *STREAM, "resume_from_checkpoint=latest")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    served = served_syncs(list(rows.values()))
    for step in (1, 2, 3, 4):
        row = rows[step]
        assert 0.0 <= row["rollout/staleness_mean"] <= row["rollout/staleness"] <= 2.0, row
        assert served[step]["sync/parity_max_abs_diff"] < 1e-4
        assert "time/rollout_wait" not in row  # the sync does not wait for the batches
    assert rows[1]["rollout/staleness"] == 0.0  # the first batch: the initial weights only
    assert "sync/pause_s" in rows[2]


def drawn_ids(out_dir: Path, *extra: str, steps: int) -> dict[int, list[str]]:
    """Each train step's prompt ids (one per sample, sorted) as the run's sampler draws them:
    the synchronous loop's order, which the steps played ahead keep (``rollout_queue.py``)."""
    from _pipeline_run import SMALL
    from transformers import AutoTokenizer

    from roll_ds.config import load_config
    from roll_ds.models.shipped import resolve_pretrain
    from roll_ds.pipeline.tasks import Tasks

    cfg = load_config("rlvr_lora_zero3", [*SMALL, f"output_dir={out_dir}", *extra])
    tasks = Tasks.load(cfg, AutoTokenizer.from_pretrained(resolve_pretrain(cfg.pretrain)))
    group = cfg.num_return_sequences_in_group
    drawn = {step: tasks.draw_rows(tasks.row_groups) for step in range(1, steps + 1)}
    return {
        step: sorted(tasks.train_rows[i]["id"] for i in rows for _ in range(group))
        for step, rows in drawn.items()
    }


# Slow: one more run of the pipeline (~150 s on a shared 2-core box).
@pytest.mark.slow
def test_a_rollout_engine_killed_under_stream_is_replaced_and_its_requests_redone(tmp_path):
    """mode stream, two versions ahead, the engine core in a process of its own: the vLLM
    actor SIGKILLed once step 2's checkpoint is saved (the streams of the steps ahead in it)
    is replaced on its bundle with the trainer's weights (parity checked), the requests it had
    not returned are submitted to the new engine, and the run ends: every step trains on
    exactly the prompts the sampler drew for it, every sync reaches parity, and nothing of
    the dead engine is left (its engine-core process, its /dev/shm queues)."""
    extra = (*STREAM, MULTIPROC, "tracking.dump_rollouts_every=1")
    result, left, killed = sigkill_worker_after_first_checkpoint(
        tmp_path, *extra, worker="RolloutWorker"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RolloutWorker" in killed
    assert not left, left.describe()
    logs = result.stdout + result.stderr  # Hydra logs to stdout
    assert "replacing in place" in logs
    # the engine core outlived the SIGKILLed actor (its child): the replacement ended it
    assert "process(es) a dead worker left" in logs, logs[-4000:]
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert rows[4]["faults/actor_infer/restarts"] == 1.0
    served = served_syncs(list(rows.values()))
    for step in (3, 4):
        assert 0.0 <= rows[step]["rollout/staleness"] <= 2.0, rows[step]
        assert served[step]["sync/parity_max_abs_diff"] < 1e-4
    import json

    dumped: dict[int, list[str]] = {}
    for line in (tmp_path / "rlvr_lora_zero3" / "rollouts.jsonl").read_text().splitlines():
        row = json.loads(line)
        dumped.setdefault(row["step"], []).append(row["id"])
    assert {s: sorted(ids) for s, ids in dumped.items()} == drawn_ids(tmp_path, *extra, steps=4)
