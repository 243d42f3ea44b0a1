"""``deepspeed_train``: a DeepSpeed ZeRO (0-3) engine training an HF causal LM, optionally LoRA.

``head="value"`` (the critic role) trains a value model instead: the same body with a scalar
value head (``strategies._value_model``); it computes ``values_BT`` where the policy computes
``logprobs_BT``, and everything else (ZeRO, LoRA, optimizer, checkpoints) is shared.

Built from the role's composed ``strategy_config`` (a DeepSpeed JSON whose ``"auto"`` values
``roll_ds.config.deepspeed.build_deepspeed_config`` fills from the training args). The optimizer
is AdamW: DeepSpeed's own when the config has an ``optimizer`` section; otherwise FusedAdam on
GPUs, DeepSpeedCPUAdam when optimizer states are offloaded, and ``torch.optim.AdamW`` for
on-device states on CPU (nothing to JIT-compile). The LR schedule is linear warmup then
constant / linear / cosine decay over ``max_steps`` optimizer steps.

Every public method is collective: all ranks of the data-parallel group call it together, with
the same number of micro batches.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from roll_ds.algorithms.aggregation import MiniBatchNorm
from roll_ds.checkpoint import load_rng_state, save_rng_state
from roll_ds.config.deepspeed import (
    DeepSpeedInputs,
    build_deepspeed_config,
    offload_devices,
    zero_stage,
)
from roll_ds.config.schema import ModelArgs, TrainingArgs, WorkerConfig
from roll_ds.models.loading import apply_lora, load_causal_lm, resolve_model_path
from roll_ds.platform import current_platform
from strategies import _common
from strategies._value_model import apply_value_lora, forward_values, load_value_model
from strategies._weights import (
    adapter_config,
    iter_adapter_buckets,
    iter_weight_buckets,
    write_adapter,
    write_hf_model,
)
from strategies._zero import batched_forward, plain_strategy_config, release_zero3_params
from strategies.base import StrategyContext

logger = logging.getLogger(__name__)

LossFn = Callable[..., tuple[torch.Tensor, Mapping[str, float]]]
"""``loss_fn(logprobs_BT, micro_batch, entropy_BT[, norm=...]) -> (loss, metrics)``
(``values_BT`` in place of ``logprobs_BT`` for ``head="value"``); ``entropy_BT`` is None unless
``train_step(with_entropy=True)``. DeepSpeed divides each micro batch's loss by
``gradient_accumulation_steps`` and averages gradients over data-parallel ranks. A loss that
normalizes over the whole optimizer-step mini-batch (``roll_ds.pipeline.losses``) has a
``mini_batch_counts(micro_batch)`` method; it then gets ``norm=MiniBatchNorm(...)`` with the
mini-batch's counts (all-reduced over the ranks) and the factor that undoes that averaging. A
plain callable is called without ``norm`` (each micro batch normalized on its own)."""
HEADS = ("lm", "value")


class DeepSpeedTrainStrategy:
    def __init__(
        self,
        *,
        model_path: str,
        strategy_config: Mapping[str, Any],
        model_args: ModelArgs | None = None,
        training_args: TrainingArgs | None = None,
        seed: int = 42,
        max_steps: int = 1,
        infer_batch_size: int = 8,
        head: str = "lm",
        logprob_temperature: float = 1.0,
    ) -> None:
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; valid: {', '.join(HEADS)}")
        self.head = head
        self.logprob_temperature = _common.check_temperature(logprob_temperature)
        self.model_path = model_path
        self.strategy_config = plain_strategy_config(strategy_config)
        self.model_args = model_args or ModelArgs()
        self.training_args = training_args or TrainingArgs()
        self.seed = seed
        self.max_steps = max_steps
        self.infer_batch_size = infer_batch_size
        self.engine: Any = None
        self.ds_config: dict[str, Any] = {}
        self._offloaded = False

    @classmethod
    def from_worker_config(
        cls, worker: WorkerConfig, ctx: StrategyContext, *, head: str = "lm"
    ) -> DeepSpeedTrainStrategy:
        return cls(
            model_path=worker.model_args.model_name_or_path or ctx.pretrain,
            strategy_config=worker.strategy_args.strategy_config,
            model_args=worker.model_args,
            training_args=worker.training_args,
            seed=ctx.seed,
            max_steps=ctx.max_steps,
            infer_batch_size=worker.infer_batch_size,
            head=head,
            logprob_temperature=ctx.logprob_temperature,
        )

    # -----------------------------------------------------------------------------------------
    # setup

    @property
    def is_lora(self) -> bool:
        return self.model_args.lora_rank is not None

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (a peft model under LoRA)."""
        return self.engine.module

    def initialize(self) -> None:
        self.rank, self.world_size = _common.init_distributed()
        self.device = _common.device()
        _seed_everything(self.seed)
        self.model_path = resolve_model_path(self.model_path)
        self.ds_config = self._build_ds_config()
        self._build_engine(self._load_model())

    def _load_model(self) -> torch.nn.Module:
        args = self.model_args
        load, wrap = (
            (load_value_model, apply_value_lora)
            if self.head == "value"
            else (load_causal_lm, apply_lora)
        )
        model = load(
            self.model_path,
            dtype=args.dtype,
            attn_impl=args.attn_implementation,
            zero3_config=self.ds_config,
        )
        if not args.disable_gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if self.is_lora:
            model = wrap(
                model,
                rank=args.lora_rank,
                alpha=args.lora_alpha,
                dropout=args.lora_dropout,
                target=args.lora_target,
            )
        return model

    def _forward(
        self,
        model: Any,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
        temperature: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """``{"logprobs_BT"[, "entropy_BT"]}`` at ``temperature`` (None: the rollouts'), or
        ``{"values_BT"}`` for ``head="value"``."""
        if self.head == "value":
            if with_entropy:
                raise ValueError("a value model has no token distribution (with_entropy=True)")
            return {"values_BT": forward_values(model, input_ids_BT, attention_mask_BT)}
        return _common.forward_logprobs(
            model,
            input_ids_BT,
            attention_mask_BT,
            with_entropy=with_entropy,
            temperature=self.logprob_temperature if temperature is None else temperature,
        )

    def _require_head(self, head: str, what: str) -> None:
        if self.head != head:
            raise ValueError(f"{what} needs head={head!r}; this strategy has head={self.head!r}")

    def _build_ds_config(self) -> dict[str, Any]:
        from transformers import AutoConfig

        targs = self.training_args
        hf_config = AutoConfig.from_pretrained(self.model_path)
        source = dict(self.strategy_config)
        if "optimizer" in source:  # DeepSpeed builds it; its "auto" params come from training_args
            source["optimizer"] = _fill_optimizer_auto(source["optimizer"], targs)
        cfg = build_deepspeed_config(
            source,
            DeepSpeedInputs(
                micro_batch_size=targs.per_device_train_batch_size,
                gradient_accumulation_steps=targs.gradient_accumulation_steps,
                dp_size=self.world_size,
                max_grad_norm=targs.max_grad_norm,
                dtype=self.model_args.dtype,
                hidden_size=getattr(hf_config, "hidden_size", None),
            ),
        )
        if (cfg.get("fp16") or {}).get("enabled") and not current_platform().is_cuda:
            raise ValueError(
                "fp16 training needs a CUDA device (DeepSpeed's CPU accelerator has no fp16); "
                "set model_args.dtype: bf16 or fp32"
            )
        cfg.setdefault("zero_allow_untested_optimizer", True)
        cfg.setdefault("steps_per_print", 10**9)
        return cfg

    def _build_engine(self, model: torch.nn.Module) -> None:
        import deepspeed

        targs = self.training_args
        params = [p for p in model.parameters() if p.requires_grad]
        scheduler = _scheduler_factory(
            warmup_steps=targs.warmup_steps,
            total_steps=self.max_steps,
            kind=targs.lr_scheduler_type,
        )
        if "optimizer" in self.ds_config:
            optimizer = None
            model_parameters = _param_groups(params, targs.weight_decay)
        else:
            optimizer = self._build_optimizer(params)
            model_parameters = None
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=scheduler,
            config=self.ds_config,
            dist_init_required=False,
        )

    def _build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        targs = self.training_args
        groups = _param_groups(params, targs.weight_decay)
        kwargs = dict(
            lr=targs.learning_rate,
            betas=(targs.adam_beta1, targs.adam_beta2),
            eps=targs.adam_epsilon,
            weight_decay=targs.weight_decay,
        )
        offloaded = "offload_optimizer" in offload_devices(self.ds_config)
        if offloaded:
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
            except Exception as exc:  # the JIT build can fail (no compiler)
                logger.warning("DeepSpeedCPUAdam unavailable (%s); using torch AdamW", exc)
                self.ds_config["zero_force_ds_cpu_optimizer"] = False
                return torch.optim.AdamW(groups, **kwargs)
        if current_platform().is_cuda:
            try:
                from deepspeed.ops.adam import FusedAdam

                return FusedAdam(groups, adam_w_mode=True, **kwargs)
            except Exception as exc:
                logger.warning("FusedAdam unavailable (%s); using torch AdamW(fused)", exc)
                return torch.optim.AdamW(groups, fused=True, **kwargs)
        return torch.optim.AdamW(groups, **kwargs)

    # -----------------------------------------------------------------------------------------
    # training

    def train_step(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
    ) -> dict[str, float]:
        """Run ``batch`` (this rank's share) as micro batches of ``per_device_train_batch_size``;
        DeepSpeed steps the optimizer every ``gradient_accumulation_steps`` micro batches, so a
        batch of ``k * micro * accumulation`` rows makes ``k`` optimizer steps."""
        micro = self.training_args.per_device_train_batch_size
        accum = self.training_args.gradient_accumulation_steps
        size = _common.batch_size_of(batch)
        if size % (micro * accum):
            raise ValueError(
                f"train_step: batch of {size} rows is not a multiple of "
                f"per_device_train_batch_size x gradient_accumulation_steps = {micro} x {accum}"
            )
        self.engine.train()
        sums: dict[str, float] = {}
        steps = 0
        grad_norms: list[float] = []
        lrs: list[float] = []
        chunks = _common.split_batch(batch, micro)
        norms = self._mini_batch_norms(chunks, loss_fn)
        output_key = "values_BT" if self.head == "value" else "logprobs_BT"
        for i, mb in enumerate(chunks):
            mb = _common.to_device(mb, self.device)
            out = self._forward(
                self.engine, mb["input_ids"], mb["attention_mask"], with_entropy=with_entropy
            )
            kwargs = {"norm": norms[i // accum]} if norms is not None else {}
            loss, metrics = loss_fn(out[output_key], mb, out.get("entropy_BT"), **kwargs)
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary:
                lrs.append(self.lr_scheduler.get_last_lr()[0])
            self.engine.backward(loss)
            # DeepSpeed reports no norm for fp32 ZeRO-0 without clipping: take it from the
            # gradients (already averaged over the ranks at the boundary) before the step.
            own_norm = _grad_norm(self.module) if boundary and self.zero_stage == 0 else None
            self.engine.step()
            _accumulate(sums, {"loss": loss.detach().float().item(), **metrics})
            if boundary:
                steps += 1
                norm = self.engine.get_global_grad_norm()
                norm = own_norm if norm is None else norm
                if norm is not None:
                    grad_norms.append(float(norm))
        result = {k: v / len(chunks) for k, v in sums.items()}
        result["optimizer_steps"] = float(steps)
        result["lr"] = lrs[-1]
        if grad_norms:
            result["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return result

    def _mini_batch_norms(
        self, chunks: list[dict[str, Any]], loss_fn: LossFn
    ) -> list[MiniBatchNorm] | None:
        """One ``MiniBatchNorm`` per optimizer step of ``chunks`` (``accumulation`` consecutive
        micro batches each): the counts of the whole mini-batch, summed over this rank's micro
        batches and all-reduced over the data-parallel ranks (one collective per train step).
        None for a loss without ``mini_batch_counts``."""
        counts_of = getattr(loss_fn, "mini_batch_counts", None)
        if counts_of is None:
            return None
        accum = self.training_args.gradient_accumulation_steps
        per_step = torch.stack(
            [
                torch.stack([counts_of(mb) for mb in chunks[k : k + accum]]).sum(0)
                for k in range(0, len(chunks), accum)
            ]
        ).to(torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            per_step = per_step.to(self.device)
            dist.all_reduce(per_step)
        scale = float(accum * self.world_size)
        return [
            MiniBatchNorm(tokens=tokens, sequences=sequences, scale=scale)
            for tokens, sequences in per_step.cpu().tolist()
        ]

    @property
    def global_step(self) -> int:
        return int(self.engine.global_steps)

    # -----------------------------------------------------------------------------------------
    # inference

    @torch.no_grad()
    def compute_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
        disable_adapter: bool = False,
        temperature: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs (``[B, T-1]``) of the current policy at ``temperature`` (None: the
        rollouts' ``logprob_temperature``); ``disable_adapter=True`` gives the LoRA base model's
        (the reference policy under LoRA) from the same engine."""
        self._require_head("lm", "compute_logprobs")
        if disable_adapter and not self.is_lora:
            raise ValueError("disable_adapter=True needs a LoRA model (model_args.lora_rank)")
        ctx = self.module.disable_adapter() if disable_adapter else contextlib.nullcontext()
        with ctx:
            return self._infer(
                functools.partial(
                    self._forward, self.engine, with_entropy=with_entropy, temperature=temperature
                ),
                input_ids_BT,
                attention_mask_BT,
                ("logprobs_BT", "entropy_BT") if with_entropy else ("logprobs_BT",),
            )

    @torch.no_grad()
    def compute_values(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``{"values_BT": [B, T-1]}`` of the value model (``head="value"``)."""
        self._require_head("value", "compute_values")
        return self._infer(
            functools.partial(self._forward, self.engine),
            input_ids_BT,
            attention_mask_BT,
            ("values_BT",),
        )

    def _infer(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        keys: tuple[str, ...],
    ) -> dict[str, torch.Tensor]:
        """``forward`` in eval mode over ``infer_batch_size`` chunks (``batched_forward``)."""
        was_training = self.engine.training
        self.engine.eval()
        try:
            return batched_forward(
                forward,
                input_ids_BT,
                attention_mask_BT,
                batch_size=self.infer_batch_size,
                device=self.device,
                lockstep=self.zero_stage == 3 and self.world_size > 1,
                empty_keys=keys,
            )
        finally:
            self.engine.train(was_training)
            release_zero3_params(self.engine)

    # -----------------------------------------------------------------------------------------
    # weights out

    def named_weights_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights under HF names in buckets of at most ``bucket_bytes`` (every rank gets
        every bucket); LoRA merged, a tied embedding also as ``lm_head.weight``."""
        self._require_head("lm", "weight sync")
        release_zero3_params(self.engine)
        return iter_weight_buckets(self.module, bucket_bytes)

    def adapter_buckets_for_sync(
        self, bucket_bytes: int
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The LoRA adapter alone (``weight_sync.lora_sync: adapter``), under the names peft
        saves it with, in buckets of at most ``bucket_bytes``: the rollout engine keeps the
        frozen base weights it loaded and serves base + adapter."""
        self._require_head("lm", "weight sync")
        if not self.is_lora:
            raise ValueError(
                "weight_sync.lora_sync=adapter needs a LoRA policy (actor_train.model_args."
                "lora_rank); use lora_sync=merged for full fine-tuning"
            )
        release_zero3_params(self.engine)
        return iter_adapter_buckets(self.module, bucket_bytes)

    def adapter_config(self) -> dict[str, Any]:
        """The policy's peft ``LoraConfig`` as ``adapter_config.json`` content."""
        return adapter_config(self.module)

    def export_hf(
        self,
        path: str,
        *,
        merged: bool = True,
        max_shard_bytes: int = 5 * 2**30,
    ) -> dict[str, str]:
        """Write an HF model directory plain transformers (and vLLM) load: config, safetensors
        (ZeRO-3 gathered), tokenizer files and generation config of the source model. Under LoRA
        also ``path/adapter`` (a peft adapter over the base model); ``merged=False`` then skips
        the full weights. Rank 0 writes; every rank joins the gathers."""
        written: dict[str, str] = {}
        is_writer = self.rank == 0
        if is_writer:
            os.makedirs(path, exist_ok=True)
        if self.is_lora:
            adapter_dir = os.path.join(path, "adapter")
            release_zero3_params(self.engine)
            write_adapter(self.module, adapter_dir, write=is_writer)
            written["adapter"] = adapter_dir
        if merged or not self.is_lora:
            release_zero3_params(self.engine)
            write_hf_model(
                self.module,
                path,
                source_dir=self.model_path,
                write=is_writer,
                max_shard_bytes=max_shard_bytes,
            )
            written["model"] = path
        _barrier()
        return written

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def save_checkpoint(self, path: str, tag: str) -> None:
        """DeepSpeed engine state (module, optimizer, LR scheduler) plus every rank's RNG states:
        loading it into a fresh strategy continues the run exactly."""
        self.engine.save_checkpoint(
            path,
            tag=tag,
            client_state={"roll_ds_global_step": self.global_step},
            exclude_frozen_parameters=self.is_lora,
        )
        # JSON, fsynced: the driver fsyncs the whole checkpoint again before marking it complete.
        save_rng_state(_rng_path(path, tag, self.rank), cuda=torch.cuda.is_available())
        _barrier()

    def load_checkpoint(self, path: str, tag: str) -> None:
        load_path, _ = self.engine.load_checkpoint(
            path,
            tag=tag,
            load_module_strict=not self.is_lora,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {path}")
        rng_path = _rng_path(path, tag, self.rank)
        if not load_rng_state(rng_path):  # never unpickled: a pickled .pt file is refused
            logger.warning("%s missing: RNG states not restored", rng_path)

    # -----------------------------------------------------------------------------------------
    # colocation

    def offload_states(self) -> None:
        """Free the GPU for colocated rollout engines: DeepSpeed's ``engine.offload_states``
        moves what ``offload_targets`` says it can (ZeRO 1-3: parameter shards, gradients,
        fp32 master weights, Adam states) to pinned host memory. What stays on the GPU, and
        why, is logged once (ZeRO-0 keeps everything). On CPU the states already live in host
        memory: a no-op. Idempotent."""
        if self._offloaded:
            return
        include = self._offload_include()
        if include:
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

            self.engine.offload_states(include=[OffloadStateTypeEnum(s) for s in include])
        self._offloaded = True

    def reload_states(self) -> None:
        """Undo ``offload_states`` (DeepSpeed reloads exactly what it moved)."""
        if not self._offloaded:
            return
        if self._offload_include():
            self.engine.reload_states()
        self._offloaded = False

    def _offload_include(self) -> tuple[str, ...]:
        if not current_platform().is_cuda:
            return ()
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        include, kept = offload_targets(
            self.zero_stage, offload_devices(self.ds_config), type(inner).__name__
        )
        if kept and not getattr(self, "_warned_offload", False):
            logger.warning("offload_states (rank %d): %s", self.rank, kept)
            self._warned_offload = True
        return include

    def close(self) -> None:
        """Release the engine (lets one process build several strategies, as tests do)."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
            self.optimizer = None
            self.lr_scheduler = None


# DeepSpeed's OffloadStateTypeEnum values (deepspeed/runtime/zero/offload_config.py)
OFFLOAD_STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


def offload_targets(
    stage: int, offloaded: Mapping[str, str], optimizer: str
) -> tuple[tuple[str, ...], str]:
    """What ``engine.offload_states`` can move for an engine of ZeRO ``stage`` with the offload
    sections ``offloaded`` (``offload_devices``) and inner optimizer class ``optimizer``, read
    from DeepSpeed 0.19's ``offload_states``: ``(state types, what stays on the GPU and why)``;
    no state types when nothing can move. With ``offload_optimizer`` DeepSpeed itself skips the
    states already in host memory (``_refine_include_states``)."""
    if stage == 0:
        return (), (
            "ZeRO stage 0 has no offload_states in DeepSpeed: parameters, gradients and "
            "optimizer states stay on the GPU while the rollout engines generate (use ZeRO 1-3 "
            "for colocation)"
        )
    if "offload_param" in offloaded:
        return (), (
            "nothing to move: offload_param keeps parameters and optimizer states in host "
            "memory already (DeepSpeed refuses to move them)"
        )
    if stage == 3 and optimizer != "FusedAdam" and "offload_optimizer" not in offloaded:
        return ("lp_params", "lp_grads", "contiguous_grad_buffer"), (
            f"ZeRO-3 moves fp32 master weights and Adam states only for DeepSpeed's FusedAdam; "
            f"this engine's optimizer is {optimizer}, so they stay on the GPU (parameter shards "
            "and gradients move)"
        )
    return OFFLOAD_STATES, ""


# ---------------------------------------------------------------------------------------------
# helpers shared with deepspeed_infer


def _param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases and norm scales); empty groups dropped."""
    decay, no_decay = [], []
    for p in params:
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 param's local view is flat
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _fill_optimizer_auto(section: Mapping[str, Any], targs: TrainingArgs) -> dict[str, Any]:
    section = {**section, "params": dict(section.get("params") or {})}
    params = section["params"]
    values = {
        "lr": targs.learning_rate,
        "betas": [targs.adam_beta1, targs.adam_beta2],
        "eps": targs.adam_epsilon,
        "weight_decay": targs.weight_decay,
    }
    for key, value in values.items():
        if params.get(key, "auto") == "auto":
            params[key] = value
    return section


def _scheduler_factory(*, warmup_steps: int, total_steps: int, kind: str):
    def build(optimizer: torch.optim.Optimizer):
        return _common.build_lr_scheduler(
            optimizer, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind
        )

    if kind not in _common.SCHEDULES:  # fail at construction, not inside deepspeed.initialize
        raise ValueError(
            f"unknown lr_scheduler_type {kind!r}; valid: {', '.join(_common.SCHEDULES)}"
        )
    return build


def _grad_norm(module: torch.nn.Module) -> float | None:
    """2-norm of the full gradients held by ``module`` (ZeRO-0), None when there are none."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.sqrt(sum(g.detach().double().pow(2).sum() for g in grads)))


def _accumulate(sums: dict[str, float], metrics: Mapping[str, Any]) -> None:
    for k, v in metrics.items():
        value = v.detach().float().item() if isinstance(v, torch.Tensor) else float(v)
        sums[k] = sums.get(k, 0.0) + value


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_path(path: str, tag: str, rank: int) -> str:
    return os.path.join(path, tag, f"rng_state_rank{rank}.json")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
