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
    from roll_ds.config.validate import role_configs

    gae = to_schema(compose_config("rlvr_ppo_gae_zero3"))
    assert "critic" in dict(role_configs(gae))
    grpo = to_schema(compose_config("rlvr_ppo_gae_zero3", ["algorithm.adv_estimator=grpo"]))
    assert "critic" not in dict(role_configs(grpo))
