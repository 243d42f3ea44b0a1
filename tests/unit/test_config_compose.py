"""Every shipped YAML composes against the schema; the ZeRO-stage override works."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from roll_ds.config import compose_config, load_config, to_schema
from roll_ds.config.compose import PROJECT_ROOT

PIPELINE_DIR = PROJECT_ROOT / "examples" / "qwen_rlvr"
PRESET_DIR = PROJECT_ROOT / "examples" / "config"
PIPELINES = sorted(p.stem for p in PIPELINE_DIR.glob("*.yaml"))
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def stage(cfg) -> int:
    return cfg.actor_train.strategy_args.strategy_config["zero_optimization"]["stage"]


def test_examples_are_found():
    assert {"rlvr_lora_zero3", "rlvr_lora_zero2", "rlvr_full_zero3"} <= set(PIPELINES)
    assert {
        "deepspeed_zero",
        "deepspeed_zero2",
        "deepspeed_zero2_cpuoffload",
        "deepspeed_zero3",
        "deepspeed_zero3_cpuoffload",
    } <= set(PRESETS)


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_yaml_composes_and_validates(name):
    # File checks are off so configs that point at real cluster paths (Qwen2.5-7B) validate here.
    cfg = load_config(name, check_files=False)
    assert cfg.actor_train.strategy_args.strategy_name == "deepspeed_train"
    assert stage(cfg) in (0, 1, 2, 3)


@pytest.mark.parametrize("name", PRESETS)
def test_deepspeed_preset_composes_under_its_own_root_key(name):
    cfg = compose_config(name, config_dir=PRESET_DIR)
    assert list(cfg.keys()) == [name]
    assert "zero_optimization" in cfg[name]


def test_embedded_default_validates_with_files():
    cfg = load_config("rlvr_lora_zero3")
    assert stage(cfg) == 3
    assert cfg.actor_train.model_args.lora_rank == 16
    for path in cfg.actor_train.data_args.file_name + cfg.validation.data_args.file_name:
        assert Path(path).is_file()


@pytest.mark.parametrize(
    ("preset", "expected_stage", "offload"),
    [
        ("deepspeed_zero", 0, False),
        ("deepspeed_zero2", 2, False),
        ("deepspeed_zero2_cpuoffload", 2, True),
        ("deepspeed_zero3_cpuoffload", 3, True),
    ],
)
def test_zero_stage_override_from_command_line(preset, expected_stage, offload):
    override = f"actor_train.strategy_args.strategy_config=${{{preset}}}"
    cfg = load_config("rlvr_lora_zero3", [override], check_files=False)
    assert stage(cfg) == expected_stage
    zero = cfg.actor_train.strategy_args.strategy_config["zero_optimization"]
    assert ("offload_optimizer" in zero) == offload


def test_sibling_configs_differ_where_documented():
    zero2 = load_config("rlvr_lora_zero2", check_files=False)
    assert stage(zero2) == 2
    full = load_config("rlvr_full_zero3", check_files=False)
    assert full.actor_train.model_args.lora_rank is None
    assert full.reference is not None
    assert full.reference.strategy_args.strategy_name == "hf_infer"


def test_cluster_example_maps_sixteen_devices():
    cfg = load_config("rlvr_qwen2.5_7b_lora_zero3_16gpu", check_files=False)
    assert cfg.actor_train.device_mapping == "list(range(0,16))"
    assert (cfg.num_nodes, cfg.num_gpus_per_node) == (2, 8)


def test_misspelled_key_is_rejected_while_composing():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("rlvr_lora_zero3", ["actor_train.model_args.lora_rnak=8"])
    assert "Key 'lora_rnak' not in 'ModelArgs'" in str(info.value.__cause__)


def test_misspelled_key_in_yaml_is_rejected(tmp_path):
    (tmp_path / "typo.yaml").write_text(
        "defaults:\n  - rlvr_config\n  - _self_\nactor_train:\n  trainig_args: {}\n"
    )
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("typo", config_dir=tmp_path)
    assert "Key 'trainig_args' not in 'WorkerConfig'" in str(info.value)
    assert "full_key: actor_train.trainig_args" in str(info.value)


def test_wrong_type_is_rejected_while_composing():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("rlvr_lora_zero3", ["actor_train.training_args.learning_rate=fast"])
    assert isinstance(info.value.__cause__, ValidationError)
    assert "learning_rate" in str(info.value.__cause__)


def test_missing_strategy_name_is_reported_not_raised_raw():
    from roll_ds.config import ConfigError

    raw = compose_config("rlvr_lora_zero3", ["actor_infer.strategy_args.strategy_name=???"])
    with pytest.raises(ConfigError, match=r"actor_infer\.strategy_args\.strategy_name: required"):
        to_schema(raw)


def test_ppo_gae_config_colocates_a_zero3_critic():
    gae = load_config("rlvr_ppo_gae_zero3", check_files=False)
    assert gae.algorithm.adv_estimator == "gae" and gae.algorithm.lam == 0.95
    assert gae.critic.strategy_args.strategy_name == "deepspeed_train"
    assert gae.critic.strategy_args.strategy_config == gae.actor_train.strategy_args.strategy_config
    assert gae.critic.device_mapping == gae.actor_train.device_mapping
    default = load_config("rlvr_lora_zero3", check_files=False)
    assert default.algorithm.adv_estimator == "grpo" and default.critic is None
