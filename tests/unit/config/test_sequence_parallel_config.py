"""``sequence_parallel_size`` refused where Ulysses cannot run, each with the field and the
fix, before any actor starts (``strategies/deepspeed/sequence_parallel_checks.py``)."""

import json

from _config_problems import problems as config_problems

from roll_ds.config import load_config
from strategies.deepspeed.sequence_parallel_checks import (
    head_problems,
    model_config,
    sequence_parallel_problems,
)

CONFIG = "rlvr_full_zero3"  # actor_train: deepspeed_train on 2 ranks; reference: hf_infer on 1


def problems(*overrides: str) -> list[str]:
    return config_problems(*overrides, config=CONFIG)


def test_default_is_off_and_two_ranks_accepted():
    cfg = load_config(CONFIG, [], check_files=False)
    assert cfg.actor_train.sequence_parallel_size == 1
    cfg = load_config(CONFIG, ["actor_train.sequence_parallel_size=2"], check_files=False)
    assert cfg.actor_train.sequence_parallel_size == 2
    # the embedded model's 4 attention and 2 key-value heads take 2
    assert sequence_parallel_problems(cfg, check_files=True) == []


def test_below_one():
    found = problems("actor_train.sequence_parallel_size=0")
    assert any(p.startswith("actor_train.sequence_parallel_size") for p in found), found


def test_world_size_not_divided():
    [msg] = problems("actor_train.sequence_parallel_size=3")
    assert msg.startswith("actor_train.sequence_parallel_size: 3 does not divide the role's world")
    assert "world size 2" in msg and "device_mapping" in msg


def test_strategy_without_sequence_parallelism():
    [msg] = problems("reference.sequence_parallel_size=2")
    assert msg.startswith("reference.sequence_parallel_size: 2, but strategy 'hf_infer'")
    assert "deepspeed_train, deepspeed_infer" in msg and "sequence_parallel_size: 1" in msg


def test_roles_that_do_not_split():
    found = problems("actor_infer.sequence_parallel_size=2")
    assert any(
        p.startswith("actor_infer.sequence_parallel_size: 2, but only actor_train and reference")
        for p in found
    ), found


def test_eager_attention_refused():
    found = problems(
        "actor_train.sequence_parallel_size=2", "actor_train.model_args.attn_implementation=eager"
    )
    assert any("attn_implementation: sdpa" in p and "eager" in p for p in found), found


def test_heads_not_divided(tmp_path):
    cfg = {"num_attention_heads": 12, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    [msg] = head_problems("actor_train", 4, model_config(str(tmp_path)))  # 4 divides 12, not 2
    assert msg.startswith("actor_train.sequence_parallel_size: 4 does not divide the model's ")
    assert "num_key_value_heads (2)" in msg and "divisor of 2" in msg
    # no num_key_value_heads: as many as attention heads (transformers' default)
    assert head_problems("actor_train", 4, {"num_attention_heads": 12}) == []
    assert len(head_problems("actor_train", 5, {"num_attention_heads": 12})) == 2


def test_embedded_model_heads():
    config = model_config("embedded:tiny-qwen2")
    assert config is not None
    [msg] = head_problems("reference", 4, config)  # 4 attention heads, 2 key-value heads
    assert msg.startswith("reference.sequence_parallel_size: 4 does not divide the model's ")
    assert "num_key_value_heads (2)" in msg
    assert model_config("/no/such/model") is None
