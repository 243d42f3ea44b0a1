"""check_resume: the driver reads a checkpoint before any actor starts. A complete one passes on
its own size and on another (its strategy's ``resized_resume`` hook, recorded here, prepares it
then: the real conversion on a real checkpoint is test_universal_checkpoint.py's); a missing
role directory or a shard its engine record lists but the directory lacks fails naming the field
and the file. On
another size the role keeps its global batch: gradient_accumulation_steps rescaled where it
divides, a clear error naming the field where it does not."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from roll_ds.checkpoint import CheckpointError, CheckpointManager, write_engine_record
from roll_ds.config.schema import RLVRConfig, WorkerConfig
from roll_ds.pipeline import save_resume
from roll_ds.pipeline.save_resume import ENGINE_TAG, check_resume

SHARDS = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


def _checkpoint(
    root: Path,
    *,
    saved_ranks: int = 2,
    record: bool = True,
    micro: int = 2,
    accum: int = 1,
    **extra: object,
) -> Path:
    """A committed checkpoint whose actor_train engine was saved on ``saved_ranks`` ranks."""
    manager = CheckpointManager(root)
    partial = manager.begin(3)
    engine = partial / "actor_train" / ENGINE_TAG
    engine.mkdir(parents=True)
    files = ["mp_rank_00_model_states.pt", *SHARDS[:saved_ranks]]
    for name in files:  # whole torch files (a zip archive each), of a tensor
        torch.save({"x": torch.zeros(4)}, engine / name)
    if record:
        sizes = {
            "world_size": saved_ranks,
            "dp_world_size": saved_ranks,
            "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": accum,
        }
        write_engine_record(engine, {"zero_stage": 2, **sizes, "files": files, **extra})
    return manager.commit(partial, {"step": 3})


def _cfg(path: Path | str, world: int, micro: int = 2, accum: int = 1) -> RLVRConfig:
    actor = WorkerConfig(device_mapping=list(range(world)))
    actor.strategy_args.strategy_name = "deepspeed_train"
    actor.training_args.per_device_train_batch_size = micro
    actor.training_args.gradient_accumulation_steps = accum
    # 2 prompts x 4 samples = 8 rows a step: whole optimizer steps of 4 rows on 1, 2 or 4 ranks
    return RLVRConfig(
        resume_from_checkpoint=str(path),
        actor_train=actor,
        rollout_batch_size=2,
        num_return_sequences_in_group=4,
    )


@pytest.fixture(autouse=True)
def prepared(monkeypatch) -> list[tuple]:
    """The strategy's resized_resume hook (the boundary: these shards are not real DeepSpeed
    files), recording what the driver asked it to prepare."""
    calls: list[tuple] = []

    def hook(target: str):
        assert target == "strategies.deepspeed.universal:prepare_resized"
        return lambda path, tag, *, timeout_s: calls.append((Path(path).name, tag, timeout_s))

    monkeypatch.setattr(save_resume, "load_hook", hook)
    return calls


def _accum(cfg: RLVRConfig) -> int:
    return cfg.actor_train.training_args.gradient_accumulation_steps


@pytest.mark.parametrize("world", [1, 2, 4])
def test_complete_checkpoint_passes_on_any_size(tmp_path, world, caplog, prepared):
    path = _checkpoint(tmp_path, accum=2)  # 2 x 2 x 2 = 8 rows a step: GA 4, 2, 1
    cfg = _cfg(path, world, accum=2)
    with caplog.at_level(logging.INFO, logger="roll_ds.pipeline.save_resume"):
        assert check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"]) == path
    assert _accum(cfg) * world == 4
    converting = "universal checkpoint" in caplog.text
    assert converting == (world != 2), caplog.text
    # prepared in the driver, bounded by 300 s plus its few bytes at 20 MiB/s
    assert [c[:2] for c in prepared] == ([("actor_train", ENGINE_TAG)] if world != 2 else [])
    assert all(300 < c[2] < 301 for c in prepared)


def test_latest_resolves(tmp_path):
    path = _checkpoint(tmp_path)
    assert check_resume(_cfg("latest", 2), CheckpointManager(tmp_path), ["actor_train"]) == path


@pytest.mark.parametrize("world", [1, 2])
def test_missing_shard_names_the_file(tmp_path, world):
    path = _checkpoint(tmp_path)
    (path / "actor_train" / ENGINE_TAG / SHARDS[1]).unlink()
    with pytest.raises(FileNotFoundError) as err:
        check_resume(_cfg(path, world), CheckpointManager(tmp_path), ["actor_train"])
    message = str(err.value)
    assert "resume_from_checkpoint" in message and SHARDS[1] in message
    assert ("every saved rank's shard" in message) == (world == 1), message


def test_zero3_refusal_of_older_records_no_longer_applies(tmp_path):
    """Records written while ZeRO-3 was refused on another size carry ``not_resizable``; the
    defect was in the load (strategies/deepspeed/universal.py), so those checkpoints resume."""
    path = _checkpoint(tmp_path, not_resizable="ZeRO-3 cannot; resume on 2 ranks")
    assert check_resume(_cfg(path, 1, accum=2), CheckpointManager(tmp_path), ["actor_train"])


@pytest.mark.parametrize(
    ("saved_ranks", "accum", "world", "rescaled"),
    [(2, 1, 1, 2), (4, 1, 2, 2), (1, 4, 2, 2), (1, 4, 4, 1), (2, 2, 2, 2)],
)
def test_gradient_accumulation_keeps_the_global_batch(
    tmp_path, caplog, saved_ranks, accum, world, rescaled
):
    """The config keeps the saved per-rank settings: GA x world stays saved GA x saved world
    (the last case is not resized: left alone)."""
    path = _checkpoint(tmp_path, saved_ranks=saved_ranks, accum=accum)
    cfg = _cfg(path, world, accum=accum)
    with caplog.at_level(logging.INFO, logger="roll_ds.pipeline.resume_batch"):
        check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    assert _accum(cfg) == rescaled
    assert ("keeping the global batch of" in caplog.text) == (rescaled != accum), caplog.text


def test_rescaling_needs_the_deepspeed_batch_sizes_on_auto(tmp_path):
    """A number in the DeepSpeed JSON would disagree with the rescaled GA inside a worker."""
    path = _checkpoint(tmp_path)
    cfg = _cfg(path, 1)
    cfg.actor_train.strategy_args.strategy_config = {"gradient_accumulation_steps": 1}
    with pytest.raises(ValueError, match=r"strategy_config sets gradient_accumulation_steps: set"):
        check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    cfg.actor_train.strategy_args.strategy_config = {"gradient_accumulation_steps": "auto"}
    check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    assert _accum(cfg) == 2


def test_config_giving_the_saved_global_batch_is_left_alone(tmp_path):
    """Saved on 2 ranks as 2 x 1 rows; on 1 rank the user set 4 x 1 themselves."""
    path = _checkpoint(tmp_path)
    cfg = _cfg(path, 1, micro=4, accum=1)
    check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    assert (cfg.actor_train.training_args.per_device_train_batch_size, _accum(cfg)) == (4, 1)


def test_accumulation_that_does_not_divide_is_refused_naming_the_fix(tmp_path):
    """Saved on 1 rank as 2 x 1 rows per step; on 2 ranks GA would be 1/2: set the micro batch
    to 1 (2 rows a step = 1 x 1 x 2)."""
    path = _checkpoint(tmp_path, saved_ranks=1)
    cfg = _cfg(path, 2)
    with pytest.raises(ValueError) as err:
        check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    message = str(err.value)
    assert "global batch of 2 rows" in message, message
    fix = "per_device_train_batch_size: 1 and gradient_accumulation_steps: 1 (rows per rank"
    assert f"Set actor_train.training_args.{fix}" in message, message
    assert _accum(cfg) == 1  # nothing changed


def test_changed_per_rank_settings_are_refused_with_the_value_that_keeps_the_batch(tmp_path):
    """Saved on 2 ranks as 2 x 2 (8 rows); on 1 rank the user set GA 3 (6 rows): GA 4 keeps it."""
    path = _checkpoint(tmp_path, accum=2)
    with pytest.raises(ValueError, match=r"training_args.gradient_accumulation_steps: 4"):
        check_resume(_cfg(path, 1, accum=3), CheckpointManager(tmp_path), ["actor_train"])


def test_global_batch_that_does_not_split_over_the_ranks_names_the_sizes(tmp_path):
    """4 rows a step (saved on 2 ranks, 2 x 1) cannot split over 3 ranks."""
    path = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"resume on a world size dividing 4 \(1, 2, 4\)"):
        check_resume(_cfg(path, 3), CheckpointManager(tmp_path), ["actor_train"])


def test_rescaled_batch_must_still_cut_the_step_evenly(tmp_path):
    """Saved on 4 ranks as 2 x 2 (16 rows a step): on 1 rank GA 8 keeps it, but this run's step
    has 8 samples (2 x 4), fewer than one optimizer step: refused, naming the sizes."""
    path = _checkpoint(tmp_path, saved_ranks=4, accum=2)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint: rollout_batch_size"):
        check_resume(_cfg(path, 1, accum=2), CheckpointManager(tmp_path), ["actor_train"])


def test_record_without_batch_sizes_is_left_alone(tmp_path):
    """A record written before the batch sizes were in it: the saved global batch is unknown."""
    path = _checkpoint(tmp_path)
    record = path / "actor_train" / ENGINE_TAG / "engine.json"
    data = json.loads(record.read_text())
    del data["per_device_train_batch_size"], data["gradient_accumulation_steps"]
    record.write_text(json.dumps(data))
    cfg = _cfg(path, 1)
    check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    assert _accum(cfg) == 1


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


# --- damage the file listing does not show: each a clear error naming the file, before any
# actor starts (the trainers' load failed after every role had started) -------------------------


def test_a_truncated_shard_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    shard = path / "actor_train" / ENGINE_TAG / SHARDS[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{shard} is damaged: not a complete torch file"):
        check_resume(_cfg(path, 2), CheckpointManager(tmp_path), ["actor_train"])


def test_a_truncated_shard_of_a_checkpoint_without_a_record_is_named(tmp_path):
    path = _checkpoint(tmp_path, record=False)
    shard = path / "actor_train" / ENGINE_TAG / SHARDS[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard} is damaged"):
        check_resume(_cfg(path, 2), CheckpointManager(tmp_path), ["actor_train"])


def test_a_missing_pipeline_state_is_named(tmp_path):
    path = _checkpoint(tmp_path)
    (path / "pipeline_state.json").unlink()
    with pytest.raises(CheckpointError, match=f"{path / 'pipeline_state.json'} is missing"):
        check_resume(_cfg(path, 2), CheckpointManager(tmp_path), ["actor_train"])


@pytest.mark.parametrize(
    "name", ["pipeline_state.json", "actor_train/engine/engine.json", "rollouts_in_flight.json"]
)
def test_a_corrupt_json_file_is_named(tmp_path, name):
    path = _checkpoint(tmp_path)
    (path / name).write_text('{"step": 3, "sampler": {')  # cut short
    with pytest.raises(CheckpointError, match=f"{path / name} is not valid JSON"):
        check_resume(_cfg(path, 2), CheckpointManager(tmp_path), ["actor_train"])


def _with_lora(path: Path, lora: dict | None) -> None:
    """The checkpoint's export_info.json, as save_run_checkpoint writes it."""
    from roll_ds.export import ExportInfo

    ExportInfo(base_model="m", base_model_path="/m", lora=lora).save(path)


LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target": "all-linear"}


@pytest.mark.parametrize(
    ("saved", "rank", "target", "field"),
    [
        (LORA, 8, "all-linear", "actor_train.model_args.lora_rank"),
        (LORA, 4, "q_proj,v_proj", "actor_train.model_args.lora_target"),
        (LORA, None, "all-linear", "actor_train.model_args.lora_rank"),
        (None, 4, "all-linear", "actor_train.model_args.lora_rank"),
    ],
)
def test_a_lora_shape_other_than_the_config_s_is_named(tmp_path, saved, rank, target, field):
    path = _checkpoint(tmp_path)
    _with_lora(path, saved)
    cfg = _cfg(path, 2)
    cfg.actor_train.model_args.lora_rank = rank
    cfg.actor_train.model_args.lora_target = target
    with pytest.raises(ValueError, match=f"{path / 'export_info.json'} records") as info:
        check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])
    assert field in str(info.value)
    cfg.actor_train.model_args.lora_rank = saved and saved["rank"]
    cfg.actor_train.model_args.lora_target = "all-linear"
    check_resume(cfg, CheckpointManager(tmp_path), ["actor_train"])  # the saved shape passes
