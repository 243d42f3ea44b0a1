"""Settings that are valid but have no effect are logged as warnings naming the field."""

import logging

import pytest

from roll_ds.config import compose_config, to_schema, validate
from roll_ds.config.compose import PROJECT_ROOT


def warnings_for(*overrides: str, config: str = "rlvr_lora_zero3") -> list[str]:
    cfg = to_schema(compose_config(config, list(overrides)))
    return validate(cfg, check_files=False)


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in (PROJECT_ROOT / "examples" / "qwen_rlvr").glob("*.yaml"))
)
def test_shipped_configs_have_no_warnings(name):
    assert warnings_for(config=name) == []


def test_gamma_and_lam_ignored_by_grpo(caplog):
    with caplog.at_level(logging.WARNING, logger="roll_ds.config.validate"):
        found = warnings_for("algorithm.gamma=0.99", "algorithm.lam=0.95")
    assert found == [
        "algorithm.gamma=0.99 has no effect with adv_estimator 'grpo'; it is used by gae, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline",
        "algorithm.lam=0.95 has no effect with adv_estimator 'grpo'; it is used by gae",
    ]
    assert [r.getMessage() for r in caplog.records] == [f"config: {w}" for w in found]


def test_gamma_is_read_by_reinforce_plus_plus_but_lam_is_not():
    found = warnings_for(
        "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.9", "algorithm.lam=0.9"
    )
    assert found == [
        "algorithm.lam=0.9 has no effect with adv_estimator 'reinforce_plus_plus'; it is used "
        "by gae"
    ]


def test_gae_reads_gamma_and_lam():
    assert warnings_for("algorithm.gamma=0.99", config="rlvr_ppo_gae_zero3") == []


def test_whitening_an_always_whitened_estimator():
    found = warnings_for(
        "algorithm.adv_estimator=reinforce_plus_plus_baseline", "algorithm.whiten_advantages=true"
    )
    assert found == [
        "algorithm.whiten_advantages has no effect with adv_estimator "
        "'reinforce_plus_plus_baseline', whose advantages are always whitened"
    ]
    assert warnings_for("algorithm.whiten_advantages=true") == []  # grpo: whitened on request


def test_max_resample_rounds_without_dynamic_sampling():
    found = warnings_for("algorithm.max_resample_rounds=5")
    assert found == [
        "algorithm.max_resample_rounds=5 has no effect while algorithm.dynamic_sampling is false"
    ]
    assert warnings_for("algorithm.max_resample_rounds=5", "algorithm.dynamic_sampling=true") == []


def test_critic_settings_without_a_critic_estimator():
    found = warnings_for(
        "algorithm.adv_estimator=grpo", "algorithm.value_clip=0.2", config="rlvr_ppo_gae_zero3"
    )
    assert found == [
        "algorithm.lam=0.95 has no effect with adv_estimator 'grpo'; it is used by gae",
        "critic: configured but adv_estimator 'grpo' uses no critic; the role is not started "
        "(it is used by gae)",
        "algorithm.value_clip=0.2 has no effect with adv_estimator 'grpo' (no critic); it is "
        "used by gae",
    ]


def test_an_unused_critic_gets_no_devices():
    from roll_ds.config.role_placement import role_configs

    gae = to_schema(compose_config("rlvr_ppo_gae_zero3"))
    assert "critic" in dict(role_configs(gae))
    grpo = to_schema(compose_config("rlvr_ppo_gae_zero3", ["algorithm.adv_estimator=grpo"]))
    assert "critic" not in dict(role_configs(grpo))


def test_token_clip_range_under_sequence_ratio():
    # rlvr_lora_zero3 sets clip_high 0.28 (clip-higher); GSPO clips with seq_clip_* instead.
    found = warnings_for("algorithm.ratio_level=sequence", "algorithm.seq_clip_high=5e-4")
    assert found == [
        "algorithm.clip_high=0.28 has no effect with ratio_level 'sequence'; it is used by "
        "ratio_level 'token'"
    ]


def test_sequence_clip_range_under_token_ratio():
    assert warnings_for("algorithm.seq_clip_low=1e-3") == [
        "algorithm.seq_clip_low=0.001 has no effect with ratio_level 'token'; it is used by "
        "ratio_level 'sequence'"
    ]


def test_overlong_penalty_factor_without_a_buffer():
    found = warnings_for("algorithm.overlong_penalty_factor=0.5")
    assert found == [
        "algorithm.overlong_penalty_factor=0.5 has no effect while algorithm.overlong_buffer_len "
        "is 0; set overlong_buffer_len to the tokens before response_length where the penalty "
        "starts"
    ]
    assert (
        warnings_for("algorithm.overlong_penalty_factor=0.5", "algorithm.overlong_buffer_len=4")
        == []
    )


def test_kl_settings_without_kl():
    found = warnings_for("algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1")
    assert found == [
        "algorithm.kl_in_reward=True has no effect while algorithm.kl_coef is 0",
        "algorithm.kl_estimator=k1 has no effect while algorithm.kl_coef is 0",
    ]


def test_reference_log_probs_nobody_uses():
    found = warnings_for("algorithm.kl_coef=0.1", "algorithm.use_kl_loss=false")
    assert found == [
        "algorithm.kl_coef=0.1: reference log-probs are computed every step but nothing uses "
        "them (algorithm.use_kl_loss and algorithm.kl_in_reward are both false); set one of "
        "them to true, or kl_coef=0"
    ]
    assert warnings_for("algorithm.kl_coef=0.1") == []  # KL loss
    no_loss = ("algorithm.kl_coef=0.1", "algorithm.use_kl_loss=false")
    assert warnings_for(*no_loss, "algorithm.kl_in_reward=true") == []  # KL penalty


def test_kl_loss_and_kl_reward_together():
    assert warnings_for("algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true") == [
        "algorithm.use_kl_loss has no effect while algorithm.kl_in_reward is true (the KL goes "
        "into the reward only); set use_kl_loss=false"
    ]


def test_reference_role_without_kl():
    assert warnings_for("algorithm.kl_coef=0", config="rlvr_full_zero3") == [
        "reference: configured but algorithm.kl_coef is 0; the role starts and its log-probs are "
        "never used (set kl_coef > 0 or remove `reference:`)"
    ]


def test_settings_of_switched_off_features():
    assert warnings_for("save_steps=0", "keep_last=5") == [
        "keep_last=5 has no effect while save_steps is 0 (no checkpoints)"
    ]
    assert warnings_for("eval_steps=0", "validation.max_prompts=4") == [
        "validation.max_prompts=4 has no effect while eval_steps is 0 (no evaluation)"
    ]
    assert warnings_for("weight_sync.parity_check=false", "weight_sync.parity_probe_size=8") == [
        "weight_sync.parity_probe_size=8 has no effect while weight_sync.parity_check is false"
    ]


def test_correction_bounds_the_chosen_correction_does_not_read():
    assert warnings_for("algorithm.rollout_correction=icepop", "algorithm.tis_cap=3.0") == [
        "algorithm.tis_cap=3.0 has no effect with rollout_correction 'icepop'; it is read by "
        "token_tis, seq_tis"
    ]
    assert warnings_for("algorithm.correction_high=2.0") == [
        "algorithm.correction_high=2.0 has no effect with rollout_correction None; it is read "
        "by icepop, geo_mask"
    ]
    assert warnings_for("algorithm.rollout_correction=seq_tis", "algorithm.tis_cap=3.0") == []


def test_an_inherited_generation_cap_below_response_length(tmp_path, caplog):
    """A parent that fixes ``max_new_tokens: 8`` and a child that raises ``response_length``:
    every answer stopped at 8 tokens without a word."""
    (tmp_path / "parent.yaml").write_text(
        "defaults:\n  - rlvr_lora_zero3\n  - _self_\n"
        "actor_infer:\n  generating_args:\n    max_new_tokens: 8\n"
    )
    (tmp_path / "child.yaml").write_text("defaults:\n  - parent\n  - _self_\nresponse_length: 24\n")
    with caplog.at_level(logging.WARNING, logger="roll_ds.config.validate"):
        found = validate(to_schema(compose_config("child", config_dir=tmp_path)), check_files=False)
    assert found == [
        "actor_infer.generating_args.max_new_tokens: 8 < response_length 24: every actor_infer "
        "answer stops at 8 tokens though response_length allows 24. A fixed max_new_tokens is "
        "inherited from the config this one derives from (its defaults) unless set again here "
        "or on the command line; set actor_infer.generating_args.max_new_tokens: "
        "${response_length} (or null) to follow response_length, or response_length: 8 if the "
        "cap is meant"
    ]
    assert [r.getMessage() for r in caplog.records] == [f"config: {w}" for w in found]


def test_a_held_out_cap_is_warned_too_and_episodes_budgets_are_not():
    (line,) = warnings_for("validation.generating_args.max_new_tokens=4")
    assert line.startswith("validation.generating_args.max_new_tokens: 4 < response_length 8")
    assert warnings_for("validation.generating_args.max_new_tokens=4", "eval_steps=0") == []
    # rows beside episodes: response_length is the episodes' budget, a row's cap is its own
    assert warnings_for(config="rlvr_mixed_calculator") == []
