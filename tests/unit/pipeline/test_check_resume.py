"""check_resume: the driver reads a checkpoint before any actor starts. A complete one passes on
its own size and on another (its strategy converts it then); a missing role directory or a
shard its engine record lists but the directory lacks fails naming the field and the file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from roll_ds.checkpoint import CheckpointManager, write_engine_record
from roll_ds.config.schema import RLVRConfig, TrainingArgs, WorkerConfig
from roll_ds.pipeline.save_resume import ENGINE_TAG, check_resume

SHARDS = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


def _checkpoint(root: Path, *, saved_ranks: int = 2, record: bool = True, **extra: object) -> Path:
    """A committed checkpoint whose actor_train engine was saved on ``saved_ranks`` ranks."""
    manager = CheckpointManager(root)
    partial = manager.begin(3)
    engine = partial / "actor_train" / ENGINE_TAG
    engine.mkdir(parents=True)
    files = ["mp_rank_00_model_states.pt", *SHARDS[:saved_ranks]]
    for name in files:
        (engine / name).write_bytes(b"x")
    if record:
        sizes = {"world_size": saved_ranks, "dp_world_size": saved_ranks}
        write_engine_record(engine, {"zero_stage": 2, **sizes, "files": files, **extra})
    return manager.commit(partial, {"step": 3})


def _cfg(path: Path | str, world: int, micro: int = 8, accumulation: int = 1) -> RLVRConfig:
    args = TrainingArgs(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
    actor = WorkerConfig(device_mapping=list(range(world)), training_args=args)
    return RLVRConfig(resume_from_checkpoint=str(path), actor_train=actor)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_complete_checkpoint_passes_on_any_size(tmp_path, world, caplog):
    path = _checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="roll_ds.pipeline.save_resume"):
        assert check_resume(_cfg(path, world), CheckpointManager(tmp_path), ["actor_train"]) == path
    converting = "universal checkpoint" in caplog.text
    assert converting == (world != 2), caplog.text


def test_latest_resolves(tmp_path):
    path = _checkpoint(tmp_path)
    assert check_resume(_cfg("latest", 1), CheckpointManager(tmp_path), ["actor_train"]) == path


@pytest.mark.parametrize("world", [1, 2])
def test_missing_shard_names_the_file(tmp_path, world):
    path = _checkpoint(tmp_path)
    (path / "actor_train" / ENGINE_TAG / SHARDS[1]).unlink()
    with pytest.raises(FileNotFoundError) as err:
        check_resume(_cfg(path, world), CheckpointManager(tmp_path), ["actor_train"])
    message = str(err.value)
    assert "resume_from_checkpoint" in message and SHARDS[1] in message
    assert ("every saved rank's shard" in message) == (world == 1), message


def test_engine_that_cannot_resize_is_refused_on_another_size(tmp_path):
    path = _checkpoint(tmp_path, not_resizable="ZeRO-3 cannot; resume on 2 ranks")
    assert check_resume(_cfg(path, 2), CheckpointManager(tmp_path), ["actor_train"]) == path
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: .* 2 actor_train ranks .*"):
        check_resume(_cfg(path, 1), CheckpointManager(tmp_path), ["actor_train"])


def test_missing_role_directory(tmp_path):
    path = _checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"resume_from_checkpoint: .* no critic/engine/"):
        check_resume(_cfg(path, 2), CheckpointManager(tmp_path), ["actor_train", "critic"])


def test_checkpoint_without_record_is_left_to_its_strategy(tmp_path):
    path = _checkpoint(tmp_path, record=False)
    assert check_resume(_cfg(path, 1), CheckpointManager(tmp_path), ["actor_train"]) == path


def test_engine_record_round_trip(tmp_path):
    write_engine_record(tmp_path, {"files": ["a.pt"], "world_size": 2})
    assert json.loads((tmp_path / "engine.json").read_text())["world_size"] == 2


@pytest.mark.parametrize(
    ("world", "micro", "accumulation", "fix"),
    [
        (2, 8, 1, None),  # the saving run's own batch
        (1, 8, 2, None),  # 2 ranks -> 1 with twice the accumulation: the same 16 rows
        (1, 16, 1, None),
        (1, 8, 1, "set actor_train.training_args.gradient_accumulation_steps=2 to keep it"),
        (4, 8, 1, "whose product x 4 ranks is 16"),  # no whole accumulation keeps it
    ],
)
def test_a_resume_that_changes_the_optimizer_batch_warns_naming_the_fix(
    tmp_path, caplog, world, micro, accumulation, fix
):
    """Saved on 2 ranks of 8 rows: 16 rows an optimizer step."""
    path = _checkpoint(tmp_path, train_batch_size=16)
    cfg = _cfg(path, world, micro, accumulation)
    with caplog.at_level(logging.WARNING, logger="roll_ds.pipeline.save_resume"):
        check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if fix is None:
        assert warned == []
    else:
        [message] = warned
        assert "optimizer steps of 16 rows" in message and fix in message, message
