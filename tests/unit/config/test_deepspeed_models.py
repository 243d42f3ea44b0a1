"""A role's DeepSpeed config checked with DeepSpeed's own pydantic models before any actor starts
(strategies/deepspeed/ds_models.py): a misspelt or mistyped key in a preset, on the command line
and in a user YAML is a clear error naming the key, the preset and the fix. Before, each passed
validation and failed inside ``deepspeed.initialize`` after every actor had started."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_ds.config import ConfigError, load_config
from strategies.deepspeed.ds_models import deepspeed_model_problems

FIELD = "actor_train.strategy_args.strategy_config"


def _problems(overrides: list[str], **kw) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("rlvr_lora_zero3", overrides, **kw)
    return str(err.value)


def test_a_misspelt_key_in_the_preset_names_the_key_the_preset_and_the_nearest_key():
    text = _problems(["+deepspeed_zero3.zero_optimization.offload_param.pin_memroy=true"])
    assert (
        f"{FIELD}.zero_optimization.offload_param.pin_memroy: DeepSpeed does not know this key "
        "(from the preset deepspeed_zero3); did you mean pin_memory?"
    ) in text
    text = _problems(["+deepspeed_zero3.zero_optimization.stage3_prefech_bucket_size=5"])
    assert (
        "stage3_prefech_bucket_size" in text and "did you mean stage3_prefetch_bucket_size" in text
    )


def test_a_key_deepspeed_has_not_at_all_is_to_be_removed():
    text = _problems(["+deepspeed_zero3.zero_optimization.turbo_mode=true"])
    assert f"{FIELD}.zero_optimization.turbo_mode: DeepSpeed does not know this key" in text
    assert "remove it" in text


def test_a_wrong_type_is_reported_once_with_deepspeeds_reason():
    text = _problems(
        ["deepspeed_zero3.zero_optimization.stage3_gather_16bit_weights_on_model_save=3"]
    )
    # roll_ds's own check reads this key: its line, not a second one from DeepSpeed's model
    assert text.count("stage3_gather_16bit_weights_on_model_save") == 1
    text = _problems(["+deepspeed_zero3.zero_optimization.round_robin_gradients=sometimes"])
    assert (
        f"{FIELD}.zero_optimization.round_robin_gradients: Input should be a valid boolean" in text
    )
    assert "(got 'sometimes') (from the preset deepspeed_zero3)" in text


def test_a_misspelt_key_in_a_users_own_yaml(tmp_path: Path):
    (tmp_path / "mine.yaml").write_text(
        "defaults: [rlvr_lora_zero3, _self_]\n"
        "actor_train:\n"
        "  strategy_args:\n"
        "    strategy_config:\n"
        "      zero_optimization: {stage: 2, overlap_com: true}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config("mine", config_dir=tmp_path)
    assert (
        f"{FIELD}.zero_optimization.overlap_com: DeepSpeed does not know this key; did you "
        "mean overlap_comm?" in str(err.value)
    )


def test_the_shipped_presets_pass_deepspeeds_models():
    cfg = load_config("rlvr_lora_zero3")
    for name in (
        "deepspeed_zero",
        "deepspeed_zero2",
        "deepspeed_zero3",
        "deepspeed_zero3_cpuoffload",
    ):
        preset = getattr(cfg, name)
        assert preset is not None and deepspeed_model_problems(preset, name) == [], name


def test_auto_values_at_any_depth_are_left_to_roll_ds():
    ds = {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "offload_param": {"device": "cpu", "buffer_size": "auto"},
        }
    }
    assert deepspeed_model_problems(ds, "x") == []
