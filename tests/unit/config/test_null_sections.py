"""Overrides of sections that are null in the composed config (``roll_ds/config/null_sections.py``),
through the entry points users use: ``compose_config`` / ``load_config`` and ``run.py``.

Before the guard, a key inside a null section (``+rewards.math.judge.template=...``) ended in
OmegaConf's ``AssertionError: Unexpected type for root: NoneType`` traceback, and setting the
section whole (``rewards.math.judge={...}``) in ``AttributeError: 'NoneType' object has no
attribute 'get'``."""

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from roll_ds.config.compose import PROJECT_ROOT, compose_config
from roll_ds.config.hints import hint_for_exception
from roll_ds.config.validate import to_schema

CONFIG = "rlvr_lora_zero3"  # no judge, no reference: both null
TEMPLATE = '"Question: {question} Answer: {response}"'


def refusal(*overrides: str) -> ConfigCompositionException:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(CONFIG, list(overrides))
    return info.value


@pytest.mark.parametrize("prefix", ["+", "++", ""])
def test_a_key_inside_a_null_section_names_the_section_and_the_override_to_use(prefix):
    override = f"{prefix}rewards.math.judge.template={TEMPLATE}"
    assert str(refusal(override)) == (
        f"{override}: rewards.math.judge is null in this config, so there is no "
        "rewards.math.judge.template to set; set rewards.math.judge whole instead: "
        f"'rewards.math.judge={{template: {TEMPLATE}}}' (the keys left out take their defaults), "
        "or set rewards.math.judge in your YAML"
    )


def test_a_deeper_key_gets_the_nested_whole_section_override():
    message = str(refusal("reference.model_args.dtype=bf16"))
    assert "reference is null in this config, so there is no reference.model_args.dtype" in message
    assert "'reference={model_args: {dtype: bf16}}'" in message


def test_the_suggested_whole_section_override_sets_it_and_keeps_the_rest():
    cfg = to_schema(compose_config(CONFIG, [f"rewards.math.judge={{template: {TEMPLATE}}}"]))
    judge = cfg.rewards["math"].judge
    assert judge.template == "Question: {question} Answer: {response}"
    assert judge.unparsed_score == 0.0  # a schema default
    assert cfg.rewards["math"].reward_fns == [{"name": "math_rule", "weight": 1.0}]
    assert sorted(cfg.rewards) == ["math", "reverse"]
    reference = "reference={model_args: {dtype: bf16}, strategy_args: {strategy_name: hf_infer}}"
    cfg = to_schema(compose_config(CONFIG, [reference]))
    assert cfg.reference.model_args.dtype == "bf16"
    assert cfg.reference.infer_batch_size == 8  # a schema default


def test_a_misspelled_key_of_a_whole_section_gets_the_schema_hint():
    hint = hint_for_exception(refusal("rewards.math.judge={templat: x}"))
    assert hint.startswith(
        "rewards.math.judge.templat: JudgeConfig has no key 'templat'; did you mean "
        "rewards.math.judge.template?"
    )


def test_overrides_of_sections_that_are_set_are_untouched():
    cfg = compose_config(
        "rlvr_full_zero3",
        [
            "reference.model_args.dtype=bf16",
            "seed=3",
            "+actor_infer.strategy_args.strategy_config.gpu_memory_utilization=0.5",  # a new key
        ],
    )
    assert (cfg.reference.model_args.dtype, cfg.seed) == ("bf16", 3)
    assert cfg.actor_infer.strategy_args.strategy_config.gpu_memory_utilization == 0.5


def test_run_py_says_which_section_to_set_without_a_traceback():
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "--config-name",
            CONFIG,
            "--cfg",
            "job",
            f"+rewards.math.judge.template={TEMPLATE}",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "AssertionError" not in result.stderr
    assert "rewards.math.judge is null in this config" in result.stderr
    assert f"'rewards.math.judge={{template: {TEMPLATE}}}'" in result.stderr
