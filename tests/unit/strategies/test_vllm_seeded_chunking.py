"""Chunked prefill vs seeded sampling on CPU (issue 19): the engine kwargs turn chunked prefill
off on CPU, and settings that would still split a prompt over steps are refused at validation
(``device: cpu``) and at engine start (any CPU engine), never left to crash the first generate
with ``CPU Generator does not use offset``."""

from __future__ import annotations

import pytest

from roll_ds.config import ConfigError, load_config
from strategies.vllm.start import CHUNKING_CRASH, seeded_chunking_problem
from strategies.vllm.strategy import llm_kwargs


def engine_kwargs(user=None, *, is_cuda=False):
    return llm_kwargs(model_path="/m", dtype="fp32", seed=0, tensor_parallel_size=1,
                      strategy_config=user, is_cuda=is_cuda)  # fmt: skip


def test_cpu_engines_start_without_chunked_prefill():
    assert engine_kwargs()["enable_chunked_prefill"] is False
    # the step budget stays vLLM's (it raises it to max_model_len itself when that is longer)
    assert "max_num_batched_tokens" not in engine_kwargs({"max_model_len": 96})


def test_gpu_engines_keep_vllms_default():
    # CUDA generators can be rewound: chunked prefill stays as vLLM sets it
    assert "enable_chunked_prefill" not in engine_kwargs(is_cuda=True)
    assert engine_kwargs({"enable_chunked_prefill": True}, is_cuda=True)["enable_chunked_prefill"]


def test_the_user_may_set_safe_values():
    assert engine_kwargs({"enable_chunked_prefill": False})["enable_chunked_prefill"] is False
    # chunked prefill with a budget that holds max_num_seqs whole sequences never splits one
    safe = {"enable_chunked_prefill": True, "max_num_seqs": 128, "max_model_len": 96,
            "max_num_batched_tokens": 128 * 96}  # fmt: skip
    assert engine_kwargs(safe)["enable_chunked_prefill"] is True
    # the user's workaround (a larger budget) is kept, with chunked prefill off
    got = engine_kwargs({"max_num_batched_tokens": 16384})
    assert (got["max_num_batched_tokens"], got["enable_chunked_prefill"]) == (16384, False)


@pytest.mark.parametrize(
    ("user", "names"),
    [
        ({"enable_chunked_prefill": True}, "all three set"),
        (
            {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "max_num_seqs": 256,
             "max_model_len": 96},
            "max_num_seqs x max_model_len = 256 x 96 = 24576",
        ),
        ({"long_prefill_token_threshold": 32}, "long_prefill_token_threshold: 32"),
    ],
)  # fmt: skip
def test_settings_that_split_prompts_fail_at_engine_start(user, names):
    with pytest.raises(ValueError) as err:
        engine_kwargs(user)
    assert names in str(err.value) and CHUNKING_CRASH in str(err.value)
    assert seeded_chunking_problem(user, "f") is not None
    engine_kwargs(user, is_cuda=True)  # on CUDA they are fine


def test_validation_refuses_them_on_a_cpu_cluster():
    field = "actor_infer.strategy_args.strategy_config"
    split = [f"+{field}.enable_chunked_prefill=true", f"+{field}.max_num_batched_tokens=4096"]
    with pytest.raises(ConfigError) as err:
        load_config("rlvr_lora_zero3", ["device=cpu", *split], check_files=False)
    (problem,) = err.value.problems
    assert problem.startswith(f"{field}.enable_chunked_prefill: true")
    assert "remove enable_chunked_prefill" in problem
    # device auto joining a cluster: its resources decide at launch (a local Ray's device is
    # known in validation: tests/unit/config/test_device_auto.py)
    joined = ["device=auto", "ray.address=ray://head:10001"]
    load_config("rlvr_lora_zero3", [*joined, *split], check_files=False)
    # a budget that holds a full step of sequences passes
    load_config(
        "rlvr_lora_zero3",
        ["device=cpu", f"+{field}.enable_chunked_prefill=true", f"+{field}.max_num_seqs=8",
         f"{field}.max_model_len=256", f"+{field}.max_num_batched_tokens=2048"],
        check_files=False,
    )  # fmt: skip
