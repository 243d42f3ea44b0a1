"""``deepspeed_infer``: reference-model log-probs from a ZeRO-3 sharded model (no optimizer).

Each rank keeps ``1/N`` of the parameters and gathers layers during the forward, so a reference
model that does not fit one device still scores batches. The role's ``strategy_config`` is the
usual preset (``${deepspeed_zero3}``); its training-only entries are filled for a micro batch of
``infer_batch_size``. A config below stage 3 gives a plain replica on every rank. With a ``head``
the model is a reward model and ``score_sequences`` scores whole sequences. Log-probs honour the
role's ``max_tokens_per_micro_batch`` and ``use_sequence_packing`` (``strategies/
micro_batches.py``); scores always go by ``infer_batch_size`` rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from roll_ds.config.deepspeed import (
    DeepSpeedInputs,
    build_deepspeed_config,
    nvme_paths,
    zero_stage,
)
from roll_ds.config.schema import ModelArgs, WorkerConfig
from roll_ds.models.loading import load_causal_lm, resolve_model_path
from roll_ds.models.reward_model import check_head, forward_scores, load_reward_model
from roll_ds.strategy import StrategyContext
from strategies import _common
from strategies.deepspeed import nvme
from strategies.deepspeed.loading import require_fp16_support
from strategies.deepspeed.sequence_parallel import SequenceParallel
from strategies.deepspeed.zero import (
    batched_forward,
    batched_logprobs,
    plain_strategy_config,
    release_zero3_params,
)


class DeepSpeedInferStrategy:
    def __init__(
        self,
        *,
        model_path: str,
        strategy_config: Mapping[str, Any],
        model_args: ModelArgs | None = None,
        infer_batch_size: int = 8,
        seed: int = 42,
        logprob_temperature: float = 1.0,
        head: str | None = None,
        max_tokens_per_micro_batch: int | None = None,
        use_sequence_packing: bool = False,
        nvme_dir: str | None = None,
        sequence_parallel_size: int = 1,
        process_group_timeout_s: float | None = None,
    ) -> None:
        # None: a causal LM; a reward-model head (roll_ds.models.reward_model.HEADS): a scorer.
        self.head = None if head is None else check_head(head)
        self.model_path = model_path
        self.logprob_temperature = _common.check_temperature(logprob_temperature)
        self.strategy_config = plain_strategy_config(strategy_config)
        self.model_args = model_args or ModelArgs()
        self.infer_batch_size = infer_batch_size
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.use_sequence_packing = use_sequence_packing
        self.seed = seed
        self.process_group_timeout_s = process_group_timeout_s  # None: DeepSpeed's default
        self.nvme_dir = nvme_dir  # an "auto" nvme_path (StrategyContext.nvme_dir)
        self.sequence_parallel_size = sequence_parallel_size  # Ulysses (sequence_parallel.py)
        self._sp: SequenceParallel | None = None  # set by initialize
        self.engine: Any = None

    @classmethod
    def from_worker_config(
        cls, worker: WorkerConfig, ctx: StrategyContext, head: str | None = None
    ) -> DeepSpeedInferStrategy:
        return cls(
            head=head,
            model_path=worker.model_args.model_name_or_path or ctx.pretrain,
            strategy_config=worker.strategy_args.strategy_config,
            model_args=worker.model_args,
            infer_batch_size=worker.infer_batch_size,
            seed=ctx.seed,
            logprob_temperature=ctx.logprob_temperature,
            max_tokens_per_micro_batch=worker.max_tokens_per_micro_batch,
            use_sequence_packing=worker.use_sequence_packing,
            nvme_dir=ctx.nvme_dir,
            sequence_parallel_size=worker.sequence_parallel_size,
            process_group_timeout_s=ctx.process_group_timeout_s,
        )

    def initialize(self) -> None:
        import deepspeed
        from transformers import AutoConfig

        self.rank, self.world_size = _common.init_distributed(self.process_group_timeout_s)
        self.device = _common.device()
        torch.manual_seed(self.seed)
        self.model_path = resolve_model_path(self.model_path)
        hidden = getattr(AutoConfig.from_pretrained(self.model_path), "hidden_size", None)
        dtype = self.model_args.dtype
        if dtype == "fp16":
            require_fp16_support("fp16 inference")
        size = nvme.model_size(self.model_path) if nvme_paths(self.strategy_config) else None
        self.ds_config = build_deepspeed_config(
            self.strategy_config,
            DeepSpeedInputs(
                micro_batch_size=self.infer_batch_size,
                gradient_accumulation_steps=1,
                dp_size=self.world_size,
                max_grad_norm=1.0,
                dtype=dtype,
                hidden_size=hidden,
                nvme_dir=self.nvme_dir,
                largest_numel=size.largest_numel if size else None,
            ),
        )
        # No optimizer: optimizer offload is meaningless, parameter offload still applies.
        zero = self.ds_config.get("zero_optimization") or {}
        zero.pop("offload_optimizer", None)
        nvme.check_rank_nvme(
            self.ds_config, size=size, trained_numel=0, dtype=dtype, dp_size=self.world_size
        )
        load = load_causal_lm if self.head is None else partial(load_reward_model, head=self.head)
        model = load(
            self.model_path,
            dtype=dtype,
            attn_impl=self.model_args.attn_implementation,
            zero3_config=self.ds_config,
        )
        if self.head is not None and self.sequence_parallel_size > 1:
            raise ValueError("sequence_parallel_size > 1 computes log-probs, not reward scores")
        self._sp = SequenceParallel.setup(self.sequence_parallel_size, model)
        self.engine, *_ = deepspeed.initialize(
            model=model, config=self.ds_config, dist_init_required=False
        )
        self.engine.eval()

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    @torch.no_grad()
    def compute_logprobs(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
        temperature: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, T-1]``) at ``temperature`` (None: the
        rollouts' ``logprob_temperature``); all ranks call it together."""
        try:
            return batched_logprobs(
                self.engine,
                input_ids_BT,
                attention_mask_BT,
                batch_size=self.infer_batch_size,
                with_entropy=with_entropy,
                device=self.device,
                lockstep=self.zero_stage == 3 and self.world_size > 1,
                temperature=self.logprob_temperature if temperature is None else temperature,
                max_tokens=self.max_tokens_per_micro_batch,
                packed=self.use_sequence_packing,
                sp=self._sp,
            )
        finally:
            release_zero3_params(self.engine)

    @torch.no_grad()
    def score_sequences(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``scores_B`` (fp32 on CPU): the reward head at each left-padded row's last token (a
        strategy built with a ``head`` only); all ranks call it together."""
        if self.head is None:
            raise RuntimeError("score_sequences needs a strategy built with a reward-model head")
        try:
            out = batched_forward(
                lambda ids, mask: {"scores_B": forward_scores(self.engine, self.head, ids, mask)},
                input_ids_BT,
                attention_mask_BT,
                batch_size=self.infer_batch_size,
                device=self.device,
                lockstep=self.zero_stage == 3 and self.world_size > 1,
                empty_keys=("scores_B",),
            )
        finally:
            release_zero3_params(self.engine)
        return {"scores_B": out["scores_B"].reshape(-1)}

    def offload_states(self) -> None:
        """Nothing to move: ZeRO-3 inference keeps only its parameter shard (use the preset's
        ``offload_param`` to keep it in host memory)."""

    def reload_states(self) -> None:
        """See ``offload_states``."""

    def close(self) -> None:
        if self._sp is not None:
            self._sp.close()
            self._sp = None
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
