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
        "deepspeed_zero3_nvme",
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
        ("deepspeed_zero3_nvme", 3, True),
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


# --- a user's own config directory ---------------------------------------------------------

SAMPLE = PROJECT_ROOT / "examples" / "qwen_rlvr" / "data"
USER_CONFIG = f"""\
defaults:
  - rlvr_lora_zero3          # an example, found by name from any directory
  - _self_

exp_name: my_gsm8k
prompt_length: 160
response_length: 16
actor_infer:
  strategy_args:
    strategy_config: {{max_model_len: 192}}
actor_train:
  data_args:
    file_name: [{SAMPLE}/gsm8k_sample_train.parquet]
    prompt_key: question
    answer_key: answer
    answer_format: gsm8k
    default_domain: gsm8k
    template: chat
    chat_template: chatml
validation:
  data_args:
    file_name: [{SAMPLE}/gsm8k_sample_test.parquet]
    prompt_key: question
    answer_key: answer
    answer_format: gsm8k
    default_domain: gsm8k
    template: chat
    chat_template: chatml
replace:                     # these replace what rlvr_lora_zero3 has instead of merging
  actor_train:
    data_args:
      domain_interleave_probs: {{gsm8k: 1.0}}
  rewards:
    gsm8k:
      tag_included: [gsm8k]
      reward_fns: [{{name: math_rule, weight: 1.0}}]
"""
PRESETS_ONLY = """\
defaults:
  - rlvr_config
  - ../config/deepspeed_zero2@_here_   # the presets, as the examples pull them in
  - _self_
actor_train:
  strategy_args:
    strategy_config: ${deepspeed_zero2}
"""


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "my_configs"  # outside the repository
    directory.mkdir()
    (directory / "mine.yaml").write_text(USER_CONFIG)
    (directory / "presets_only.yaml").write_text(PRESETS_ONLY)
    return directory


def test_user_config_outside_the_repo_derives_and_replaces(user_dir: Path):
    assert PROJECT_ROOT not in user_dir.parents
    cfg = load_config("mine", config_dir=user_dir)  # files checked too
    assert cfg.exp_name == "my_gsm8k" and stage(cfg) == 3  # inherited
    assert list(cfg.rewards) == ["gsm8k"]  # math / reverse dropped, not merged
    assert type(cfg.rewards["gsm8k"]).__name__ == "RewardConfig"
    assert cfg.rewards["gsm8k"].timeout_s == 5.0  # schema defaults fill the replaced role
    assert cfg.actor_train.data_args.domain_interleave_probs == {"gsm8k": 1.0}
    assert cfg.actor_train.model_args.lora_rank == 16  # inherited


def test_without_replace_the_inherited_dicts_merge(user_dir: Path):
    (user_dir / "merged.yaml").write_text(
        "defaults: [rlvr_lora_zero3, _self_]\n"
        "actor_train: {data_args: {domain_interleave_probs: {gsm8k: 1.0}}}\n"
        "rewards: {gsm8k: {tag_included: [gsm8k], reward_fns: [{name: math_rule}]}}\n"
    )
    cfg = compose_config("merged", config_dir=user_dir)
    assert set(cfg.rewards) == {"math", "reverse", "gsm8k"}  # why `replace:` exists
    assert set(cfg.actor_train.data_args.domain_interleave_probs) == {"math", "reverse", "gsm8k"}


def test_user_config_reaches_the_deepspeed_presets(user_dir: Path):
    cfg = compose_config("presets_only", config_dir=user_dir)
    assert cfg.actor_train.strategy_args.strategy_config.zero_optimization.stage == 2


def test_replace_errors_name_the_key(user_dir: Path):
    from roll_ds.config import ConfigError

    with pytest.raises(ConfigError) as info:
        compose_config(
            "mine",
            ["++replace.rewards.gsm8k.timeout=1", "++replace.nope=1", "rewards.math.world_size=2"],
            config_dir=user_dir,
        )
    assert info.value.problems == [
        "rewards.math.world_size=2: rewards is set by the config's `replace:` section, which "
        "replaces it after overrides apply; override ++replace.rewards.math.world_size=2 instead",
        "replace.rewards.gsm8k.timeout: Key 'timeout' not in 'RewardConfig'",
        "replace.nope: Key 'nope' is not in RLVRConfig",
    ]
    cfg = compose_config("mine", ["++replace.rewards.gsm8k.world_size=2"], config_dir=user_dir)
    assert cfg.rewards.gsm8k.world_size == 2


def test_run_py_and_the_installed_package_from_outside_the_repo(user_dir: Path):
    """From another working directory, with the repository off sys.path: the installed package's
    search-path plugin finds the examples, and run.py applies `replace:` (its check of a lost
    override is the error here, exit 2, before anything starts)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "from roll_ds.config import load_config\n"
        f"cfg = load_config('mine', config_dir={str(user_dir)!r})\n"
        "print(sorted(cfg.rewards))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=user_dir, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['gsm8k']"
    run = [sys.executable, str(PROJECT_ROOT / "run.py"), "--config-dir", str(user_dir)]
    out = subprocess.run(
        [*run, "--config-name", "mine", "rewards.math.world_size=2"],
        cwd=user_dir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "override ++replace.rewards.math.world_size=2 instead" in out.stderr
