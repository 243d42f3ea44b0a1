import itertools
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from roll_ds.checkpoint import (
    BEST,
    BEST_RECORD,
    COMPLETE,
    LATEST,
    BestCheckpoint,
    CheckpointManager,
    capture_rng_state,
    is_better,
    load_rng_state,
    restore_rng_state,
    save_rng_state,
)
from roll_ds.tracking import (
    Tracker,
    per_domain_keys,
    plot_curves,
    read_metrics,
    truncate_jsonl_after,
)


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


def test_keep_last_zero_keeps_all_and_negative_fails(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    for step in (1, 2, 3, 4):
        mgr.commit(mgr.begin(step), {"step": step})
    assert len(mgr.complete_steps()) == 4
    with pytest.raises(ValueError, match="keep_last=-1: must be >= 0"):
        CheckpointManager(tmp_path, keep_last=-1)


def test_pruning_never_deletes_the_checkpoint_just_saved(tmp_path):
    # Resumed from step 10 while step 30 of the abandoned run is still on disk: saving step 20
    # again must keep the new step 20, which latest points at.
    mgr = CheckpointManager(tmp_path, keep_last=1)
    for step in (10, 20, 30):
        mgr.commit(mgr.begin(step), {"step": step})
    again = mgr.commit(mgr.begin(20), {"step": 20, "run": "resumed"})
    assert mgr.latest() == again
    assert mgr.load_state(again) == {"step": 20, "run": "resumed"}


# --- crash safety ------------------------------------------------------------------------------


class Crash(Exception):
    """Stands for the process dying at that point."""


def _save(mgr: CheckpointManager, step: int, run: str) -> Path:
    part = mgr.begin(step)
    (part / "actor_train").mkdir()
    (part / "actor_train" / "weights.bin").write_text(f"{step}-{run}")
    return mgr.commit(part, {"step": step, "run": run})


def _crash_at(monkeypatch, k: int) -> list[str]:
    """Make the k-th call of os.rename / os.replace / shutil.rmtree raise ``Crash`` (the state
    on disk is then what a process killed just before that call leaves); returns the calls."""
    counter, calls = itertools.count(), []
    for module, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree")):
        real = getattr(module, name)

        def fake(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            if next(counter) == k:
                raise Crash(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, fake)
    return calls


def _check_consistent(path: Path) -> tuple[int, str]:
    """The checkpoint is complete and its parts belong together."""
    assert (path / COMPLETE).is_file(), path
    state = CheckpointManager.load_state(path)
    assert (path / "actor_train" / "weights.bin").read_text() == f"{state['step']}-{state['run']}"
    return state["step"], state["run"]


@pytest.mark.parametrize(
    ("scenario", "keep_last", "allowed"),
    [
        # a new step: the old latest or the new one
        ("new_step", 2, {(20, "a"), (30, "b")}),
        # step 20 saved again after resuming from step 10 (run b): the old or the new copy of
        # 20, or, while neither is in place (pointer dangling), the newest complete one (10)
        ("resave", None, {(20, "a"), (20, "b"), (10, "a")}),
    ],
)
def test_a_crash_at_any_point_of_a_save_leaves_a_complete_latest(
    tmp_path, monkeypatch, scenario, keep_last, allowed
):
    crashed_at = []
    for k in itertools.count():
        root = tmp_path / f"crash{k}"
        mgr = CheckpointManager(root, keep_last=keep_last)
        _save(mgr, 10, "a")
        _save(mgr, 20, "a")
        with monkeypatch.context() as patch:
            calls = _crash_at(patch, k)
            try:
                if scenario == "new_step":
                    _save(mgr, 30, "b")
                else:
                    _save(mgr, 20, "b")
            except Crash:
                crashed_at.append(calls[-1])
            else:
                break
        # A fresh process looks for the checkpoint to resume from.
        restarted = CheckpointManager(root, keep_last=keep_last)
        latest = restarted.latest()
        assert latest is not None and restarted.resolve(LATEST) == latest
        assert _check_consistent(latest) in allowed, (k, crashed_at[-1])
        # The next save succeeds and clears what the crash left behind.
        assert _check_consistent(_save(restarted, 40, "c")) == (40, "c")
        assert restarted.latest() == root / "step_000040"
        leftovers = [p.name for p in root.iterdir() if p.name.endswith((".partial", ".old"))]
        assert leftovers == [], (k, leftovers)
    # Every rename, replace and delete of the save was a crash point.
    assert len(crashed_at) >= 5 and {"rename", "replace", "rmtree"} <= set(crashed_at)


def test_latest_falls_back_when_the_pointer_is_missing_or_dangling(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest() is None
    _save(mgr, 10, "a")
    newest = _save(mgr, 20, "a")
    (tmp_path / "step_000030.partial").mkdir()  # never committed: not a candidate
    (tmp_path / "step_000030.partial" / COMPLETE).write_text("")
    (tmp_path / LATEST).write_text("step_000099")
    assert mgr.latest() == newest
    (tmp_path / LATEST).unlink()
    assert mgr.latest() == newest
    (newest / COMPLETE).unlink()  # pointer to a directory that is not complete
    (tmp_path / LATEST).write_text(newest.name)
    assert mgr.latest() == tmp_path / "step_000010"


def test_commit_fsyncs_the_workers_files_before_marking_complete(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    part = mgr.begin(5)
    (part / "actor_train" / "engine").mkdir(parents=True)
    shard = part / "actor_train" / "engine" / "shard.pt"
    shard.write_bytes(b"x")
    synced, order = set(), []
    real_fsync = os.fsync

    def fsync(fd):
        synced.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    real_replace = os.replace

    def replace(src, dst):
        order.append(Path(dst).name)
        if Path(dst).name == COMPLETE:
            assert str(shard) in synced and str(shard.parent) in synced
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    mgr.commit(part, {"step": 5})
    assert COMPLETE in order


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


def test_rng_state_file_is_json_not_pickle(tmp_path, monkeypatch):
    def no_pickle(*args, **kwargs):
        raise AssertionError("RNG states must not be pickled")

    for module, name in ((torch, "save"), (torch, "load"), (pickle, "dump"), (pickle, "load")):
        monkeypatch.setattr(module, name, no_pickle)
    path = tmp_path / "rng_state_rank0.json"
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_rng_state(path)
    assert set(json.loads(path.read_text())) == {"python", "numpy", "torch"}
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert load_rng_state(path) is True
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert load_rng_state(tmp_path / "absent.json") is False


class _RunsCode:
    """Unpickling this creates ``marker``: what a malicious checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickled_rng_file_is_refused_not_unpickled(tmp_path):
    marker = tmp_path / "code_ran"
    (tmp_path / "rng_state_rank0.pt").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ValueError, match=r"rng_state_rank0.pt: RNG states pickled .* not loaded"):
        load_rng_state(tmp_path / "rng_state_rank0.json")
    assert not marker.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_a_cuda_rng_state_restored_without_cuda_only_warns(caplog):
    state = capture_rng_state()
    assert "cuda" not in state
    restore_rng_state({**state, "cuda": [0] * 16})
    assert "no CUDA device is visible" in caplog.text


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

    # A fresh run in the same directory replaces the earlier run's rows.
    fresh = Tracker(tmp_path, tensorboard=False)
    fresh.log({"reward": 0.5}, 1)
    fresh.close()
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 0.5)
    ]


def test_plot_curves_writes_png(tmp_path):
    rows = [{"step": s, "reward": s * 0.1, "eval/accuracy": 0.3 + s * 0.01} for s in range(5)]
    out = plot_curves(rows, ["reward", "eval/accuracy", "absent"], tmp_path / "curves.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_curves(rows, ["absent"], tmp_path / "none.png") is None


def test_truncate_jsonl_drops_later_steps_and_a_torn_last_line(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    kept = [json.dumps({"step": s, "id": i, "response": "a b"}) for s in (1, 2) for i in (0, 1)]
    later = [json.dumps({"step": 3, "id": i}) for i in (0, 1)]
    path.write_text("\n".join(kept + later) + '\n{"step": 3, "id": 2, "resp')  # killed mid-write
    assert truncate_jsonl_after(path, 2) == 3
    assert path.read_text() == "\n".join(kept) + "\n"  # kept lines byte for byte
    assert [p.name for p in tmp_path.iterdir()] == ["rollouts.jsonl"]
    assert truncate_jsonl_after(tmp_path / "absent.jsonl", 2) == 0


def test_resume_drops_rollout_rows_past_the_checkpoint(tmp_path):
    from roll_ds.pipeline.model_roles import role_handles
    from roll_ds.pipeline.rlvr import RLVRPipeline

    class Call:
        def get(self):
            return None

    class FakeCluster:
        def __init__(self):
            self.calls = []

        def submit(self, method, *args):
            self.calls.append((method, *args))
            return Call()

    class FakeSampler:
        def load_state_dict(self, state):
            self.state = state

    out = tmp_path / "run"
    mgr = CheckpointManager(out / "checkpoints")
    part = mgr.begin(2)
    (part / "actor_train").mkdir()
    mgr.commit(part, {"step": 2, "sampler": {"pos": 8}, "rng": capture_rng_state()})
    (out / "rollouts.jsonl").write_text(
        "".join(json.dumps({"step": s, "id": s}) + "\n" for s in (1, 2, 3))
    )
    pipeline = RLVRPipeline.__new__(RLVRPipeline)  # the resume path only, no actors
    pipeline.cfg = SimpleNamespace(resume_from_checkpoint="latest")
    pipeline.out_dir, pipeline.checkpoints, pipeline.use_critic = out, mgr, False
    pipeline.queue = None  # the synchronous loop
    pipeline.clusters = {"actor_train": FakeCluster()}
    pipeline.roles = role_handles(pipeline.clusters)
    pipeline.tasks = SimpleNamespace(sampler=FakeSampler())
    assert pipeline._maybe_resume() == 2
    assert [r["step"] for r in read_metrics(out / "rollouts.jsonl")] == [1, 2]
    assert pipeline.clusters["actor_train"].calls == [
        ("load_checkpoint", str(out / "checkpoints" / "step_000002" / "actor_train"), "engine")
    ]
    assert pipeline.tasks.sampler.state == {"pos": 8}


# --- save_best ---------------------------------------------------------------------------------


def _best(root: Path) -> tuple[int, str, dict]:
    """The checkpoint ``root/best`` holds: complete, its parts together, and its record."""
    best = root / BEST
    step, run = _check_consistent(best)
    record = json.loads((best / BEST_RECORD).read_text())
    assert record["step"] == step
    return step, run, record


def test_is_better():
    assert is_better(0.1, None, "max") and is_better(0.1, None, "min")
    assert is_better(0.5, 0.4, "max") and not is_better(0.4, 0.5, "max")
    assert is_better(0.4, 0.5, "min") and not is_better(0.5, 0.4, "min")
    assert not is_better(0.5, 0.5, "max")  # a tie keeps the earlier checkpoint
    assert not is_better(float("nan"), None, "max")
    with pytest.raises(ValueError, match="save_best_mode: must be max or min"):
        is_better(0.1, None, "median")


def test_best_checkpoint_survives_rotation_and_moves_only_on_a_better_value(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    best = BestCheckpoint(tmp_path, "eval/accuracy", "max", resume=False)
    offers = [(10, 0.3, True), (20, 0.2, False), (30, 0.5, True), (40, 0.5, False)]
    for step, acc, wins in offers:
        path = _save(mgr, step, "a")
        assert best.offer(path, step, {"eval/accuracy": acc, "eval/score": 1.0}) is wins, step
    assert [p.name for p in mgr.complete_steps()] == ["step_000040"]  # step 30 was pruned
    step, run, record = _best(tmp_path)
    assert (step, run) == (30, "a")
    assert record == {
        "metric": "eval/accuracy",
        "mode": "max",
        "value": 0.5,
        "step": 30,
        "checkpoint": "step_000030",
    }
    assert mgr.resolve(str(tmp_path / BEST)) == tmp_path / BEST  # resumes like a step directory
    assert len(list(tmp_path.glob(f"{BEST}_*"))) == 1  # the earlier best copy is gone
    assert (tmp_path / BEST).is_symlink() and not os.path.isabs(os.readlink(tmp_path / BEST))


def test_best_checkpoint_min_mode_resume_and_a_missing_metric(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    best = BestCheckpoint(tmp_path, "eval/response_length/mean", "min", resume=False)
    assert best.offer(_save(mgr, 10, "a"), 10, {"eval/response_length/mean": 6.0})
    assert not best.offer(_save(mgr, 20, "a"), 20, {"eval/response_length/mean": 7.0})
    assert not best.offer(_save(mgr, 30, "a"), 30, {"rollout/score": 1.0})
    assert "save_best: no eval/response_length/mean in the metrics of step 30" in caplog.text
    # A resumed run goes on from the recorded value; a fresh one starts over.
    resumed = BestCheckpoint(tmp_path, "eval/response_length/mean", "min", resume=True)
    assert resumed.value == 6.0
    assert not resumed.offer(_save(mgr, 40, "b"), 40, {"eval/response_length/mean": 6.5})
    fresh = BestCheckpoint(tmp_path, "eval/response_length/mean", "min", resume=False)
    assert fresh.offer(_save(mgr, 40, "c"), 40, {"eval/response_length/mean": 6.5})
    assert _best(tmp_path)[:2] == (40, "c")
    # Another metric than the record's: the record does not carry over.
    other = BestCheckpoint(tmp_path, "eval/accuracy", "max", resume=True)
    assert other.value is None


def test_a_crash_at_any_point_of_keeping_the_best_leaves_a_complete_best(tmp_path, monkeypatch):
    crashed_at = []
    for k in itertools.count():
        root = tmp_path / f"crash{k}"
        mgr = CheckpointManager(root, keep_last=1)
        best = BestCheckpoint(root, "eval/accuracy", "max", resume=False)
        best.offer(_save(mgr, 10, "a"), 10, {"eval/accuracy": 0.1})
        path = _save(mgr, 20, "a")
        with monkeypatch.context() as patch:
            calls = _crash_at(patch, k)
            try:
                best.offer(path, 20, {"eval/accuracy": 0.2})
            except Crash:
                crashed_at.append(calls[-1])
            else:
                break
        assert _best(root)[:2] in {(10, "a"), (20, "a")}, (k, crashed_at[-1])
        # The next save and a new best clear what the crash left behind.
        again = BestCheckpoint(root, "eval/accuracy", "max", resume=True)
        assert again.offer(_save(mgr, 30, "c"), 30, {"eval/accuracy": 0.9})
        assert _best(root)[:2] == (30, "c")
        names = sorted(p.name for p in root.iterdir())
        assert names[0] == BEST and names[2:] == [LATEST, "step_000030"], (k, names)
        assert names[1].startswith(f"{BEST}_step_000030_"), (k, names)
    assert len(crashed_at) >= 3 and {"rename", "replace"} <= set(crashed_at)


def test_plot_curves_breaks_eval_down_by_domain(tmp_path):
    rows = [
        {"step": 0, "eval/accuracy": 0.2, "eval/math/accuracy": 0.1, "eval/reverse/accuracy": 0.3},
        {"step": 10, "eval/accuracy": 0.4, "eval/math/accuracy": 0.3, "eval/reverse/accuracy": 0.5},
        {"step": 10, "eval/math/score": 0.3, "eval/sampled/response_length/mean": 3.0},
    ]
    assert per_domain_keys(rows, "eval/accuracy") == {
        "math": "eval/math/accuracy",
        "reverse": "eval/reverse/accuracy",
    }
    assert per_domain_keys(rows, "eval/response_length/mean") == {}
    assert per_domain_keys(rows, "actor/pg_loss") == {}
    out = plot_curves(rows, ["eval/accuracy"], tmp_path / "curves.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_from_latest_without_a_checkpoint_starts_at_step_zero(tmp_path, caplog):
    """A job a scheduler requeues (Slurm --requeue, a Kubernetes Job) runs one command line,
    resume_from_checkpoint=latest, at its first start too: nothing to load, step 0, said so."""
    from roll_ds.pipeline.rlvr import RLVRPipeline

    out = tmp_path / "run"
    pipeline = RLVRPipeline.__new__(RLVRPipeline)  # the resume path only, no actors
    pipeline.cfg = SimpleNamespace(resume_from_checkpoint="latest")
    pipeline.out_dir, pipeline.checkpoints = out, CheckpointManager(out / "checkpoints")
    pipeline.clusters = {}  # a load would fail: there must be none
    with caplog.at_level("WARNING"):
        assert pipeline._maybe_resume() == 0
    assert "no checkpoint under" in caplog.text and "starting at step 0" in caplog.text


def test_a_pipeline_resuming_latest_before_any_checkpoint_is_built(tmp_path):
    """The checks made before any actor starts (check_resume) let ``latest`` with no
    checkpoint through to the fresh start above, and still refuse a named one that is missing."""
    from roll_ds.config import load_config
    from roll_ds.pipeline.rlvr import RLVRPipeline

    cfg = load_config(
        "rlvr_lora_zero3", [f"output_dir={tmp_path}", "resume_from_checkpoint=latest"]
    )
    assert RLVRPipeline(cfg)._fresh_latest()
    named = load_config(
        "rlvr_lora_zero3", [f"output_dir={tmp_path}", "resume_from_checkpoint=step_000002"]
    )
    with pytest.raises(FileNotFoundError):
        RLVRPipeline(named)
