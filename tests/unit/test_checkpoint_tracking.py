import json
import os
import random

import numpy as np
import pytest
import torch

from roll_ds.checkpoint import (
    COMPLETE,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
)
from roll_ds.tracking import Tracker, plot_curves, read_metrics


def test_commit_is_atomic_and_latest_moves(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest() is None
    part = mgr.begin(10)
    (part / "actor_train").mkdir()
    first = mgr.commit(part, {"step": 10})
    assert first.name == "step_000010"
    assert mgr.latest() == first
    assert mgr.load_state(first) == {"step": 10}

    # A crash mid-save: the partial directory exists but was never committed.
    crashed = mgr.begin(20)
    (crashed / "half_written.bin").write_bytes(b"\0" * 10)
    assert mgr.latest() == first
    assert mgr.resolve("latest") == first

    # The next save clears the leftover and moves latest.
    second = mgr.commit(mgr.begin(20), {"step": 20})
    assert not crashed.exists()
    assert mgr.latest() == second


def test_resolve_rejects_incomplete(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        mgr.resolve("latest")
    broken = tmp_path / "step_000005"
    broken.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no {COMPLETE} marker"):
        mgr.resolve(str(broken))


def test_keep_last_prunes_old(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.commit(mgr.begin(step), {"step": step})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]


def test_rng_state_round_trip_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_tracker_jsonl_tensorboard_and_resume_truncation(tmp_path):
    tracker = Tracker(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        tracker.log({"reward": step / 10, "note": "text is skipped", "loss": float("nan")}, step)
    tracker.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["reward"] == 0.2 and "note" not in rows[1]
    assert rows[0]["loss"] != rows[0]["loss"]  # NaN is kept, not hidden
    assert any(name.startswith("events") for name in os.listdir(tmp_path / "tensorboard"))

    # Resuming from step 2 drops the rows the resumed run will write again.
    resumed = Tracker(tmp_path, tensorboard=False, resume_step=2)
    resumed.log({"reward": 0.33}, 3)
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.33)]


def test_plot_curves_writes_png(tmp_path):
    rows = [{"step": s, "reward": s * 0.1, "eval/accuracy": 0.3 + s * 0.01} for s in range(5)]
    out = plot_curves(rows, ["reward", "eval/accuracy", "absent"], tmp_path / "curves.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_curves(rows, ["absent"], tmp_path / "none.png") is None
