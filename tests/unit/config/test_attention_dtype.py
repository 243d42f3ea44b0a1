"""flash-attn (``attn_implementation: fa2``, or transformers' ``flash_attention_2``) has no fp32
kernels: transformers only warns when it loads such a model and the first forward fails, after
every actor started. Validation refuses it for every role, naming the dtype to set."""

import pytest
from _config_problems import problems

from roll_ds.config import load_config
from roll_ds.config.checks import micro_batches
from roll_ds.config.validate import validate


def refusal(role: str, attn: str) -> str:
    return (
        f"{role}.model_args.dtype: fp32 with attn_implementation {attn}: flash-attn has no fp32 "
        f"kernels and the first forward would fail; set {role}.model_args.dtype: bf16 (or "
        f"fp16), or another {role}.model_args.attn_implementation (sdpa, eager, or null)"
    )


@pytest.mark.parametrize("attn", ["fa2", "flash_attention_2"])
def test_flash_attention_in_fp32_is_refused_for_every_role(attn):
    # rlvr_full_zero3: a trainer, a rollout engine and a reference, all in the default fp32
    roles = ("actor_train", "actor_infer", "reference")
    found = problems(
        *[f"{role}.model_args.attn_implementation={attn}" for role in roles],
        config="rlvr_full_zero3",
    )
    assert found == [refusal(role, attn) for role in roles]
    # a reward model's role too
    found = problems("rewards.math.model_args.attn_implementation=fa2", config="rlvr_lora_zero3_rm")
    assert found == [refusal("rewards.math", "fa2")]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_flash_attention_in_a_half_dtype_validates(dtype):
    cfg = load_config(
        "rlvr_full_zero3",
        [
            "reference.model_args.attn_implementation=flash_attention_2",
            f"reference.model_args.dtype={dtype}",
        ],
        check_files=False,
    )
    assert cfg.reference.model_args.attn_implementation == "flash_attention_2"


def test_packing_recommends_fa2_with_the_dtype_it_needs():
    cfg = load_config("rlvr_full_zero3", ["reference.use_sequence_packing=true"], check_files=False)
    [msg] = validate(cfg, check_files=False)
    assert micro_batches.PACKING_DENSE_MASK in msg
    assert (
        "set reference.model_args.attn_implementation: fa2 (flash-attn, on GPUs) with "
        "reference.model_args.dtype: bf16 or fp16 (flash-attn has no fp32 kernels; the role's "
        "is fp32), or use_sequence_packing: false"
    ) in msg
