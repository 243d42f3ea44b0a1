"""Pure parts of the vllm strategy: request building, output parsing, reload guards (no vLLM)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from strategies.vllm import worker_ext as ext
from strategies.vllm.requests import (
    parse_request_outputs,
    request_seed,
    sampling_kwargs,
    unpadded_rows,
)
from strategies.vllm.strategy import CPU_KV_CACHE_BYTES, WORKER_EXTENSION, llm_kwargs

# --------------------------------------------------------------------------------------------
# fakes shaped like vLLM's RequestOutput / CompletionOutput / Logprob


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str = "length"
    stop_reason: int | None = None


@dataclass
class Request:
    outputs: list[Completion] = field(default_factory=list)


def completion(index: int, ids: list[int], **kw) -> Completion:
    return Completion(index, ids, [{t: Logprob(-0.5 * t)} for t in ids], **kw)


def sampling(**overrides):
    args = dict(n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, seed=None)
    return sampling_kwargs(**{**args, **overrides})


# --------------------------------------------------------------------------------------------
# sampling parameters


def test_sampling_kwargs_ask_for_the_sampled_tokens_logprob_only():
    kw = sampling(n=4, max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=5, seed=3,
                  stop_token_ids=(2,))  # fmt: skip
    assert kw == {
        "n": 4, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3,
        "stop_token_ids": [2], "ignore_eos": False, "logprobs": 0, "detokenize": False,
    }  # fmt: skip


def test_sampling_kwargs_list_every_invalid_value():
    with pytest.raises(ValueError) as err:
        sampling(n=0, max_new_tokens=0, temperature=-1.0, top_p=0.0, top_k=-2)
    for name in ("num_return_sequences", "max_new_tokens", "temperature", "top_p", "top_k"):
        assert name in str(err.value)


def test_request_seeds_are_deterministic_distinct_and_optional():
    seeds = [request_seed(42, i) for i in range(1000)]
    assert seeds == [request_seed(42, i) for i in range(1000)]
    assert all(0 <= s < 2**31 for s in seeds)
    # vLLM seeds sample j with seed + j: no two (prompt, sample) pairs of a batch share a seed
    per_sample = {s + j for s in seeds for j in range(16)}
    assert len(per_sample) == 16 * 1000
    assert request_seed(43, 0) not in seeds[:16]
    assert request_seed(None, 5) is None


# --------------------------------------------------------------------------------------------
# output parsing


def test_outputs_flatten_prompt_major_in_sample_order():
    outputs = [
        Request([completion(1, [4, 5]), completion(0, [7], finish_reason="stop", stop_reason=7)]),
        Request([completion(0, [1, 2, 3]), completion(1, [9])]),
    ]
    got = parse_request_outputs(outputs, n=2)
    assert got["prompt_index"] == [0, 0, 1, 1]
    assert got["sample_index"] == [0, 1, 0, 1]
    assert got["response_ids"] == [[7], [4, 5], [1, 2, 3], [9]]
    assert got["logprobs"] == [[-3.5], [-2.0, -2.5], [-0.5, -1.0, -1.5], [-4.5]]
    assert got["finish_reason"] == ["stop", "length", "length", "length"]
    assert got["stop_reason"] == [7, None, None, None]


def test_outputs_pick_the_sampled_token_among_top_logprobs():
    position = {3: Logprob(-0.1, rank=1), 8: Logprob(-2.0, rank=4)}
    got = parse_request_outputs([Request([Completion(0, [8], [position])])], n=1)
    assert got["logprobs"] == [[-2.0]]


def test_outputs_with_missing_samples_or_logprobs_fail():
    with pytest.raises(ValueError, match="expected n=2"):
        parse_request_outputs([Request([completion(0, [1])])], n=2)
    with pytest.raises(ValueError, match="logprobs=0"):
        parse_request_outputs([Request([Completion(0, [1], None)])], n=1)
    with pytest.raises(ValueError, match="positions"):
        parse_request_outputs([Request([Completion(0, [1, 2], [{1: Logprob(0.0)}])])], n=1)


def test_unpadded_rows_strip_left_and_right_padding():
    torch = pytest.importorskip("torch")
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    assert unpadded_rows(ids, mask) == [[5, 6], [7, 8, 9], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="holes"):
        unpadded_rows(ids[:1], torch.tensor([[1, 0, 1, 1]]))


# --------------------------------------------------------------------------------------------
# engine arguments


def engine_args(strategy_config=None, is_cuda=False):
    return llm_kwargs(model_path="/m", dtype="bf16", seed=1, tensor_parallel_size=2,
                      strategy_config=strategy_config, is_cuda=is_cuda)  # fmt: skip


def test_llm_kwargs_cpu_defaults():
    kw = engine_args()
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16" and kw["seed"] == 1
    assert kw["tensor_parallel_size"] == 2
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["skip_tokenizer_init"] is True
    assert kw["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert kw["worker_extension_cls"] == WORKER_EXTENSION
    assert "enable_sleep_mode" not in kw


def test_llm_kwargs_gpu_and_user_overrides():
    kw = engine_args({"gpu_memory_utilization": 0.5, "skip_tokenizer_init": False}, is_cuda=True)
    assert kw["enable_sleep_mode"] is True
    assert kw["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in kw
    assert kw["skip_tokenizer_init"] is False
    assert "kv_cache_memory_bytes" not in engine_args({"gpu_memory_utilization": 0.3})


def test_llm_kwargs_reject_keys_the_strategy_owns():
    with pytest.raises(ValueError) as err:
        engine_args({"dtype": "float16", "tensor_parallel_size": 4})
    assert "model_args.dtype" in str(err.value) and "num_gpus_per_worker" in str(err.value)
    with pytest.raises(ValueError, match="unknown dtype"):
        llm_kwargs(model_path="/m", dtype="int8", seed=0, tensor_parallel_size=1,
                   strategy_config=None, is_cuda=False)  # fmt: skip


def test_llm_kwargs_max_model_len_is_derived_unless_strategy_config_sets_it():
    def engine_len(strategy_config, derived):
        kw = llm_kwargs(
            model_path="/m",
            dtype="fp32",
            seed=0,
            tensor_parallel_size=1,
            strategy_config=strategy_config,
            is_cuda=False,
            max_model_len=derived,
        )
        return kw.get("max_model_len", "vLLM's default")

    assert engine_len(None, 192) == 192
    assert engine_len({"max_model_len": None}, 192) == 192  # null in the YAML: derived
    assert engine_len({"max_model_len": 512}, 192) == 512  # the user's value wins
    assert engine_len({"max_model_len": None}, None) == "vLLM's default"  # e.g. a judge role


def test_llm_kwargs_warn_when_rollout_logprobs_leave_the_sampling_distribution():
    with pytest.warns(UserWarning, match="softmax\\(logits / temperature\\)"):
        assert engine_args({"logprobs_mode": "raw_logprobs"})["logprobs_mode"] == "raw_logprobs"


def test_worker_extension_path_resolves():
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert module == ext.__name__ and hasattr(ext, name)


# --------------------------------------------------------------------------------------------
# reload guards (run inside vLLM's worker)


def names(pairs):
    return [name for name, _ in pairs]


def test_tied_embedding_is_also_sent_as_lm_head():
    emb = object()
    got = list(ext.with_tied_lm_head([(ext.EMBED_NAME, emb), ("model.norm.weight", 1)], True))
    assert names(got) == [ext.EMBED_NAME, ext.LM_HEAD_NAME, "model.norm.weight"]
    assert got[1][1] is emb


def test_lm_head_is_loaded_once_whoever_sends_it():
    sent_after = [(ext.EMBED_NAME, 0), ("x", 1), (ext.LM_HEAD_NAME, 0)]
    assert names(ext.with_tied_lm_head(sent_after, True)) == [ext.EMBED_NAME, ext.LM_HEAD_NAME, "x"]
    sent_before = [(ext.LM_HEAD_NAME, 0), (ext.EMBED_NAME, 0)]
    assert names(ext.with_tied_lm_head(sent_before, True)) == [ext.LM_HEAD_NAME, ext.EMBED_NAME]


def test_untied_models_pass_through_unchanged():
    pairs = [(ext.EMBED_NAME, 0), (ext.LM_HEAD_NAME, 1)]
    assert list(ext.with_tied_lm_head(pairs, False)) == pairs
    assert names(ext.with_tied_lm_head([(ext.EMBED_NAME, 0)], False)) == [ext.EMBED_NAME]


def test_load_failures_ignore_parameterless_layers():
    messages = [
        "RotaryEmbedding: Failed to load weights",
        "ParallelLMHead: Failed to load weights",
        "Following weights were not loaded from checkpoint: {'model.norm.weight'}",
        "Allocating 1.0 MB of device memory to buffers to load ['A', 'B'] layers.",
    ]
    owners = {"ParallelLMHead", "RMSNorm"}
    assert ext.load_failures(messages, owners) == messages[1:3]


def test_load_warnings_are_captured_even_when_vllm_logs_only_errors():
    parent = logging.getLogger("vllm")
    child = logging.getLogger(ext.RELOAD_LOGGER + ".reload.layerwise")
    old = parent.level
    parent.setLevel(logging.ERROR)
    try:
        with ext.captured_load_warnings() as messages:
            child.warning("%s: Failed to load weights", "ParallelLMHead")
            child.info("Reloading weights inplace...")
        assert messages == ["ParallelLMHead: Failed to load weights"]
        assert logging.getLogger(ext.RELOAD_LOGGER).level == logging.NOTSET  # restored
    finally:
        parent.setLevel(old)


def test_parameter_owners_names_classes_holding_parameters():
    torch = pytest.importorskip("torch")

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(2))

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Rotary())
    assert ext.parameter_owners(model) == {"Linear"}


# --------------------------------------------------------------------------------------------
# construction from a composed role config (no engine is started)


def test_from_worker_config_flattens_an_omegaconf_role(monkeypatch):
    from omegaconf import OmegaConf

    from roll_ds.config.schema import WorkerConfig
    from roll_ds.strategy import StrategyContext
    from strategies.vllm import VllmStrategy

    monkeypatch.setenv("ROLL_DS_DEVICE", "cpu")
    from roll_ds.platform import current_platform

    current_platform.cache_clear()
    try:
        role = OmegaConf.structured(WorkerConfig)
        role.num_gpus_per_worker = 2
        role.model_args.dtype = "bf16"
        role.strategy_args.strategy_config = {"enforce_eager": True}
        role.generating_args.temperature = 0.6
        ctx = StrategyContext(
            pretrain="/models/x",
            seed=5,
            max_steps=1,
            response_length=32,
            stop_token_ids=(2,),
            max_sequence_length=160,
        )
        strategy = VllmStrategy.from_worker_config(role, ctx)
    finally:
        current_platform.cache_clear()
    assert strategy.model_path == "/models/x" and strategy.dtype == "bf16"
    assert strategy.tensor_parallel_size == 2  # the worker's devices (CPU slots here): TP size
    assert strategy.strategy_config == {"enforce_eager": True}
    assert type(strategy.strategy_config) is dict
    assert strategy.generating_args.max_new_tokens == 32  # null -> response_length
    assert strategy.generating_args.temperature == 0.6
    assert role.generating_args.max_new_tokens is None  # the config is not modified
    assert strategy.stop_token_ids == [2]
    assert strategy.default_max_model_len == 160  # the engine's, unless strategy_config sets one


def test_registry_resolves_vllm_to_a_generate_strategy():
    from roll_ds.strategy import STRATEGIES, GenerateStrategy

    cls = STRATEGIES.get("vllm")
    assert cls.__name__ == "VllmStrategy"
    assert isinstance(cls(model_path="/m"), GenerateStrategy)


class _SeedRecordingStrategy:
    """Stands in for the vllm strategy: 'samples' each prompt's request seed."""

    def generate(self, prompts, *, seed, prompt_indices, **_):
        seeds = [request_seed(seed, index) for index in prompt_indices]
        return {
            "prompt_index": list(range(len(prompts))),
            "response_ids": [[s] for s in seeds],
            "logprobs": [[0.0] for _ in seeds],
            "finish_reason": ["stop"] * len(seeds),
        }


def test_prompt_seeds_do_not_depend_on_the_split_over_rollout_workers():
    from roll_ds.distributed.batch import Batch
    from roll_ds.distributed.dispatch import Dispatch, dispatch_spec, split_call
    from roll_ds.pipeline.workers import RolloutWorker

    worker = RolloutWorker.__new__(RolloutWorker)
    worker.strategy = _SeedRecordingStrategy()
    batch = Batch(non_tensors={"prompt_ids": [[1, 2]] * 7, "row": range(7)})
    spec = dispatch_spec(RolloutWorker, "generate")
    assert spec.mode is Dispatch.DP
    seeds_by_split = {}
    for world_size in (1, 2, 3):
        calls = split_call(spec, world_size, (batch,), {"seed": 11})
        out = Batch.concat([worker.generate(*args, **kwargs) for _, args, kwargs in calls])
        seeds_by_split[world_size] = [ids[0] for ids in out["response_ids"]]
    assert seeds_by_split[1] == seeds_by_split[2] == seeds_by_split[3]
    assert len(set(seeds_by_split[1])) == 7


@dataclass
class Span:
    """vLLM's WeightVersionSpan: output tokens [start, end) sampled by weights ``version``."""

    version: str
    start: int
    end: int


def test_token_versions_come_from_vllm_weight_version_spans():
    from strategies.vllm.requests import token_versions

    assert token_versions([Span("3", 0, 2), Span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert token_versions([Span("default", 0, 1), Span("0", 1, 3)], 3) == [-1, 0, 0]
    assert token_versions(None, 2) == [-1, -1]  # no label reported


def test_outputs_carry_token_versions_on_request():
    sample = completion(0, [1, 2, 3])
    sample.weight_versions = [Span("1", 0, 1), Span("2", 1, 3)]
    got = parse_request_outputs([Request([sample])], n=1, with_versions=True)
    assert got["token_versions"] == [[1, 2, 2]]
    assert "token_versions" not in parse_request_outputs([Request([sample])], n=1)
