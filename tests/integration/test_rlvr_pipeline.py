"""The real pipeline (Ray + DeepSpeed ZeRO-3 LoRA + vLLM + reward actors) through run.py.

One uninterrupted run doubles as the smoke test (the session's default run, conftest.py, which
test_export_hf.py reads too); a second run is SIGKILLed after its first checkpoint and resumed,
and its metrics must equal the uninterrupted run's. One 2-step run syncs the LoRA adapter alone
through vLLM's multiprocess engine (the GPU path's process boundary, on CPU); two tests read it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _leaks import LeakWatch, Leftovers
from _pipeline_run import (
    SMALL,
    assert_same_metrics,
    metrics,
    run,
    run_watched,
    served_syncs,
    sigkill_after_first_checkpoint,
    sigkill_worker_after_first_checkpoint,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def straight(default_pipeline_run) -> Path:
    """The uninterrupted run (conftest.py: shared with test_export_hf.py, which exports at
    every save)."""
    return default_pipeline_run[0]


def assert_rollout_is_the_trainers(row: dict, sync: dict) -> None:
    """The parity probe of the sync that served the step (``sync``), and the step's sampled
    tokens scored by the trainer: recomputed old log-probs (``rollout/mismatch_*``) or, where
    vLLM's were reused, the train forward's ratio to them (SMALL makes one optimizer step per
    train step: no update before it)."""
    assert sync["sync/parity_max_abs_diff"] < 1e-4
    assert row["rollout/mismatch_abs_logprob_diff"] < 1e-4
    assert abs(row["actor/ratio_max"] - 1.0) < 1e-4, row["actor/ratio_max"]


def test_pipeline_runs_and_reports(straight: Path):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    served = served_syncs(rows)
    for row in rows[1:]:
        for key in (
            "rollout/score",
            "rollout/accuracy",
            "actor/pg_loss",
            "actor/clipfrac",
            "grad_norm",
            "lr",
            "time/sync",
            "time/rollout",
            "time/train",
            "throughput/generated_tokens_per_s",
        ):
            assert key in row, key
        # After every sync vLLM's log-probs equal the trainer's (fp32): on the probe batch (raw
        # model, T=1) and on the sampled tokens of the step (both at T=0.8).
        assert_rollout_is_the_trainers(row, served[row["step"]])
        # the default's old_logprobs=auto: the parity just shown lets vLLM's numbers stand in
        assert row["actor/old_logprobs_recomputed"] == 0.0
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    run_dir = straight / "rlvr_lora_zero3"
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "rollouts.jsonl").stat().st_size > 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000004"
    assert_startup_profile(json.loads((run_dir / "startup.json").read_text()))


def assert_startup_profile(profile: dict) -> None:
    """The run's start-up profile (roll_ds/pipeline/startup_report.py): every role's ranks with
    their phases, each role having imported only what it uses."""
    roles = profile["roles"]
    assert sorted(roles) == ["actor_infer", "actor_train", "rewards.math", "rewards.reverse"]
    assert [r["rank"] for r in roles["actor_train"]] == [0, 1]
    for role, ranks in roles.items():
        for rank in ranks:
            names = [p["name"] for p in rank["phases"]]
            assert names[:3] == ["boot", "__init__", "initialize"], (role, names)
            assert all(
                p["start"] <= p["end"] <= profile["launch_to_first_step_s"] for p in rank["phases"]
            )
    libraries = {role: set(ranks[0]["libraries"]) for role, ranks in roles.items()}
    assert "vllm" in libraries["actor_infer"] and "deepspeed" not in libraries["actor_infer"]
    assert "deepspeed" in libraries["actor_train"] and "vllm" not in libraries["actor_train"]
    for role in ("rewards.math", "rewards.reverse"):  # rule-based rewards: no tensor library
        assert not libraries[role] & {"torch", "vllm", "deepspeed", "transformers"}, role
    driver = [p["name"] for p in profile["driver"]]
    for name in ("validate", "placement", "initialize stage 0", "step-0 evaluation", "step 1"):
        assert name in driver, (name, driver)


# Slow (CI keeps the kill -9 / resume of the synchronous path in test_mixed_pipeline.py, where
# rows and episodes share one batch): each such test is a killed run plus a resumed one, ~100 s.
@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_matches(straight: Path, tmp_path: Path):
    assert sigkill_after_first_checkpoint(tmp_path) == "step_000002"

    resumed = run(tmp_path, "resume_from_checkpoint=latest")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_metrics(tmp_path, straight, steps=(3, 4))


def test_a_killed_trainer_rank_restarts_the_run_from_its_checkpoint(straight: Path, tmp_path):
    """One actor_train rank SIGKILLed once step 2's checkpoint is saved (while step 3 runs):
    the driver tears every role down, starts them again and resumes from step 2 by itself
    (fault_tolerance.max_trainer_restarts), and steps 3 and 4 log what the uninterrupted run
    logged, plus faults/*; nothing of the dead rank or of the first attempt is left behind."""
    result, left, killed = sigkill_worker_after_first_checkpoint(tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ActorTrainWorker" in killed
    logs = result.stdout + result.stderr  # Hydra sends the log to stdout
    assert "automatic restart 1 of 2" in logs, logs[-4000:]
    assert not left, left.describe()
    assert_same_metrics(tmp_path, straight, steps=(3, 4), ignore=("faults/",))
    rows = {r["step"]: r for r in metrics(tmp_path)}
    for step in (3, 4):
        assert rows[step]["faults/restarts"] == 1.0
        assert rows[step]["faults/lost_seconds"] > 0.0
    assert "faults/restarts" not in rows[2]  # logged by the attempt that failed later
    print(f"\nrestart lost {rows[4]['faults/lost_seconds']:.1f} s")


# Slow (~3 min: two start-ups and the bound itself). CI covers a hung rank's bound at the Ray
# level (test_cluster_failures.py) and a restart after a trainer rank dies (the test above).
@pytest.mark.slow
def test_a_trainer_rank_that_stops_answering_mid_step_restarts_the_run(tmp_path: Path):
    """Issue 34's "collective made to hang": actor_train rank 1 stops answering at the start of
    step 1's train step (``ROLL_DS_TEST_HANG_TRAIN_STEP``, roll_ds/distributed/hang_hook.py),
    so rank 0 waits for it in the step's collectives. The call's bound
    (fault_tolerance.call_timeout_s) ends the wait naming the ranks, the driver restarts the
    run (no checkpoint yet: from the start) and it finishes; nothing is left behind."""
    import re
    import time

    marker = tmp_path / "hung-once"
    bound_s = 45  # a train step of the tiny model takes seconds; start-up has its own bound
    start = time.perf_counter()
    result, left, _ = run_watched(
        tmp_path,
        "max_steps=2",
        "save_steps=0",
        "eval_steps=0",
        f"fault_tolerance.call_timeout_s={bound_s}",
        f'+actor_train.system_envs.ROLL_DS_TEST_HANG_TRAIN_STEP="1:{marker}"',
        timeout=900,
    )
    took = time.perf_counter() - start
    logs = result.stdout + result.stderr
    assert result.returncode == 0, logs[-4000:]
    assert marker.exists()  # the hang happened (once: the restarted rank 1 trained)
    named = re.search(
        rf"actor_train\.train_step\w*\(\): ranks \[(0, )?1\] did not answer within {bound_s} s",
        logs,
    )
    assert named, logs[-4000:]
    assert "automatic restart 1 of 2" in logs, logs[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["faults/restarts"] == 1.0 for r in rows)
    assert not left, left.describe()
    print(f"\nhung rank 1: named after the {bound_s} s bound, run restarted, done in {took:.0f} s")


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, Leftovers, LeakWatch]:
    """One 2-step run with ``weight_sync.lora_sync=adapter`` over a gloo broadcast group, through
    vLLM's multiprocess engine (``ROLL_DS_VLLM_MULTIPROC=1``, the role's system_envs), watched for
    leftovers; the two tests below assert on it. One run, not one each: the in-process engine
    takes the same adapter through the same worker extension, so the multiprocess run covers it
    and also crosses vLLM's serializer (a run costs ~60 s of CI here)."""
    out = tmp_path_factory.mktemp("adapter")
    result, left, watch = run_watched(
        out,
        "max_steps=2",
        "save_steps=0",
        "eval_steps=0",
        "weight_sync.lora_sync=adapter",
        "weight_sync.transport=collective",
        '+actor_infer.system_envs.ROLL_DS_VLLM_MULTIPROC="1"',
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result, left, watch


def test_adapter_sync_over_a_collective_group(straight: Path, adapter_run):
    """``weight_sync.lora_sync=adapter`` through a gloo broadcast group: only the LoRA adapter
    travels, vLLM serves base + adapter, and its log-probs still equal the trainer's."""
    out = adapter_run[0]
    rows = metrics(out)
    merged = {r["step"]: r for r in metrics(straight)}
    merged_syncs = served_syncs(metrics(straight))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert_rollout_is_the_trainers(row, row)  # no evaluation: every step syncs
        # r16 adapters on every linear layer of the 428k-parameter model: 0.31 MB vs 1.7 MB
        assert row["sync/bytes"] < merged_syncs[row["step"]]["sync/bytes"] / 4
    # Step 1 samples from the untrained adapter (lora_B = 0): the same rollouts as merged.
    for key in ("rollout/score", "rollout/response_length"):
        assert rows[0][key] == pytest.approx(merged[1][key], rel=1e-6), key


def test_two_steps_across_vllms_process_boundary(adapter_run):
    """``ROLL_DS_VLLM_MULTIPROC=1`` (the role's system_envs): the engine core and its worker are
    processes of their own as on GPU, so the collective seats and the adapter target cross
    vLLM's serializer; every sync still reaches parity with the trainer (the test above). The
    run leaves nothing behind: vLLM's message queues in /dev/shm (``psm_*``, 400 MB of them
    before the workers closed at shutdown) and every process it started are gone once it
    ends."""
    _, result, left, watch = adapter_run
    assert "(EngineCore pid=" in result.stdout  # the engine core logged from its own process
    assert any(name.startswith("psm_") for name in watch.files), watch.files  # it had some
    assert not left, left.describe()


def test_bad_data_fails_before_training_with_file_and_line(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "1+1=", "ground_truth": "2"}\n'
        "not json\n"
        '{"prompt": "", "ground_truth": "3"}\n'
        '{"prompt": "2+2=", "ground_truth": 4}\n'
        '{"ground_truth": "5"}\n'
    )
    result = run(tmp_path, f"actor_train.data_args.file_name=[{bad}]", timeout=300)
    assert result.returncode == 2
    err = result.stderr
    assert f"{bad}:2: not valid JSON" in err
    assert f"{bad}:3: field 'prompt' is empty" in err
    assert f"{bad}:4: field 'ground_truth' must be a string" in err
    assert f"{bad}:5: missing field 'prompt'" in err
    assert "Traceback" not in err


def test_a_sync_that_moved_nothing_is_caught_by_the_probe_riding_on_the_rollout(tmp_path):
    """The synchronous loop defers the engines' side of the parity probe to the rollout's
    generate call: a step whose sync moved nothing (the engines still serve the previous
    weights) must stop at that rollout, before anything trains on it."""
    from roll_ds.config import load_config
    from roll_ds.pipeline.rlvr import RLVRPipeline
    from roll_ds.weight_sync.parity import WeightSyncParityError

    cfg = load_config(
        "rlvr_lora_zero3",
        [
            *SMALL,
            f"output_dir={tmp_path}",
            "eval_steps=0",
            "save_steps=0",
            "actor_train.training_args.learning_rate=0.05",  # a gap far above the bound
        ],
    )
    pipeline = RLVRPipeline(cfg)
    pipeline.start()
    try:
        assert pipeline.policy_sync.mode == "on_rollout"
        first = pipeline.train_one_step(0)
        assert first["sync/parity_max_abs_diff"] < 1e-4  # from the rollout's generate call
        pipeline.policy_sync.transport.sync = lambda train, infer: {}  # moves nothing
        with pytest.raises(WeightSyncParityError, match="actor_infer rank 0"):
            pipeline.train_one_step(1)
        assert pipeline.policy_version == 1  # step 1 never trained
    finally:
        pipeline.shutdown()


# Slow: one more run of the pipeline (~90 s). CI replaces a SIGKILLed rank of a real Ray role in
# test_cluster_failures.py (the same Recovery, without the pipeline around it).
@pytest.mark.slow
def test_a_reward_actor_killed_mid_run_is_replaced_and_the_run_learns_the_same(
    straight: Path, tmp_path: Path
):
    """fault_tolerance: a reward actor SIGKILLed after step 2's checkpoint is replaced in place
    at step 3's scoring, which is redone; the run ends with ``faults/rewards.<role>/restarts``
    1, every learning metric equal to the uninterrupted run's, and nothing left behind (the
    dead actor's process and files)."""
    result, left, killed = sigkill_worker_after_first_checkpoint(tmp_path, worker="RewardWorker")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RewardWorker" in killed
    assert not left, left.describe()
    rows = {r["step"]: r for r in metrics(tmp_path)}
    restarts = {k: v for k, v in rows[4].items() if k.endswith("/restarts")}
    assert len(restarts) == 1 and list(restarts.values()) == [1.0], restarts
    role = next(iter(restarts)).split("/")[1]
    assert f"faults/{role}/lost_s" in rows[3]  # step 3 scored on the dead actor
    assert "replacing in place" in result.stdout + result.stderr  # Hydra logs to stdout
    assert_same_metrics(tmp_path, straight, steps=tuple(rows), ignore=("faults/",))


# Slow: one more run of the pipeline each (~140 s on a shared 2-core box). CI covers the parts:
# the sync redone after a dead engine (tests/unit/pipeline/test_policy_sync_faults.py), a dead
# engine under two rollout threads on real Ray actors (test_engine_replacement.py), and a gloo
# group left and re-formed after a member was SIGKILLed (tests/unit/weight_sync/).
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_rollout_engine_killed_mid_run_is_replaced_and_the_run_learns_the_same(
    straight: Path, tmp_path: Path, transport: str
):
    """fault_tolerance: the vLLM engine (actor_infer's one rank) SIGKILLed once step 2's
    checkpoint is saved: the next call on it (step 3's weight sync, or its generate call if the
    kill landed after that sync) replaces it on its bundle, syncs the trainer's weights in with
    the parity check (``collective``: over a group re-formed with the new engine) and redoes the
    work; the run ends with ``faults/actor_infer/restarts`` 1, every learning and eval metric
    equal to the uninterrupted run's (``object_store``, the CPU default), and nothing of the
    dead engine left behind (its process, its /dev/shm files)."""
    result, left, killed = sigkill_worker_after_first_checkpoint(
        tmp_path, f"weight_sync.transport={transport}", worker="RolloutWorker"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RolloutWorker" in killed
    assert not left, left.describe()
    rows = {r["step"]: r for r in metrics(tmp_path)}
    assert rows[4]["faults/actor_infer/restarts"] == 1.0
    assert "faults/actor_infer/lost_s" in rows[3]  # step 3 ran into the dead engine
    assert "replacing in place" in result.stdout + result.stderr  # Hydra logs to stdout
    assert_same_metrics(tmp_path, straight, steps=tuple(rows), ignore=("faults/",))


# Slow: two more runs of the pipeline (full fine-tuning with a reference role, ~100 s each).
@pytest.mark.slow
def test_a_reference_killed_mid_run_is_replaced_and_the_run_learns_the_same(tmp_path: Path):
    """fault_tolerance: the reference (``rlvr_full_zero3``'s hf_infer role, KL on) SIGKILLed
    once step 2's checkpoint is saved: step 3's reference log-probs replace it in place (the
    pretrained weights loaded again) and are redone; the run ends with
    ``faults/reference/restarts`` 1, every learning and eval metric (the KL among them) equal
    to the uninterrupted run's, and nothing of the dead actor left behind."""
    config, exp = "rlvr_full_zero3", "rlvr_full_zero3"
    straight = tmp_path / "straight"
    done = run(straight, *SMALL, config=config)
    assert done.returncode == 0, done.stderr[-4000:]
    killed_dir = tmp_path / "killed"
    result, left, killed = sigkill_worker_after_first_checkpoint(
        killed_dir, *SMALL, worker="StrategyWorker", config=config
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "StrategyWorker" in killed
    assert not left, left.describe()
    rows = {r["step"]: r for r in metrics(killed_dir, exp)}
    assert rows[4]["faults/reference/restarts"] == 1.0
    assert "faults/reference/lost_s" in rows[3]  # step 3's reference pass found it dead
    assert "replacing in place" in result.stdout + result.stderr  # Hydra logs to stdout
    assert_same_metrics(killed_dir, straight, steps=tuple(rows), exp_name=exp, ignore=("faults/",))
