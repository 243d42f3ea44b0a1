"""Dataset rows and environment episodes in one batch, end to end through run.py
(``rlvr_mixed_calculator``): math / reverse rows scored by their reward roles and Calculator
episodes rewarded by their environment, in the same steps, trained together, evaluated together
(``eval/accuracy`` and ``eval/success``), and resumed after a SIGKILL: synchronously with metrics
equal to an uninterrupted run's, and with steps played ahead (``async_generation`` batch and
stream) on exactly the episodes in flight at the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_run import assert_same_metrics, metrics, run, sigkill_after_first_checkpoint

pytestmark = pytest.mark.integration

CONFIG = "rlvr_mixed_calculator"
SMALL = [
    "max_steps=3",
    "save_steps=2",
    "eval_steps=3",
    "rollout_batch_size=4",  # 2 groups of rows, 2 of Calculator episodes
    "num_return_sequences_in_group=4",
    "train_env_manager.num_env_groups=2",
    "val_env_manager.num_env_groups=8",
    "validation.max_prompts=16",
    "actor_train.training_args.per_device_train_batch_size=8",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "tracking.tensorboard=false",
    "export.at_end=false",
    "actor_infer.generating_args.temperature=0.8",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed")
    result = run(out, *SMALL, config=CONFIG)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_rows_and_episodes_train_and_evaluate_in_one_batch(straight: Path):
    rows = metrics(straight, CONFIG)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        # rows: scored by the reward roles per domain; episodes: by their environment
        for key in ("rollout/accuracy", "rollout/response_length", "rollout/Calculator/success"):
            assert key in row, key
        assert row["rollout/turns_per_episode"] >= 1.0 and row["env/errors"] == 0
        # vLLM's log-probs of every policy token, row or turn, equal the trainer's
        assert row["rollout/mismatch_abs_logprob_diff"] < 1e-4
    for row in (rows[0], rows[-1]):
        assert {"eval/accuracy", "eval/math/accuracy", "eval/success"} <= set(row)
    dumped = [
        json.loads(line) for line in (straight / CONFIG / "rollouts.jsonl").read_text().splitlines()
    ]
    assert {d["domain"] for d in dumped} >= {"Calculator"} and any(
        d["domain"] in ("math", "reverse") for d in dumped
    )


# Slow (a killed run plus a resumed one, ~100 s): CI resumes mixed batches in the two played-ahead
# tests below, and a synchronous run's exact resume in test_rlvr_pipeline.py's trainer restart.
@pytest.mark.slow
def test_mixed_resume_after_sigkill_matches(straight: Path, tmp_path: Path):
    assert sigkill_after_first_checkpoint(tmp_path, *SMALL, config=CONFIG) == "step_000002"
    resumed = run(tmp_path, *SMALL, "resume_from_checkpoint=latest", config=CONFIG)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_metrics(tmp_path, straight, steps=(3,), exp_name=CONFIG)


@pytest.mark.parametrize(
    ("mode", "k", "staleness"), [("batch", 1, [0.0, 1.0, 1.0]), ("stream", 2, [0.0, 1.0, 2.0])]
)
def test_played_ahead_then_resumed_trains_on_the_stored_episodes(
    tmp_path: Path, mode: str, k: int, staleness: list[float]
):
    """The steps in flight at a checkpoint (rows and episodes alike) are stored with it, and
    the resumed run trains on exactly those: its rollout metrics are theirs."""
    from roll_ds.agentic.episode import Episode
    from roll_ds.agentic.runner import episode_metrics

    ahead = [*SMALL, f"async_generation.max_staleness={k}", f"async_generation.mode={mode}"]
    assert sigkill_after_first_checkpoint(tmp_path, *ahead, config=CONFIG) == "step_000002"
    checkpoint = tmp_path / CONFIG / "checkpoints" / "step_000002"
    [stored] = json.loads((checkpoint / "rollouts_in_flight.json").read_text())
    assert stored["step"] == 2  # the last step; nothing is played past max_steps
    episodes = [Episode(**e) for e in stored["episodes"]]
    resumed = run(tmp_path, *ahead, "resume_from_checkpoint=latest", config=CONFIG)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = {r["step"]: r for r in metrics(tmp_path, CONFIG)}
    assert sorted(rows) == [0, 1, 2, 3]
    envs = [e for e in episodes if not e.is_row]
    for key, value in episode_metrics(envs, "rollout").items():
        assert rows[3][key] == value, key
    lengths = [len(e.token_ids) for e in episodes if e.is_row]
    assert rows[3]["rollout/response_length"] == sum(lengths) / len(lengths)
    assert [rows[s]["rollout/staleness"] for s in (1, 2, 3)] == staleness
