"""Every model path a role names is checked before anything starts, like ``pretrain`` (issue 19):
a reward model, critic, reference or rollout model that does not exist used to pass validation
and fail minutes later inside its actor."""

import pytest

from roll_ds.config import ConfigError, load_config

HINT = "point it at a local model directory (no model hub is reachable at run time)"


def path_problems(config: str, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, list(overrides))
    return [p for p in info.value.problems if "model_name_or_path" in p or "pretrain" in p]


@pytest.mark.parametrize(
    ("config", "field", "embedded"),
    [
        ("rlvr_lora_zero3_rm", "rewards.math.model_args.model_name_or_path", "embedded:tiny-rm"),
        ("rlvr_ppo_gae_zero3", "critic.model_args.model_name_or_path", "embedded:tiny-qwen2"),
        ("rlvr_full_zero3", "reference.model_args.model_name_or_path", "embedded:tiny-qwen2"),
        ("rlvr_lora_zero3", "actor_infer.model_args.model_name_or_path", "embedded:tiny-qwen2"),
        ("rlvr_lora_zero3", "actor_train.model_args.model_name_or_path", "embedded:tiny-qwen2"),
    ],
)
def test_a_role_model_path_that_does_not_exist(config, field, embedded):
    found = path_problems(config, f"{field}=/nonexistent/model")
    assert found == [f"{field}: '/nonexistent/model' does not exist; {HINT} or use {embedded!r}"], (
        found
    )


def test_same_message_as_pretrain():
    found = path_problems("rlvr_lora_zero3", "pretrain=/nonexistent/model")
    assert found == [
        f"pretrain: '/nonexistent/model' does not exist; {HINT} or use 'embedded:tiny-qwen2'"
    ]


def test_a_hub_id_is_not_a_path():
    field = "rewards.math.model_args.model_name_or_path"
    found = path_problems("rlvr_lora_zero3_rm", f"{field}=org/reward-model")
    assert found and found[0].startswith(f"{field}: 'org/reward-model' does not exist")


def test_an_unknown_embedded_name():
    found = path_problems(
        "rlvr_lora_zero3_rm", "rewards.math.model_args.model_name_or_path=embedded:tiny-judge"
    )
    assert found == [
        "rewards.math.model_args.model_name_or_path: 'embedded:tiny-judge' is not an embedded "
        "model; valid: embedded:tiny-qwen2, embedded:tiny-rm, embedded:tiny-agent"
    ]


def test_embedded_names_and_local_directories_pass(tmp_path):
    load_config("rlvr_lora_zero3_rm", [])  # embedded:tiny-rm on both reward roles
    load_config("rlvr_full_zero3", [f"reference.model_args.model_name_or_path={tmp_path}"])


def test_an_unused_critic_is_not_checked():
    # the critic is configured but the estimator reads no values: no role starts it
    load_config(
        "rlvr_ppo_gae_zero3",
        ["algorithm.adv_estimator=grpo", "critic.model_args.model_name_or_path=/nonexistent"],
    )


def test_every_problem_at_once():
    found = path_problems(
        "rlvr_lora_zero3_rm",
        "pretrain=/no/policy",
        "rewards.math.model_args.model_name_or_path=/no/rm",
        "rewards.reverse.model_args.model_name_or_path=/no/rm2",
    )
    assert [p.split(":")[0] for p in found] == [
        "pretrain",
        "rewards.math.model_args.model_name_or_path",
        "rewards.reverse.model_args.model_name_or_path",
    ]
