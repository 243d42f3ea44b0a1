"""``deepspeed_train``: a DeepSpeed ZeRO (0-3) engine training an HF causal LM, optionally LoRA.

``head="value"`` (the critic role) trains a value model instead: the same body with a scalar
value head (``roll_ds.models.value_model``); it computes ``values_BT`` where the policy computes
``logprobs_BT``, and everything else (ZeRO, LoRA, optimizer, checkpoints) is shared.

Built from the role's composed ``strategy_config`` (a DeepSpeed JSON whose ``"auto"`` values
``roll_ds.config.deepspeed.build_deepspeed_config`` fills from the training args). The class
holds the engine and delegates each job to its module in this package: ``loading`` (seeds,
DeepSpeed config, model), ``optimizer`` (AdamW, LR schedule, ``deepspeed.initialize``),
``step`` (the pieces of a train step), ``old_logprobs`` (a train step that fills in the
batch's old log-probs), ``weights_out`` (sync buckets, HF export), ``checkpoint``, ``offload``
and ``sequence_parallel`` (Ulysses: ``sequence_parallel_size`` ranks share each micro-batch's
columns).

Every public method is collective: all ranks of the data-parallel group call it together, with
the same number of micro batches.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from roll_ds import timeline
from roll_ds.config.deepspeed import offload_devices, zero_stage
from roll_ds.config.schema import ModelArgs, TrainingArgs, WorkerConfig
from roll_ds.models.loading import resolve_model_path
from roll_ds.perf import TrainPerf
from roll_ds.strategy import StrategyContext
from strategies import _common
from strategies.deepspeed import checkpoint, offload
from strategies.deepspeed.loading import build_train_ds_config, load_train_model, seed_everything
from strategies.deepspeed.old_logprobs import OldLogprobs
from strategies.deepspeed.optimizer import build_engine
from strategies.deepspeed.sequence_parallel import SequenceParallel, group_budget, over_rows
from strategies.deepspeed.start_bound import bounded_initialisation, start_timeout_s
from strategies.deepspeed.step import (
    LossFn,
    StepTally,
    dropout_free,
    grad_norm,
    head_forward,
    loss_scale_metrics,
    micro_batch_plan,
)
from strategies.deepspeed.weights_out import WeightsOut
from strategies.deepspeed.zero import batched_forward, plain_strategy_config, release_zero3_params

logger = logging.getLogger(__name__)

HEADS = ("lm", "value")


class DeepSpeedTrainStrategy(WeightsOut):
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
        max_tokens_per_micro_batch: int | None = None,
        use_sequence_packing: bool = False,
        nvme_dir: str | None = None,
        sequence_parallel_size: int = 1,
        process_group_timeout_s: float | None = None,
    ) -> None:
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; valid: {', '.join(HEADS)}")
        self.head = head
        self.logprob_temperature = _common.check_temperature(logprob_temperature)
        self.model_path = model_path  # resolved to a directory by initialize
        self.base_model = model_path  # as configured: what an exported adapter records
        self.strategy_config = plain_strategy_config(strategy_config)
        self.model_args = model_args or ModelArgs()
        self.training_args = training_args or TrainingArgs()
        self.seed = seed
        self.process_group_timeout_s = process_group_timeout_s  # None: DeepSpeed's default
        self.max_steps = max_steps
        self.infer_batch_size = infer_batch_size
        # micro batches of about this many tokens (None: of per_device_train_batch_size rows /
        # infer_batch_size rows), each packed into one row without padding (strategies/
        # micro_batches.py)
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.use_sequence_packing = use_sequence_packing
        self.nvme_dir = nvme_dir  # an "auto" nvme_path (StrategyContext.nvme_dir)
        self.sequence_parallel_size = sequence_parallel_size  # Ulysses (sequence_parallel.py)
        self._sp: SequenceParallel | None = None  # set by initialize
        self.engine: Any = None
        self.ds_config: dict[str, Any] = {}
        self._offload = offload.EngineOffload()
        self._dropout_free = False  # set by initialize
        self._perf: TrainPerf | None = None  # set by initialize (perf/* metrics)

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
            max_tokens_per_micro_batch=worker.max_tokens_per_micro_batch,
            use_sequence_packing=worker.use_sequence_packing,
            nvme_dir=ctx.nvme_dir,
            sequence_parallel_size=worker.sequence_parallel_size,
            process_group_timeout_s=ctx.process_group_timeout_s,
        )

    # -----------------------------------------------------------------------------------------
    # setup

    @property
    def is_lora(self) -> bool:
        return self.model_args.lora_rank is not None

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    def summary(self) -> str:
        """What the engine runs, for the start-up log: the ZeRO stage in use (a LoRA adapter
        under a stage-3 config whose frozen base is kept whole trains at a lower one), the
        ranks, the offload and the precision."""
        used, configured = self.zero_stage, zero_stage(self.strategy_config)
        text = f"DeepSpeed ZeRO stage {used} on {self.world_size} rank(s)"
        if used != configured:
            text += f" (the config's stage {configured}; frozen base kept whole)"
        offload = offload_devices(self.ds_config)
        where = ", ".join(f"{k.removeprefix('offload_')} -> {v}" for k, v in offload.items())
        precision = next(
            (p for p in ("bf16", "fp16") if (self.ds_config.get(p) or {}).get("enabled")), "fp32"
        )
        return f"{text}, offload {where or 'none'}, {precision}"

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (a peft model under LoRA)."""
        return self.engine.module

    def initialize(self) -> None:
        """Join the process group and build the DeepSpeed engine, bounded by
        ``ROLL_DS_DEEPSPEED_START_TIMEOUT_S`` (the error names the role and rank)."""
        role, rank = os.environ.get("ROLL_DS_ROLE", "trainer"), os.environ.get("RANK", "0")
        with bounded_initialisation(start_timeout_s(), role=role, rank=rank):
            self._initialize()

    def _initialize(self) -> None:
        with timeline.phase("init_process_group"):
            self.rank, self.world_size = _common.init_distributed(self.process_group_timeout_s)
        self.device = _common.device()
        seed_everything(self.seed)
        self.model_path = resolve_model_path(self.model_path)
        self.ds_config = build_train_ds_config(
            self.strategy_config,
            model_path=self.model_path,
            model_args=self.model_args,
            training_args=self.training_args,
            dp_size=self.world_size,
            nvme_dir=self.nvme_dir,
        )
        with timeline.phase("load model"):
            model = load_train_model(
                self.model_path, self.model_args, self.ds_config, head=self.head
            )
        self._sp = SequenceParallel.setup(self.sequence_parallel_size, model)
        with timeline.phase("deepspeed.initialize"):
            self.engine, self.optimizer, self.lr_scheduler = build_engine(
                model, self.ds_config, self.training_args, max_steps=self.max_steps
            )
        # a train forward with dropout is not the old policy's (train_step_with_old_logprobs)
        self._dropout_free = dropout_free(self.module)
        self._perf = TrainPerf.for_module(
            self.module, self.model_path, self.is_lora, self.device, self.model_args.dtype
        )

    def _forward(self, model: Any, *tensors: torch.Tensor, **kw: Any) -> dict[str, torch.Tensor]:
        """``step.head_forward`` of this strategy's head, packing and logprob temperature."""
        kw.setdefault("temperature", None)
        if kw["temperature"] is None:
            kw["temperature"] = self.logprob_temperature
        packed = self.use_sequence_packing
        return head_forward(model, *tensors, head=self.head, packed=packed, sp=self._sp, **kw)

    def _require_head(self, head: str, what: str) -> None:
        if self.head != head:
            raise ValueError(f"{what} needs head={head!r}; this strategy has head={self.head!r}")

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
        batch of ``k * micro * accumulation`` rows makes ``k`` optimizer steps.

        With ``max_tokens_per_micro_batch`` each optimizer step's ``micro * accumulation`` rows
        are cut by tokens instead (``step.token_micro_batches``); the strategy then marks the
        accumulation boundary and averages over the step's own micro-batch count, so the
        gradient is the row-count path's.

        Metrics beside the loss's: ``optimizer_steps``, ``lr``, ``grad_norm``,
        ``train/overflow_steps`` and under fp16 ``train/loss_scale`` (``step.loss_scale_metrics``),
        and this rank's ``perf/tflops``, ``perf/mfu``, ``perf/peak_tflops``: the model FLOPs of
        its rows' real tokens (``roll_ds.perf``) over the call's wall time."""
        return self._train(batch, loss_fn, with_entropy=with_entropy, fill_old=False)[0]

    def train_step_with_old_logprobs(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
    ) -> tuple[dict[str, float], torch.Tensor]:
        """``train_step`` on a batch that has no ``old_logprobs`` yet, filling them as the
        separate log-prob pass would (the policy before this step's first update) with less
        work: the rows of the first optimizer step take their train forward's own log-probs,
        and only the later steps' rows get a no-grad forward before training
        (``old_logprobs.OldLogprobs``). Returns the metrics and ``old_logprobs`` ``[B, T-1]`` of
        every row. The caller keeps dropout off (a train forward with dropout is not the old
        policy's; with dropout in the model every row gets the no-grad forward)."""
        self._require_head("lm", "train_step_with_old_logprobs")
        metrics, old = self._train(batch, loss_fn, with_entropy=with_entropy, fill_old=True)
        assert old is not None
        return metrics, old.old_BT

    def _train(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        with_entropy: bool,
        fill_old: bool,
    ) -> tuple[dict[str, float], OldLogprobs | None]:
        started = time.perf_counter()
        micro = self.training_args.per_device_train_batch_size
        accum = self.training_args.gradient_accumulation_steps
        budget = self.max_tokens_per_micro_batch
        old, sp = None, self._sp
        if fill_old:
            # under SP the train forwards run on the group's rows: every row gets the no-grad one
            own_rows = micro * accum if self._dropout_free and sp is None else 0
            old = OldLogprobs.before_training(self.compute_logprobs, batch, own_rows=own_rows)
            batch = {**batch, "old_logprobs": old.old_BT}
        chunks, steps, rows, norms = micro_batch_plan(
            batch,
            loss_fn,
            micro=micro,
            accum=accum,
            budget=budget,
            packed=self.use_sequence_packing,
            world_size=self.world_size,
            device=self.device,
            sp=sp,
        )
        self.engine.train()
        replicas = sp.size if sp else 1
        tally = StepTally()
        micro_batches = iter(zip(chunks, rows, strict=True))
        try:
            for k, n in enumerate(steps):
                kwargs = {"norm": norms[k]} if norms is not None else {}
                for j in range(n):
                    chunk, chunk_rows = next(micro_batches)
                    own = self._train_micro_batch(
                        _common.to_device(chunk, self.device),
                        loss_fn,
                        kwargs,
                        with_entropy,
                        tally,
                        # row-count micro batches: DeepSpeed's own micro-step counter decides
                        at_boundary=None if budget is None and replicas == 1 else j == n - 1,
                        count=n,
                        old_from_forward=old is not None and old.from_forward(chunk_rows),
                    )
                    if own is not None:
                        assert old is not None
                        old.put(chunk_rows, own)
        finally:
            if budget is not None or replicas > 1:
                self.engine.set_gradient_accumulation_boundary(None)
        metrics = {**tally.result(len(chunks)), **loss_scale_metrics(self.engine)}
        if self._perf is not None:
            lengths = batch["attention_mask"].sum(-1).tolist()
            took = time.perf_counter() - started
            metrics.update(self._perf.metrics(lengths, took, value_head=self.head == "value"))
        return metrics, old

    def _train_micro_batch(
        self,
        mb: dict[str, Any],
        loss_fn: LossFn,
        loss_kwargs: dict[str, Any],
        with_entropy: bool,
        tally: StepTally,
        *,
        at_boundary: bool | None,
        count: int,
        old_from_forward: bool = False,
    ) -> torch.Tensor | None:
        """Forward, backward and ``engine.step`` of one micro batch (an optimizer step at the
        accumulation boundary: DeepSpeed's micro-step counter decides, or ``at_boundary`` when
        not None). The loss is averaged over the ``count`` micro batches of its optimizer step
        (DeepSpeed's ``scale_wrt_gas`` would divide by ``gradient_accumulation_steps``).
        ``old_from_forward``: the micro batch's ``old_logprobs`` are its forward's own
        log-probs, detached (returned; otherwise None)."""
        if at_boundary is not None:
            self.engine.set_gradient_accumulation_boundary(at_boundary)
        out = self._forward(
            self.engine, mb["input_ids"], mb["attention_mask"], with_entropy=with_entropy
        )
        own = None
        if old_from_forward:
            own = out["logprobs_BT"].detach().float()
            mb = {**mb, "old_logprobs": own}
        output_key = "values_BT" if self.head == "value" else "logprobs_BT"
        loss, metrics = loss_fn(out[output_key], mb, out.get("entropy_BT"), **loss_kwargs)
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:
            tally.lrs.append(self.lr_scheduler.get_last_lr()[0])
        factor = self._sp.loss_factor if self._sp is not None else 1.0
        self.engine.backward(loss * factor / count, scale_wrt_gas=False)
        # DeepSpeed reports no norm for fp32 ZeRO-0 without clipping: take it from the
        # gradients (already averaged over the ranks at the boundary) before the step.
        own_norm = grad_norm(self.module) if boundary and self.zero_stage == 0 else None
        self.engine.step()
        tally.add_micro_batch(loss, metrics)
        if boundary:
            norm = self.engine.get_global_grad_norm()
            tally.add_optimizer_step(
                own_norm if norm is None else norm, applied=self.engine.was_step_applied()
            )
        return own

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
        run = functools.partial(  # under SP over the group's rows, this rank's returned
            batched_forward,
            forward,
            batch_size=self.infer_batch_size,
            device=self.device,
            lockstep=self.zero_stage == 3 and self.world_size > 1,
            empty_keys=keys,
            max_tokens=group_budget(self._sp, self.max_tokens_per_micro_batch),
            packed=self.use_sequence_packing,
        )
        try:
            return over_rows(self._sp, run, input_ids_BT, attention_mask_BT)
        finally:
            self.engine.train(was_training)
            release_zero3_params(self.engine)

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def save_checkpoint(self, path: str, tag: str) -> None:
        """DeepSpeed engine state (module, optimizer, LR scheduler) plus every rank's RNG states:
        loading it into a fresh strategy continues the run exactly."""
        checkpoint.save_engine_checkpoint(
            self.engine,
            path,
            tag,
            rank=self.rank,
            global_step=self.global_step,
            is_lora=self.is_lora,
        )

    def load_checkpoint(self, path: str, tag: str) -> None:
        checkpoint.load_engine_checkpoint(
            self.engine, path, tag, rank=self.rank, is_lora=self.is_lora
        )

    # -----------------------------------------------------------------------------------------
    # colocation

    def offload_states(self) -> None:
        """Free the GPU for colocated rollout engines (``offload.EngineOffload.offload``)."""
        self._offload.offload(self.engine, self.ds_config, self.device)

    def reload_states(self) -> None:
        """Undo ``offload_states``."""
        self._offload.reload(self.engine, self.ds_config, self.device)

    def close(self) -> None:
        """Release the engine (lets one process build several strategies, as tests do)."""
        if self._sp is not None:
            self._sp.close()
            self._sp = None
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
            self.optimizer = None
            self.lr_scheduler = None
