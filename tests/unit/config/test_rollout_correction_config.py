"""``algorithm.rollout_correction`` and its bounds are checked before anything starts."""

import pytest
from _config_problems import problems as config_problems

from roll_ds.config import load_config


def problems(*overrides: str) -> list[str]:
    return config_problems(*overrides, config="rlvr_lora_zero3")


def test_unknown_correction_names_the_field_and_the_valid_names():
    assert problems("algorithm.rollout_correction=tis") == [
        "algorithm.rollout_correction: 'tis' is not one of null, geo_mask, icepop, seq_tis, "
        "token_tis"
    ]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "algorithm.correction_low=1.0",
            "algorithm.correction_low: must be in (0, 1) (or null: the rollout correction's "
            "default), got 1.0",
        ),
        (
            "algorithm.correction_low=0",
            "algorithm.correction_low: must be in (0, 1) (or null: the rollout correction's "
            "default), got 0.0",
        ),
        (
            "algorithm.correction_high=0.9",
            "algorithm.correction_high: must be > 1 (or null: the rollout correction's "
            "default), got 0.9",
        ),
    ],
)
def test_bounds_must_straddle_1(override, expected):
    assert problems("algorithm.rollout_correction=icepop", override) == [expected]


@pytest.mark.parametrize("name", ["token_tis", "seq_tis", "icepop", "geo_mask"])
def test_each_correction_loads_into_the_policy_loss(name):
    from roll_ds.pipeline.loss_fns import PolicyLoss

    cfg = load_config(
        "rlvr_lora_zero3",
        [
            f"algorithm.rollout_correction={name}",
            "algorithm.correction_low=0.8",
            "algorithm.correction_high=1.25",
        ],
        check_files=False,
    )
    loss_fn = PolicyLoss.from_config(cfg.algorithm, cfg.response_length)
    assert loss_fn.correction == name
    assert (loss_fn.correction_low, loss_fn.correction_high) == (0.8, 1.25)


def test_tis_cap_alone_selects_token_tis():
    from roll_ds.pipeline.loss_fns import PolicyLoss

    cfg = load_config("rlvr_lora_zero3", ["algorithm.tis_cap=3"], check_files=False)
    loss_fn = PolicyLoss.from_config(cfg.algorithm, cfg.response_length)
    assert (loss_fn.correction, loss_fn.tis_cap) == ("token_tis", 3.0)
    default = load_config("rlvr_lora_zero3", [], check_files=False)
    assert PolicyLoss.from_config(default.algorithm, default.response_length).correction is None
