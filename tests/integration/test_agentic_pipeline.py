"""The agentic pipeline end to end through run.py: Ray, DeepSpeed ZeRO-3 LoRA, vLLM generating
turn by turn from exact token sequences, environment workers, GRPO over episode groups.

One uninterrupted run doubles as the smoke test (multi-turn episodes happened, vLLM's log-probs
of the policy tokens in those multi-turn sequences equal the trainer's, the dumps read turn by
turn); a second run is SIGKILLed after its first checkpoint and resumed, and its metrics must
equal the uninterrupted run's; in others a trainer rank or the environment host is SIGKILLed
mid-run and the run goes on by itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_run import (
    assert_same_metrics,
    metrics,
    run,
    run_watched,
    served_syncs,
    sigkill_after_first_checkpoint,
    sigkill_worker_after_first_checkpoint,
)

from roll_ds.agentic.kill_hook import ENV as KILL_ENV_HOST

pytestmark = pytest.mark.integration

CONFIG = "agentic_lora_zero3"
SMALL = [
    "max_steps=3",
    "save_steps=2",
    "eval_steps=3",
    "train_env_manager.num_env_groups=4",
    "train_env_manager.group_size=4",
    "train_env_manager.num_groups_partition=[2,2]",
    "val_env_manager.num_env_groups=8",
    "actor_train.training_args.per_device_train_batch_size=8",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "tracking.tensorboard=false",
    "export.at_end=false",
    # the trainer must score each turn at the temperature it was sampled at
    "actor_infer.generating_args.temperature=0.8",
]


TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_start|>={{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_start|>{{ m['content'] }}<|im_end|>{%- endif -%}{%- endfor -%}"
)


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory) -> str:
    """The embedded policy with a chat template: untrained for these environments, so its
    episodes run to their turn limit (long multi-turn sequences), which is what this test needs;
    learning is the slow tier's."""
    import shutil

    from transformers import AutoTokenizer

    from roll_ds.models.shipped import EMBEDDED_MODEL, resolve_embedded

    path = tmp_path_factory.mktemp("chat_policy") / "model"
    shutil.copytree(resolve_embedded(EMBEDDED_MODEL), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def small(chat_policy: str) -> list[str]:
    return [*SMALL, f"pretrain={chat_policy}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, small) -> Path:
    out = tmp_path_factory.mktemp("agentic")
    result = run(out, *small, config=CONFIG)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_agentic_run_trains_on_multi_turn_episodes(straight: Path):
    rows = metrics(straight, CONFIG)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        for key in (
            "rollout/success",
            "rollout/GuessNumber/success",
            "rollout/Calculator/success",
            "rollout/turns_per_episode",
            "rollout/tool_calls",
            "rollout/format_errors",
            "rollout/env_seconds_per_step",
            "rollout/tokens_per_turn",
            "env/errors",
            "time/rollout_generate",
            "time/rollout_env",
            "actor/pg_loss",
            "grad_norm",
        ):
            assert key in row, key
        assert row["rollout/turns_per_episode"] > 1.0  # multi-turn sequences were trained
        assert row["env/errors"] == 0 and row["env/timeouts"] == 0
        # vLLM's sampled log-probs over every policy turn of the multi-turn sequences equal
        # the trainer's recomputation (fp32, T=0.8): observation tokens between turns did not
        # shift anything
        assert row["rollout/mismatch_abs_logprob_diff"] < 1e-4
        assert served_syncs(rows)[row["step"]]["sync/parity_max_abs_diff"] < 1e-4
    assert "eval/success" in rows[0] and "eval/success" in rows[-1]
    run_dir = straight / CONFIG
    dumped = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert dumped and all("turns" in d and "status" in d for d in dumped)
    first = dumped[0]["turns"][0]
    assert set(first) == {"action", "observation", "reward"}
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


# Slow (CI keeps the kill -9 / resume of episodes in test_mixed_pipeline.py, where rows and
# episodes share one batch): each such test is a killed run plus a resumed one, ~100 s.
@pytest.mark.slow
def test_agentic_resume_after_sigkill_matches(straight: Path, small, tmp_path: Path):
    assert sigkill_after_first_checkpoint(tmp_path, *small, config=CONFIG) == "step_000002"
    resumed = run(tmp_path, *small, "resume_from_checkpoint=latest", config=CONFIG)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_metrics(tmp_path, straight, steps=(3,), exp_name=CONFIG)


@pytest.mark.slow
def test_agentic_killed_trainer_rank_restarts_and_matches(straight: Path, small, tmp_path):
    """Multi-turn episodes: an actor_train rank SIGKILLed after step 2's checkpoint restarts
    the run by itself, and step 3 logs the uninterrupted run's metrics."""
    result, left, _ = sigkill_worker_after_first_checkpoint(tmp_path, *small, config=CONFIG)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not left, left.describe()
    assert_same_metrics(tmp_path, straight, steps=(3,), exp_name=CONFIG, ignore=("faults/",))
    assert {r["step"]: r for r in metrics(tmp_path, CONFIG)}[3]["faults/restarts"] == 1.0


# The environment host's step call the kill hook ends (roll_ds/agentic/kill_hook.py): counted
# over the host's life, step 0's evaluation first (6 turns); measured to land in step 1's
# rollout, in its third turn's step: the 8 GuessNumber episodes still running are played again
# (the Calculator ones had ended at their 3-turn limit).
KILL_AT_STEP_CALL = 9
KILLED_IN_STEP = 1


# Slow: one more run of the pipeline (~100 s). CI covers the parts: the pool replacing a
# SIGKILLed host and the runner replaying its episodes exactly (tests/integration/
# test_env_pool_ray.py), the redo's bookkeeping (tests/unit/agentic/test_runner_redo.py).
@pytest.mark.slow
def test_an_env_host_killed_mid_step_is_replaced_and_the_run_learns_the_same(
    straight: Path, small, tmp_path: Path
):
    """fault_tolerance: the environment host SIGKILLed in the middle of a step's episodes is
    replaced by the pool, every episode it held is played again from its start (same
    environment seeds, same generation seeds, so the same tokens from vLLM), and the run ends
    with ``faults/env_hosts/restarts`` 1, every learning and eval metric equal to the
    uninterrupted run's, and nothing left behind."""
    marker = tmp_path / "env_host_killed"
    result, left, _ = run_watched(
        tmp_path, *small, config=CONFIG, env={KILL_ENV_HOST: f"{KILL_AT_STEP_CALL}:{marker}"}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert marker.exists()  # the hook fired
    assert not left, left.describe()
    output = result.stdout + result.stderr  # Hydra logs to stdout
    assert "replacing in place" in output and "played again from their start" in output
    rows = {r["step"]: r for r in metrics(tmp_path, CONFIG)}
    assert rows[3]["faults/env_hosts/restarts"] == 1.0
    lost = [step for step, row in rows.items() if "faults/env_hosts/lost_s" in row]
    assert lost == [KILLED_IN_STEP], lost
    assert rows[KILLED_IN_STEP]["faults/env_hosts/redone_episodes"] == 8.0
    assert_same_metrics(tmp_path, straight, steps=tuple(rows), exp_name=CONFIG, ignore=("faults/",))


# Slow: one more run of the pipeline (~100 s).
@pytest.mark.slow
def test_an_env_host_killed_under_stream_is_replaced_and_its_episodes_redone(small, tmp_path):
    """mode stream, two versions ahead: the host SIGKILLed while the rollout threads play
    steps ahead on it; the episodes it held (of whichever steps) are played again on its
    replacement, none ends as an environment error, staleness stays bounded, every sync
    reaches parity, and nothing is left behind. (No comparison with an uninterrupted run:
    where a sync pauses the stream is timing's.)"""
    marker = tmp_path / "env_host_killed"
    stream = ("async_generation.max_staleness=2", "async_generation.mode=stream")
    result, left, _ = run_watched(
        tmp_path,
        *small,
        *stream,
        config=CONFIG,
        env={KILL_ENV_HOST: f"{KILL_AT_STEP_CALL}:{marker}"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert marker.exists() and not left, left.describe()
    assert "played again from their start" in result.stdout + result.stderr
    rows = {r["step"]: r for r in metrics(tmp_path, CONFIG)}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[3]["faults/env_hosts/restarts"] == 1.0
    redone = {s: r.get("faults/env_hosts/redone_episodes", 0.0) for s, r in rows.items() if s}
    assert sum(redone.values()) > 0, redone  # the kill caught episodes in flight
    served = served_syncs(list(rows.values()))
    for step in (1, 2, 3):
        assert rows[step]["env/errors"] == 0 and rows[step]["env/timeouts"] == 0
        assert 0.0 <= rows[step]["rollout/staleness"] <= 2.0, rows[step]
        assert served[step]["sync/parity_max_abs_diff"] < 1e-4
