"""One W&B run across resumes: the tracker's run id, kept in every checkpoint and passed back by a
resume (by hand or after an automatic restart); the real wandb checked offline."""

import contextlib
from types import SimpleNamespace

import pytest

from roll_ds.checkpoint import CheckpointManager
from roll_ds.tracking import Tracker

# -- one W&B run across resumes ----------------------------------------------------------------


class _FakeWandb:
    """``wandb`` at its boundary (the pipeline-level tests below; the real one, offline, in
    ``test_wandb_offline_runs_share_one_id``): records every ``init``."""

    def __init__(self) -> None:
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)

    def teardown(self) -> None:
        self.teardowns = getattr(self, "teardowns", 0) + 1


def test_a_resumed_run_goes_on_as_the_same_wandb_run(tmp_path, monkeypatch):
    """The first start makes a run id, every checkpoint keeps it, and a resume from one (by
    hand: its path; after an automatic restart: ``latest``) passes it back to ``wandb.init``
    with ``resume="allow"``: one W&B run, not one per attempt."""
    import sys

    from roll_ds.pipeline import rlvr
    from roll_ds.pipeline.save_resume import checkpoint_run_id

    class _Pipe(rlvr.RLVRPipeline):
        _trained_roles = ()  # no engines to load

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    first = Tracker(tmp_path / "out", tensorboard=False, wandb_project="p")
    first.close()
    run_id = first.run_id
    assert fake.inits[0]["id"] == run_id and fake.inits[0]["resume"] == "allow"
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.commit(mgr.begin(2), {"step": 2, "run_id": run_id})
    # the pipeline's resume, its engine loads (resume_run) replaced at the boundary
    monkeypatch.setattr(
        rlvr, "resume_run", lambda which, **kw: mgr.load_state(mgr.resolve(which))["step"]
    )
    for which in (str(mgr.resolve("latest")), "latest"):
        pipe = object.__new__(_Pipe)
        pipe.cfg = SimpleNamespace(resume_from_checkpoint=which)
        pipe.checkpoints, pipe.roles = mgr, {}
        pipe.tasks, pipe.queue, pipe.out_dir = SimpleNamespace(sampler=None), None, tmp_path
        assert pipe._maybe_resume() == 2 and pipe.run_id == run_id
        again = Tracker(
            tmp_path / "out",
            tensorboard=False,
            wandb_project="p",
            resume_step=2,
            run_id=pipe.run_id,
        )
        again.close()
    assert [i["id"] for i in fake.inits] == [run_id] * 3
    assert {i["resume"] for i in fake.inits} == {"allow"}
    assert checkpoint_run_id(mgr, "latest") == run_id
    fresh = Tracker(tmp_path / "other", tensorboard=False, wandb_project="p")
    assert fresh.run_id != run_id  # a new run is a new W&B run


def test_a_restart_from_step_0_goes_on_as_the_same_wandb_run(tmp_path, monkeypatch):
    """An automatic restart of a run that saved nothing yet starts again at step 0, with no
    checkpoint to keep the id: the restart policy (shared by the attempts) carries it."""
    import sys

    from roll_ds.pipeline import rlvr
    from roll_ds.pipeline.restarts import TrainerRestarts

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = SimpleNamespace(
        tracking=SimpleNamespace(tensorboard=False, jsonl=True, wandb_project="p"),
        exp_name="run",
        fault_tolerance=SimpleNamespace(max_trainer_restarts=1),
    )
    monkeypatch.setattr("roll_ds.pipeline.reporting.asdict", lambda c: {})
    restarts = TrainerRestarts(cfg)
    ids = []
    for _attempt in range(2):  # each attempt is a new pipeline, as launch.run_pipeline makes
        pipe = object.__new__(rlvr.RLVRPipeline)
        pipe.cfg, pipe.out_dir, pipe.faults, pipe.run_id = cfg, tmp_path, restarts, None
        tracker = pipe._open_tracker(0)
        tracker.close()
        ids.append(tracker.run_id)
    assert ids[0] == ids[1] and [i["id"] for i in fake.inits] == ids


def test_wandb_offline_runs_share_one_id(tmp_path, monkeypatch):
    """The real wandb, offline: a run and its resume (the id passed back) write their runs under
    one id, which ``wandb sync`` uploads as one run; a fresh run gets an id of its own."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    first = Tracker(out, tensorboard=False, wandb_project="p")
    first.log({"reward": 0.5}, step=1)
    first.close()
    resumed = Tracker(out, tensorboard=False, wandb_project="p", resume_step=1, run_id=first.run_id)
    resumed.log({"reward": 0.75}, step=2)
    resumed.close()
    fresh = Tracker(tmp_path / "other", tensorboard=False, wandb_project="p")
    fresh.close()
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(f"-{first.run_id}") for r in runs), runs
    other = [p.name for p in (tmp_path / "other" / "wandb").glob("offline-run-*")]
    assert len(other) == 1 and not other[0].endswith(f"-{first.run_id}")
    # closed trackers leave no W&B service behind (the session's leak check found one)
    import psutil

    left = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            left += [child.cmdline()] if "wandb" in child.name() else []
    assert left == [], left
