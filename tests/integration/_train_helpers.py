"""Shared pieces of the strategy integration tests (imported inside the spawned ranks)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS = {
    0: "deepspeed_zero",
    # Stage 1: the ZeRO-2 preset with the stage switched. (The stage-0 preset has no
    # reduce_bucket_size, and DeepSpeed's default 5e8 elements allocates a 1-2 GB bucket.)
    1: "deepspeed_zero2",
    2: "deepspeed_zero2",
    3: "deepspeed_zero3",
    "2_offload": "deepspeed_zero2_cpuoffload",
    "3_offload": "deepspeed_zero3_cpuoffload",
    "3_nvme": "deepspeed_zero3_nvme",
}


def preset(key: int | str, **zero_overrides: Any) -> dict[str, Any]:
    """The shipped examples/config preset for a ZeRO stage (``"3_offload"`` etc.)."""
    name = PRESETS[key]
    with open(os.path.join(REPO, "examples", "config", f"{name}.yaml")) as f:
        cfg = yaml.safe_load(f)[name]
    if isinstance(key, int):
        cfg["zero_optimization"]["stage"] = key
    cfg["zero_optimization"].update(zero_overrides)
    return cfg


def quiet() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import logging

    for name in ("DeepSpeed", "deepspeed", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)
    except ImportError:
        pass


def make_strategy(
    model_path: str,
    stage: int | str,
    *,
    seed: int = 0,
    max_steps: int = 10,
    zero: dict[str, Any] | None = None,
    ds_extra: dict[str, Any] | None = None,
    infer_batch_size: int = 4,
    max_tokens_per_micro_batch: int | None = None,
    use_sequence_packing: bool = False,
    nvme_dir: str | None = None,
    sequence_parallel_size: int = 1,
    **args: Any,
):
    """A DeepSpeedTrainStrategy on a preset (``zero`` updates its zero_optimization section,
    ``ds_extra`` its top level); ``args`` go to ModelArgs / TrainingArgs by name."""
    from roll_ds.config.schema import ModelArgs, TrainingArgs
    from strategies.deepspeed.train import DeepSpeedTrainStrategy

    quiet()
    model_fields = set(ModelArgs.__dataclass_fields__)
    model_args = ModelArgs(**{k: v for k, v in args.items() if k in model_fields})
    train_defaults = dict(
        learning_rate=1e-3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
    )
    train_defaults.update({k: v for k, v in args.items() if k not in model_fields})
    strategy = DeepSpeedTrainStrategy(
        model_path=model_path,
        strategy_config={**preset(stage, **(zero or {})), **(ds_extra or {})},
        model_args=model_args,
        training_args=TrainingArgs(**train_defaults),
        seed=seed,
        max_steps=max_steps,
        infer_batch_size=infer_batch_size,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        use_sequence_packing=use_sequence_packing,
        nvme_dir=nvme_dir,
        sequence_parallel_size=sequence_parallel_size,
    )
    strategy.initialize()
    return strategy


def rank_batch(
    rank: int, rows: int = 4, length: int = 12, vocab: int = 128, seed: int = 0, pad: bool = True
):
    """A fixed batch for ``rank`` (different per rank); with ``pad`` row 0 is left-padded."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    if pad:
        mask[0, :3] = 0
        ids[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def nll_loss(logprobs_BT, micro_batch, entropy_BT=None):
    """Mean negative log-likelihood over the real tokens of a micro batch."""
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    loss = -(logprobs_BT * mask).sum() / mask.sum()
    return loss, {"tokens": float(mask.sum())}
