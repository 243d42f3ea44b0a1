"""Colocation: which training states DeepSpeed's ``engine.offload_states`` can move to host
memory while the rollout engines generate, and what stays on the GPU and why; and moving a LoRA
base kept out of ZeRO-3 (``zero3_frozen_base: whole``), which DeepSpeed does not own, after it.

Order matters for the GPU memory handed back. ``engine.offload_states`` ends with the
accelerator's ``empty_cache``; the frozen base moves after that, so its blocks return to torch's
caching allocator, still reserved by this process (about 15 GB for a 7B base in bf16) while the
rollout engine wakes its KV cache, unless the cache is emptied once more
(``offload_frozen_base``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from roll_ds.config.deepspeed import offload_devices, zero_stage
from roll_ds.models.frozen_base import move_frozen_base
from roll_ds.platform import current_platform

logger = logging.getLogger(__name__)

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


def engine_offload_targets(
    engine: Any, ds_config: Mapping[str, Any]
) -> tuple[tuple[str, ...], str]:
    """``offload_targets`` of a built engine; nothing to move off a CPU (the states already
    live in host memory)."""
    if not current_platform().is_cuda:
        return (), ""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return offload_targets(zero_stage(ds_config), offload_devices(ds_config), type(inner).__name__)


def offload_engine_states(engine: Any, include: tuple[str, ...]) -> None:
    """Move the ``include`` state types to pinned host memory."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    engine.offload_states(include=[OffloadStateTypeEnum(s) for s in include])


def offload_frozen_base(module: torch.nn.Module) -> int:
    """Move the frozen base weights kept whole to (pinned) host memory, then return the GPU
    blocks they held through DeepSpeed's accelerator (``empty_cache``; a no-op on its CPU
    accelerator). Returns the bytes moved; nothing moved, nothing emptied."""
    moved = move_frozen_base(module, "cpu")
    if moved:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().empty_cache()
    return moved


@dataclass
class EngineOffload:
    """A trainer's offload state between ``offload`` and ``reload`` (both idempotent)."""

    offloaded: bool = False
    warned: bool = False

    def offload(self, engine: Any, ds_config: Mapping[str, Any], device: torch.device) -> None:
        """DeepSpeed's ``engine.offload_states`` moves what ``engine_offload_targets`` says it
        can (ZeRO 1-3: parameter shards, gradients, fp32 master weights, Adam states) to pinned
        host memory, then a LoRA base kept whole moves (``offload_frozen_base``, which empties
        the cache again). What stays on the GPU, and why, is logged once. On CPU a no-op."""
        if self.offloaded:
            return
        include = self._include(engine, ds_config)
        if include:
            offload_engine_states(engine, include)
        if device.type != "cpu":  # a LoRA base kept out of ZeRO-3 (zero3_frozen_base)
            offload_frozen_base(engine.module)
        self.offloaded = True

    def reload(self, engine: Any, ds_config: Mapping[str, Any], device: torch.device) -> None:
        """Undo ``offload`` (DeepSpeed reloads exactly what it moved)."""
        if not self.offloaded:
            return
        if self._include(engine, ds_config):
            engine.reload_states()
        if device.type != "cpu":
            move_frozen_base(engine.module, device)
        self.offloaded = False

    def _include(self, engine: Any, ds_config: Mapping[str, Any]) -> tuple[str, ...]:
        include, kept = engine_offload_targets(engine, ds_config)
        if kept and not self.warned:
            logger.warning("offload_states: %s", kept)
            self.warned = True
        return include
