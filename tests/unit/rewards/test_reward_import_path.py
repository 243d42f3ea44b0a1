"""A reward function of the user's own, named ``module:Class`` in the config (no registry edit),
resolved by the same ``Registry.resolve`` as environments; a bad name is a clear error naming
the field."""

from __future__ import annotations

import textwrap

import pytest

from roll_ds.agentic.registry import ENVS, env_class
from roll_ds.config import ConfigError
from roll_ds.config.compose import load_config
from roll_ds.rewards.build import build_reward_fn, validate_reward_specs
from roll_ds.rewards.registry import REWARD_FNS

USER_MODULE = textwrap.dedent(
    """
    from roll_ds.agentic.env import Env, StepResult
    from roll_ds.rewards.base import RewardFn


    class EndsWith(RewardFn):
        name = "ends_with"

        def __init__(self, suffix: str = "!", correct_score: float = 1.0):
            super().__init__(correct_score=correct_score)
            self.suffix = suffix

        def score_one(self, response, ground_truth, prompt):
            ok = response.endswith(self.suffix)
            return (self.correct_score if ok else self.incorrect_score), {"correct": ok}


    class NotAReward:
        pass


    class Echo(Env):
        def reset(self, seed):
            return "say hi"

        def step(self, action):
            return StepResult("", reward=float(action == "hi"), done=True, info={})
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``user_rewards_41`` in a directory of the user's own, importable as from the launch
    directory."""
    (tmp_path / "user_rewards_41.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_41"


def test_a_reward_named_by_import_path_builds_and_scores(user_module):
    fn = build_reward_fn({"name": f"{user_module}:EndsWith", "suffix": "?"})
    assert fn([("why?", ""), ("no", "")]).scores == [1.0, 0.0]
    assert validate_reward_specs([{"name": f"{user_module}:EndsWith", "suffix": "?"}]) == []


def test_environments_and_rewards_share_one_resolver(user_module):
    path = f"{user_module}:Echo"
    assert env_class(path) is ENVS.resolve(path) is REWARD_FNS.resolve(path)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("no_such_module_41:R", "cannot import module 'no_such_module_41' of 'no_such_mod"),
        ("{mod}:Missing", "module '{mod}' has no 'Missing'"),
        ("{mod}:NotAReward", "is not a reward function"),
        ("ends_wth", "unknown reward function 'ends_wth'; valid: "),
    ],
)
def test_a_bad_reward_name_names_the_field(user_module, name, expected):
    (problem,) = validate_reward_specs([{"name": name.format(mod=user_module)}])
    assert problem.startswith("reward_fns[0]: ")
    assert expected.format(mod=user_module) in problem
    if ":" not in name:
        assert "or an import path module:Class" in problem


def test_unknown_parameters_of_an_own_reward_are_refused(user_module):
    (problem,) = validate_reward_specs([{"name": f"{user_module}:EndsWith", "sufix": "?"}])
    assert "unknown parameter(s) sufix" in problem and "suffix" in problem


def test_a_config_names_an_own_reward(user_module):
    spec = f'rewards.math.reward_fns=[{{name: "{user_module}:EndsWith", weight: 1.0}}]'
    cfg = load_config("rlvr_lora_zero3", [spec], check_files=False)
    assert cfg.rewards["math"].reward_fns[0]["name"] == f"{user_module}:EndsWith"
    with pytest.raises(ConfigError) as info:
        load_config("rlvr_lora_zero3", [spec.replace("EndsWith", "Nope")], check_files=False)
    (problem,) = info.value.problems
    assert problem.startswith(f"rewards.math.reward_fns[0]: module '{user_module}' has no 'Nope'")
