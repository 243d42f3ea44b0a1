"""roll_ds's hints under Hydra's errors for rejected command-line overrides."""

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from roll_ds.config.compose import PROJECT_ROOT, compose_config
from roll_ds.config.hints import hint_for, hint_for_exception

ZERO_STAGE = "actor_train.strategy_args.strategy_config.zero_optimization.stage=2"


def hydra_error(*overrides: str) -> ConfigCompositionException:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("rlvr_lora_zero3", list(overrides))
    return info.value


def test_override_inside_an_interpolated_strategy_config():
    hint = hint_for_exception(hydra_error(ZERO_STAGE))
    assert hint == (
        "actor_train.strategy_args.strategy_config is an interpolation of a DeepSpeed preset "
        "(such as ${deepspeed_zero3}); keys inside it cannot be overridden on its path.\n"
        "  - to switch presets (e.g. the ZeRO stage): "
        "actor_train.strategy_args.strategy_config='${deepspeed_zero2}'\n"
        "  - to change one value, override it in the preset the role uses: "
        "deepspeed_zero3.zero_optimization.stage=2 (every role using that preset sees it)\n"
        f"  (++{ZERO_STAGE} would replace the whole strategy_config by that one key)"
    )


def test_appending_inside_an_interpolated_strategy_config():
    hint = hint_for_exception(hydra_error(f"+{ZERO_STAGE}"))
    assert hint is not None
    assert "deepspeed_zero3.zero_optimization.stage=2 (every role" in hint


def test_misspelled_key():
    hint = hint_for_exception(hydra_error("actor_train.training_args.learnin_rate=1"))
    first, valid = hint.splitlines()
    assert first == (
        "actor_train.training_args.learnin_rate: TrainingArgs has no key 'learnin_rate'; did you "
        "mean actor_train.training_args.learning_rate?"
    )
    assert valid.startswith("  valid keys of actor_train.training_args: learning_rate, ")


def test_misspelled_root_and_reward_keys():
    assert hint_for_exception(hydra_error("max_step=3")).startswith(
        "max_step: RLVRConfig has no key 'max_step'; did you mean max_steps or "
    )
    hint = hint_for_exception(hydra_error("rewards.math.timeout=3"))
    assert "did you mean rewards.math.timeout_s?" in hint


def test_misspelled_key_in_a_yaml_file():
    text = (
        "In 'bad': ConfigKeyError raised while composing config:\n"
        "Key 'kl_coeff' not in 'AlgorithmConfig'\n"
        "    full_key: algorithm.kl_coeff\n"
    )
    assert hint_for(text).startswith(
        "algorithm.kl_coeff: AlgorithmConfig has no key 'kl_coeff'; did you mean algorithm.kl_coef "
        "or algorithm.vf_coef?\n"
    )


def test_new_key_of_a_plain_dict_gets_no_hint():
    # vllm's strategy_config is a plain dict: Hydra's own `+key=value` advice is right.
    error = hydra_error("actor_infer.strategy_args.strategy_config.gpu_memory_utilization=0.5")
    assert hint_for_exception(error) is None


def test_other_errors_get_no_hint():
    assert hint_for_exception(None) is None
    assert hint_for_exception(ValueError("Key 'a' not in 'TrainingArgs'")) is None
    assert hint_for("Value 'abc' of type 'str' could not be converted to Integer") is None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", "--config-name", "rlvr_lora_zero3", "--cfg", "job", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_prints_the_hint_below_hydras_message():
    result = run_cli(ZERO_STAGE)
    assert result.returncode == 1
    hydra_message, hint = result.stderr.split("roll_ds hint: ")
    assert "Key 'zero_optimization' is not in struct" in hydra_message
    assert "actor_train.strategy_args.strategy_config='${deepspeed_zero2}'" in hint
    result = run_cli("actor_train.training_args.learnin_rate=1")
    assert result.returncode == 1
    assert "roll_ds hint: actor_train.training_args.learnin_rate: TrainingArgs has no key" in (
        result.stderr
    )


REPLACE_ONLY = """\
defaults:
  - agentic_lora_zero3
  - _self_
exp_name: mine
replace:
  custom_envs:
    Echo: {env_type: guess_number, max_actions_per_traj: 2, max_tokens_per_step: 8}
  train_env_manager: {tags: [Echo], num_groups_partition: [16]}
  val_env_manager: {tags: [Echo]}
"""


@pytest.mark.parametrize("plus", ["", "+", "++"])
def test_a_key_set_only_under_replace_gets_the_replace_override(plus, tmp_path):
    (tmp_path / "mine.yaml").write_text(REPLACE_ONLY)
    override = f"{plus}custom_envs.Echo.max_actions_per_traj=3"
    with pytest.raises(ConfigCompositionException) as info:  # "not in struct" / a type error
        compose_config("mine", [override], tmp_path)
    hint = hint_for_exception(
        info.value, config_name="mine", config_dir=tmp_path, overrides=[override]
    )
    assert hint == (
        "custom_envs.Echo.max_actions_per_traj: custom_envs is set by the config's `replace:` "
        "section (which replaces it after overrides apply, so it is not in the composed config "
        "yet); override ++replace.custom_envs.Echo.max_actions_per_traj=3 instead"
    )
    fixed = compose_config("mine", ["++replace.custom_envs.Echo.max_actions_per_traj=3"], tmp_path)
    assert fixed.custom_envs.Echo.max_actions_per_traj == 3


def test_cli_prints_the_replace_hint(tmp_path):
    (tmp_path / "mine.yaml").write_text(REPLACE_ONLY)
    args = ["--config-dir", str(tmp_path), "--config-name", "mine", "--cfg", "job"]
    result = subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "run.py"),
            *args,
            "custom_envs.Echo.max_actions_per_traj=3",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "roll_ds hint: custom_envs.Echo.max_actions_per_traj: custom_envs is set by" in (
        result.stderr
    )
