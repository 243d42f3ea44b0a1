"""The restart policy (roll_ds/pipeline/restarts.py) and the one loop that applies it
(launch.run_pipeline), on hand-made errors and a fake pipeline: which failures restart the run,
the count, giving up with the failure chained, the config of the next attempt, faults/* metrics.
The real restart (a SIGKILLed trainer rank) is tests/integration/test_rlvr_pipeline.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from roll_ds.checkpoint import CheckpointManager
from roll_ds.config.fault_tolerance import FaultToleranceConfig
from roll_ds.config.schema import RLVRConfig
from roll_ds.config.validate import ConfigError
from roll_ds.distributed.errors import (
    ClusterError,
    PlacementError,
    WorkerError,
    WorkerTimeoutError,
)
from roll_ds.pipeline import launch
from roll_ds.pipeline.restarts import RestartError, TrainerRestarts, failed_trainer


def died(role: str, rank: int = 1) -> WorkerError:
    return WorkerError(role, rank, "train_step", RuntimeError("actor died unexpectedly"))


def config(tmp_path: Path, restarts: int = 2, **kwargs) -> RLVRConfig:
    return RLVRConfig(
        output_dir=str(tmp_path),
        fault_tolerance=FaultToleranceConfig(max_trainer_restarts=restarts),
        **kwargs,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- which failures restart the run ------------------------------------------------------------


def test_a_trainer_roles_failure_is_restartable():
    assert failed_trainer(died("actor_train")) == "actor_train rank 1"
    assert failed_trainer(died("critic", 0)) == "critic rank 0"
    hung = WorkerTimeoutError("actor_train", "train_step", [0, 1], 30.0)
    assert failed_trainer(hung) == "actor_train ranks [0, 1]"


def test_a_trainer_failure_raised_as_the_cause_of_another_error_is_restartable():
    try:
        try:
            raise died("actor_train", 0)
        except WorkerError as exc:
            raise RuntimeError("the step failed") from exc
    except RuntimeError as wrapped:
        assert failed_trainer(wrapped) == "actor_train rank 0"


def test_a_weight_sync_broken_by_a_trainer_is_restartable_and_by_an_engine_alone_is_not():
    sync = ClusterError("sync failed")
    sync.failures = (died("actor_infer", 0), died("actor_train", 1))
    assert failed_trainer(sync) == "actor_train rank 1"
    sync.failures = (died("actor_infer", 0),)
    assert failed_trainer(sync) is None


@pytest.mark.parametrize(
    "exc",
    [
        died("actor_infer", 0),  # stateless roles have their own policy
        died("rewards.math", 0),
        ConfigError("rollout_batch_size: must be >= 1, got 0"),
        KeyError("advantages"),  # a bug in the driver
        PlacementError("placement needs 2 CPU"),
    ],
    ids=["rollout", "reward", "config", "driver-bug", "placement"],
)
def test_other_failures_are_not_restartable(exc, tmp_path):
    assert failed_trainer(exc) is None
    restarts = TrainerRestarts(config(tmp_path))
    with pytest.raises(type(exc)) as raised:
        restarts.on_failure(exc, started=True)
    assert raised.value is exc and restarts.count == 0


# --- counting and giving up --------------------------------------------------------------------


def test_restarts_up_to_the_limit_then_gives_up_with_the_failure_chained(tmp_path):
    restarts = TrainerRestarts(config(tmp_path, restarts=2))
    restarts.on_failure(died("actor_train"), started=True)
    restarts.on_failure(died("actor_train"), started=True)
    assert restarts.count == 2
    last = died("actor_train", 0)
    with pytest.raises(RestartError) as raised:
        restarts.on_failure(last, started=True)
    assert raised.value.__cause__ is last
    message = str(raised.value)
    assert "actor_train rank 0 failed again after 2 automatic restart(s)" in message
    assert "fault_tolerance.max_trainer_restarts=2" in message
    assert "resume_from_checkpoint=latest" in message


def test_no_restarts_configured_raises_the_failure_itself(tmp_path):
    restarts = TrainerRestarts(config(tmp_path, restarts=0))
    exc = died("actor_train")
    with pytest.raises(WorkerError) as raised:
        restarts.on_failure(exc, started=True)
    assert raised.value is exc


def test_a_failure_while_the_roles_first_start_is_not_restarted(tmp_path):
    restarts = TrainerRestarts(config(tmp_path))
    exc = died("actor_train")  # e.g. its initialize() raised: a config or environment problem
    with pytest.raises(WorkerError) as raised:
        restarts.on_failure(exc, started=False)
    assert raised.value is exc and restarts.count == 0


def test_a_restart_that_cannot_place_the_roles_again_says_so(tmp_path):
    restarts = TrainerRestarts(config(tmp_path))
    restarts.on_failure(died("actor_train", 1), started=True)
    gone = PlacementError("device_mapping needs 2 node(s) ..., the Ray cluster has 1")
    with pytest.raises(RestartError) as raised:
        restarts.on_failure(gone, started=False)
    assert raised.value.__cause__ is gone
    message = str(raised.value)
    assert "automatic restart 1 of 2 (after actor_train rank 1 failed)" in message
    assert "could not start the roles again: PlacementError" in message


# --- the next attempt's config -----------------------------------------------------------------


def test_the_first_attempt_runs_the_config_as_given(tmp_path):
    cfg = config(tmp_path)
    assert TrainerRestarts(cfg).next_config(tmp_path / "checkpoints") is cfg


def test_a_restart_resumes_from_the_latest_checkpoint(tmp_path):
    cfg = config(tmp_path)
    restarts = TrainerRestarts(cfg)
    restarts.on_failure(died("actor_train"), started=True)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.commit(manager.begin(2), {"step": 2})
    assert restarts.next_config(manager.root) == replace(cfg, resume_from_checkpoint="latest")


@pytest.mark.parametrize("resumed_from", [None, "/runs/earlier/checkpoints/step_000010"])
def test_a_restart_before_any_checkpoint_starts_where_the_run_started(tmp_path, resumed_from):
    """No checkpoint of this run yet: step 0 (or the checkpoint the run itself resumed
    from) again; the same seed replays what was lost, at most save_steps steps."""
    cfg = config(tmp_path, resume_from_checkpoint=resumed_from)
    restarts = TrainerRestarts(cfg)
    restarts.on_failure(died("actor_train"), started=True)
    assert restarts.next_config(tmp_path / "checkpoints") is cfg


# --- faults/* metrics --------------------------------------------------------------------------


def test_lost_seconds_run_from_the_last_checkpoint_to_the_restarted_run_being_back(tmp_path):
    clock = Clock()
    restarts = TrainerRestarts(config(tmp_path), clock=clock)
    clock.now = 5.0
    restarts.resumed()  # the first attempt begins training
    assert restarts.metrics() == {}  # an undisturbed run logs no faults/*
    clock.now = 20.0
    restarts.progress()  # checkpoint saved
    clock.now = 30.0
    restarts.on_failure(died("actor_train"), started=True)
    clock.now = 50.0
    restarts.resumed()  # the restarted run has loaded the checkpoint of t=20
    assert restarts.metrics() == {"faults/restarts": 1.0, "faults/lost_seconds": 30.0}
    clock.now = 60.0
    restarts.on_failure(died("actor_train"), started=True)  # before any new checkpoint
    clock.now = 75.0
    restarts.resumed()
    assert restarts.metrics() == {"faults/restarts": 2.0, "faults/lost_seconds": 55.0}


# --- the loop in launch.run_pipeline -----------------------------------------------------------


class FakePipeline:
    """The pipeline's surface run_pipeline uses; ``fail`` is raised by run()."""

    def __init__(self, cfg, fail: BaseException | None, log: list) -> None:
        self.cfg, self.fail, self.log = cfg, fail, log
        self.out_dir = Path(cfg.output_dir) / cfg.exp_name
        self.ray = SimpleNamespace(started_local=False)

    def start(self, connection=None) -> None:
        # the first attempt gets the Ray connection started beside the build; a restart finds
        # Ray up
        self.log.append(("start", self.cfg.resume_from_checkpoint, connection is not None))

    def run(self):
        manager = CheckpointManager(self.out_dir / "checkpoints")
        if manager.latest() is None:  # each attempt saves step 2 before it fails
            manager.commit(manager.begin(2), {"step": 2})
        if self.fail is not None:
            raise self.fail
        return [{"step": 1}]

    def shutdown(self) -> None:
        self.log.append(("shutdown",))


def no_ray(monkeypatch) -> None:
    """The Ray connection run_pipeline starts in the background: one that started nothing."""
    from concurrent.futures import Future

    from roll_ds.distributed import ray_init

    def connecting(cfg):
        done: Future = Future()
        done.set_result(SimpleNamespace(started_local=False))
        return done

    monkeypatch.setattr(ray_init, "connect_in_background", connecting)


def run_with_failures(monkeypatch, cfg, failures: list) -> tuple[list, TrainerRestarts | None]:
    log: list = []
    seen: dict = {}
    no_ray(monkeypatch)

    def build(attempt_cfg, restarts):
        seen["restarts"] = restarts
        return FakePipeline(attempt_cfg, failures.pop(0), log)

    monkeypatch.setattr(launch, "_build", build)
    monkeypatch.setattr(launch.logging, "basicConfig", lambda **_: None)
    launch.run_pipeline(cfg)
    return log, seen.get("restarts")


def test_the_loop_tears_down_each_attempt_and_resumes_the_next(monkeypatch, tmp_path):
    cfg = config(tmp_path)
    log, restarts = run_with_failures(monkeypatch, cfg, [died("actor_train"), None])
    assert log == [("start", None, True), ("shutdown",), ("start", "latest", False), ("shutdown",)]
    assert restarts.count == 1


def test_the_loop_gives_up_after_the_limit_and_still_tears_down(monkeypatch, tmp_path):
    cfg = config(tmp_path, restarts=1)
    with pytest.raises(RestartError) as raised:
        run_with_failures(monkeypatch, cfg, [died("actor_train"), died("actor_train", 0)])
    assert isinstance(raised.value.__cause__, WorkerError)


def test_the_loop_does_not_restart_a_driver_bug(monkeypatch, tmp_path):
    log: list = []
    no_ray(monkeypatch)
    monkeypatch.setattr(launch, "_build", lambda c, r: FakePipeline(c, KeyError("x"), log))
    monkeypatch.setattr(launch.logging, "basicConfig", lambda **_: None)
    with pytest.raises(KeyError):
        launch.run_pipeline(config(tmp_path))
    assert log == [("start", None, True), ("shutdown",)]


# --- a checkpoint that fails to load is never restarted: a restart loads the same files --------


class _Load:
    """A trainer's pending load that fails as ``error`` (the cluster's boundary)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def load_checkpoint(self, path: str, tag: str) -> _Load:
        return self

    def get(self) -> None:
        raise self.error


def _resume_with(tmp_path: Path, error: BaseException) -> None:
    from roll_ds.pipeline.save_resume import resume_run

    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.commit(manager.begin(2), {"step": 2})
    resume_run(
        "latest",
        checkpoints=manager,
        trainers={"actor_train": _Load(error)},
        roles=["actor_train"],
        sampler=None,
        queue=None,
        out_dir=tmp_path,
    )


def test_a_load_that_raises_is_a_checkpoint_error_and_stops_the_run(tmp_path, caplog):
    from roll_ds.checkpoint import CheckpointError

    shape = RuntimeError("size mismatch for lora_A.weight: [4, 64] vs [8, 64]")
    with pytest.raises(CheckpointError, match=r"loading .*step_000002/actor_train into") as info:
        _resume_with(tmp_path, WorkerError("actor_train", 0, "load_checkpoint", shape))
    assert "size mismatch for lora_A.weight" in str(info.value)
    restarts = TrainerRestarts(config(tmp_path, restarts=2))
    with pytest.raises(CheckpointError):  # the error itself: no restart, no RestartError
        restarts.on_failure(info.value, started=True)
    assert restarts.count == 0
    assert "not restarted" in caplog.text


def test_a_rank_that_died_while_loading_is_still_restarted(tmp_path):
    from ray.exceptions import RayActorError

    dead = WorkerError("actor_train", 1, "load_checkpoint", RayActorError())
    with pytest.raises(WorkerError) as info:
        _resume_with(tmp_path, dead)
    restarts = TrainerRestarts(config(tmp_path, restarts=2))
    restarts.on_failure(info.value, started=True)  # returns: restarted
    assert restarts.count == 1


def test_the_loop_stops_at_a_checkpoint_that_fails_to_load(monkeypatch, tmp_path):
    """run_pipeline with restarts left: the attempt whose load raised is torn down, and no
    other attempt is built (one would load the same files)."""
    from roll_ds.checkpoint import CheckpointError

    try:
        raise CheckpointError("loading step_000002/actor_train failed") from died("actor_train")
    except CheckpointError as exc:
        damaged = exc
    log: list = []
    attempts: list = []

    def build(attempt_cfg, restarts):
        attempts.append(attempt_cfg)
        return FakePipeline(attempt_cfg, damaged, log)

    no_ray(monkeypatch)
    monkeypatch.setattr(launch, "_build", build)
    monkeypatch.setattr(launch.logging, "basicConfig", lambda **_: None)
    with pytest.raises(CheckpointError):
        launch.run_pipeline(config(tmp_path, restarts=2))
    assert len(attempts) == 1 and log == [("start", None, True), ("shutdown",)]


def test_bad_input_found_while_ray_starts_still_stops_that_ray(monkeypatch, tmp_path):
    """Ray starts in the background while the pipeline is built; bad input ends the run there
    (``_build`` exits 2), and the Ray started meanwhile is waited for and stopped."""
    from concurrent.futures import Future

    from roll_ds.distributed import ray_init

    started = SimpleNamespace(started_local=True)
    done: Future = Future()
    done.set_result(started)
    monkeypatch.setattr(ray_init, "connect_in_background", lambda cfg: done)
    stopped: list = []
    monkeypatch.setattr(launch, "stop_local_ray", stopped.append)

    def bad_input(attempt_cfg, restarts):
        raise SystemExit(2)

    monkeypatch.setattr(launch, "_build", bad_input)
    monkeypatch.setattr(launch.logging, "basicConfig", lambda **_: None)
    with pytest.raises(SystemExit):
        launch.run_pipeline(config(tmp_path))
    assert stopped == [started]
