"""``max_tokens_per_micro_batch`` / ``use_sequence_packing`` refused where they cannot work,
each with the field and the fix, before any actor starts."""

from _config_problems import problems as config_problems

from roll_ds.config import load_config
from roll_ds.config.checks import micro_batches

CONFIG = "rlvr_full_zero3"  # has a reference role


def problems(*overrides: str) -> list[str]:
    return config_problems(*overrides, config=CONFIG)


def test_budget_and_packing_accepted_on_the_torch_roles():
    cfg = load_config(CONFIG, [], check_files=False)
    longest = cfg.prompt_length + cfg.response_length
    cfg = load_config(
        CONFIG,
        [
            f"actor_train.max_tokens_per_micro_batch={longest}",
            "actor_train.use_sequence_packing=true",
            f"reference.max_tokens_per_micro_batch={4 * longest}",
            "reference.use_sequence_packing=true",
        ],
        check_files=False,
    )
    assert cfg.actor_train.max_tokens_per_micro_batch == longest
    assert cfg.reference.use_sequence_packing


def test_budget_below_the_longest_sequence():
    cfg = load_config(CONFIG, [], check_files=False)
    longest = cfg.prompt_length + cfg.response_length
    [msg] = problems(f"actor_train.max_tokens_per_micro_batch={longest - 1}")
    assert msg.startswith("actor_train.max_tokens_per_micro_batch: ")
    assert f"prompt_length {cfg.prompt_length} + response_length" in msg
    assert f"at least {longest}" in msg and "null" in msg


def test_budget_below_one():
    found = problems("reference.max_tokens_per_micro_batch=0")
    assert any(p.startswith("reference.max_tokens_per_micro_batch") for p in found), found


def test_roles_that_do_not_read_them():
    found = problems(
        "actor_infer.max_tokens_per_micro_batch=100000", "actor_infer.use_sequence_packing=true"
    )
    assert len(found) == 2, found
    assert all("only actor_train, reference, critic read it" in p for p in found)
    assert all(p.endswith("remove it") for p in found)
    assert found[0].startswith("actor_infer.max_tokens_per_micro_batch")
    assert found[1].startswith("actor_infer.use_sequence_packing")


def test_strategies_that_do_not_read_them(monkeypatch):
    import dataclasses

    from roll_ds.config import strategies

    spec = dataclasses.replace(strategies.STRATEGY_SPECS["hf_infer"], token_micro_batches=False)
    monkeypatch.setitem(strategies.STRATEGY_SPECS, "hf_infer", spec)
    [msg] = problems("reference.use_sequence_packing=true")
    assert msg.startswith("reference.use_sequence_packing: strategy 'hf_infer' does not read it")


def test_packing_needs_an_attention_that_keeps_sequences_apart(monkeypatch):
    monkeypatch.setattr(micro_batches, "PACKING_ATTENTION", (None, "eager", "fa2"))
    [msg] = problems(
        "actor_train.use_sequence_packing=true", "actor_train.model_args.attn_implementation=sdpa"
    )
    assert msg.startswith("actor_train.use_sequence_packing: attention implementation 'sdpa'")
    assert "actor_train.model_args.attn_implementation" in msg
    assert "use_sequence_packing: false" in msg


def test_packing_through_a_dense_mask_is_warned_about_with_the_fix():
    from roll_ds.config.validate import validate

    cfg = load_config(CONFIG, ["reference.use_sequence_packing=true"], check_files=False)
    [msg] = validate(cfg, check_files=False)
    assert msg.startswith("reference.use_sequence_packing with attn_implementation null (sdpa)")
    assert micro_batches.PACKING_DENSE_MASK in msg
    assert "reference.model_args.attn_implementation: fa2" in msg
    assert "use_sequence_packing: false" in msg
    fa2 = load_config(
        CONFIG,
        [
            "reference.use_sequence_packing=true",
            "reference.model_args.attn_implementation=fa2",
            "reference.model_args.dtype=bf16",  # flash-attn has no fp32 kernels
        ],
        check_files=False,
    )
    assert validate(fa2, check_files=False) == []
