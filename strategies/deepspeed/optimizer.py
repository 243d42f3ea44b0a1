"""The optimizer, the LR schedule and the DeepSpeed engine that wraps them.

The optimizer is AdamW: DeepSpeed's own when the config has an ``optimizer`` section (its
``"auto"`` params filled from the training args); otherwise FusedAdam on GPUs, DeepSpeedCPUAdam
when optimizer states are offloaded, and ``torch.optim.AdamW`` for on-device states on CPU
(nothing to JIT-compile). The LR schedule is linear warmup then constant / linear / cosine decay
over ``max_steps`` optimizer steps. Weight decay applies to matrices only.

An op that cannot be built (an image without nvcc or DeepSpeed's prebuilt ops, no compiler) is
not fatal for AdamW, with or without a section: without one, torch's AdamW is built instead; an
Adam/AdamW section whose op (FusedAdam, or CPUAdam with the optimizer offloaded) fails to build
is switched to DeepSpeed's own ``torch_adam`` (torch's AdamW / Adam from the same section
params), with a warning naming the op and why (``section_fallback``). The same maths, so a run
trains where the image lacks a compiler instead of failing at start; a section param torch's
optimizer does not take fails at start naming it. Other section types keep DeepSpeed's error.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from roll_ds.config.deepspeed import offload_devices
from roll_ds.config.schema import TrainingArgs
from roll_ds.platform import current_platform
from strategies import _common
from strategies.deepspeed.ops import OpBuildTimeout, load_ops

logger = logging.getLogger(__name__)

ADAM_TYPES = ("adam", "adamw")  # DeepSpeed's ADAM_OPTIMIZER / ADAMW_OPTIMIZER
# section params DeepSpeed itself takes out before building torch's optimizer (torch_adam path)
DS_KEYS = frozenset(("torch_adam", "adam_w_mode", "fp32_optimizer_states"))


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    training_args: TrainingArgs,
    *,
    max_steps: int,
) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` on ``model``'s trainable parameters: ``(engine, optimizer,
    lr_scheduler)``. A fallback optimizer may set ``zero_force_ds_cpu_optimizer`` in
    ``ds_config``."""
    import deepspeed

    targs = training_args
    params = [p for p in model.parameters() if p.requires_grad]
    scheduler = scheduler_factory(
        warmup_steps=targs.warmup_steps,
        total_steps=max_steps,
        kind=targs.lr_scheduler_type,
    )
    if "optimizer" in ds_config:
        section_fallback(ds_config)
        optimizer = None
        # a group's weight_decay overrides the optimizer's: the section's (filled from the
        # training args where it is "auto") is the one to give the decayed group
        section = ds_config["optimizer"].get("params") or {}
        model_parameters = param_groups(params, section.get("weight_decay", targs.weight_decay))
    else:
        optimizer = build_optimizer(params, targs, ds_config)
        model_parameters = None
    skip_muon_import(ds_config)
    engine, optimizer, _, lr_scheduler = load_ops(  # an `optimizer` section builds its op here
        lambda: deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=scheduler,
            config=ds_config,
            dist_init_required=False,
        ),
        retry=False,
    )
    return engine, optimizer, lr_scheduler


MUON_MODULES = (
    "deepspeed.runtime.zero.muon.muon_optimizer",  # MuonWithAuxAdam
    "deepspeed.runtime.zero.muon.original_muon",  # muon_update, MuonWithAuxAdam
)


class NoMuon:
    """Stands for DeepSpeed's ``MuonWithAuxAdam`` in a trainer whose optimizer is not Muon: no
    optimizer is an instance of it (``skip_muon_import``)."""


def no_muon_update(*args: Any, **kwargs: Any) -> Any:
    """Stands for DeepSpeed's ``muon_update``, which it calls only for a Muon optimizer's
    parameters."""
    raise RuntimeError(
        "DeepSpeed's Muon update was called, but roll_ds started this trainer without Muon "
        "(strategies/deepspeed/optimizer.py skip_muon_import): set the optimizer section's "
        "type to muon"
    )


def skip_muon_import(ds_config: Mapping[str, Any]) -> None:
    """DeepSpeed imports its Muon optimizer's modules to compare the optimizer's type with it,
    at ``initialize`` (ZeRO's supported-optimizer check) and in every ZeRO gradient reduction
    and partition flattening (``average_tensor``, ``_get_flat_partition_unpadded``). Those
    modules compile kernels at import (``torch.compile`` decorators pull in dynamo, inductor,
    jinja2, networkx): 2-3 s of each trainer rank's start on a 2-core box, at ``initialize`` and
    in its first step, for a type our AdamW never is. Unless the config asks for Muon, this
    process gets stand-in modules: a ``MuonWithAuxAdam`` nothing is an instance of, so every
    type check answers "not Muon" as the real class would, and a ``muon_update`` (called only
    for Muon's parameters) that raises."""
    kind = str((ds_config.get("optimizer") or {}).get("type", "")).lower()
    if "muon" in kind or any(name in sys.modules for name in MUON_MODULES):
        return
    for name in MUON_MODULES:
        stand_in = types.ModuleType(name, "roll_ds: stands for DeepSpeed's Muon module")
        stand_in.MuonWithAuxAdam = NoMuon  # type: ignore[attr-defined]
        stand_in.muon_update = no_muon_update  # type: ignore[attr-defined]
        stand_in.__roll_ds__ = True  # type: ignore[attr-defined]
        sys.modules[name] = stand_in


def build_optimizer(
    params: list[torch.nn.Parameter], training_args: TrainingArgs, ds_config: dict[str, Any]
) -> torch.optim.Optimizer:
    """The client AdamW for a config without an ``optimizer`` section (see the module doc)."""
    targs = training_args
    groups = param_groups(params, targs.weight_decay)
    kwargs = dict(
        lr=targs.learning_rate,
        betas=(targs.adam_beta1, targs.adam_beta2),
        eps=targs.adam_epsilon,
        weight_decay=targs.weight_decay,
    )
    offloaded = "offload_optimizer" in offload_devices(ds_config)
    if offloaded:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return load_ops(lambda: DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs))
        except OpBuildTimeout:
            raise  # another process is still building it: every rank must use the same optimizer
        except Exception as exc:  # the JIT build can fail (no compiler)
            logger.warning("DeepSpeedCPUAdam unavailable (%s); using torch AdamW", exc)
            ds_config["zero_force_ds_cpu_optimizer"] = False
            return torch.optim.AdamW(groups, **kwargs)
    if current_platform().is_cuda:
        try:
            from deepspeed.ops.adam import FusedAdam

            return load_ops(lambda: FusedAdam(groups, adam_w_mode=True, **kwargs))
        except OpBuildTimeout:
            raise
        except Exception as exc:
            logger.warning("FusedAdam unavailable (%s); using torch AdamW(fused)", exc)
            return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def section_op(ds_config: Mapping[str, Any]) -> str | None:
    """The op builder DeepSpeed loads for the config's ``optimizer`` section when it is Adam or
    AdamW (``engine.get_optimizer_configuration``): ``CPUAdamBuilder`` with the optimizer
    offloaded (cpu or nvme), else ``FusedAdamBuilder``; None with ``params.torch_adam`` or
    another type."""
    section = ds_config.get("optimizer") or {}
    if str(section.get("type", "")).lower() not in ADAM_TYPES:
        return None
    if (section.get("params") or {}).get("torch_adam"):
        return None
    if offload_devices(ds_config).get("offload_optimizer") in ("cpu", "nvme"):
        return "CPUAdamBuilder"
    return "FusedAdamBuilder"


def section_fallback(ds_config: dict[str, Any]) -> None:
    """Build the op of an Adam/AdamW ``optimizer`` section now (cached for
    ``deepspeed.initialize``); if it cannot be built, switch the section to torch's optimizer
    with the same params (``torch_adam``), warning why. Raises ``ValueError`` naming a section
    param torch's optimizer does not take."""
    op = section_op(ds_config)
    if op is None:
        return
    try:
        load_ops(lambda: _load_op(op))
        return
    except OpBuildTimeout:
        raise  # another process is still building it: every rank must use the same optimizer
    except Exception as exc:  # no nvcc, no prebuilt op, no compiler
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    section = ds_config["optimizer"]
    params = dict(section.get("params") or {})
    alien = sorted(set(params) - set(inspect.signature(torch.optim.AdamW).parameters) - DS_KEYS)
    if alien:
        raise ValueError(
            f"strategy_config.optimizer (type {section['type']}): DeepSpeed's {op} op cannot be "
            f"built here ({why}), and torch's AdamW, the fallback, takes no "
            f"{', '.join(f'params.{k}' for k in alien)}; remove them, or make the op buildable "
            "(a CUDA toolkit with nvcc matching torch, or DeepSpeed installed with prebuilt ops: "
            "DS_BUILD_OPS=1)"
        )
    logger.warning(
        "strategy_config.optimizer (type %s): DeepSpeed's %s op cannot be built here (%s); "
        "using torch's optimizer with the same params instead (optimizer.params.torch_adam: "
        "true). For DeepSpeed's op, install a CUDA toolkit with nvcc matching torch, or "
        "DeepSpeed with prebuilt ops (DS_BUILD_OPS=1)",
        section["type"],
        op,
        why,
    )
    params["torch_adam"] = True
    ds_config["optimizer"] = {**section, "params": params}
    if op == "CPUAdamBuilder":  # ZeRO-Offload then runs torch's optimizer on the host
        ds_config["zero_force_ds_cpu_optimizer"] = False


def _load_op(builder: str) -> Any:
    """Load DeepSpeed's op ``builder`` as its optimizer would (JIT-building it if need be)."""
    from deepspeed.ops import op_builder

    return getattr(op_builder, builder)().load()


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
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


def fill_optimizer_auto(section: Mapping[str, Any], targs: TrainingArgs) -> dict[str, Any]:
    """A DeepSpeed ``optimizer`` section with its ``"auto"`` (or missing) params filled."""
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


def scheduler_factory(
    *, warmup_steps: int, total_steps: int, kind: str
) -> Callable[[torch.optim.Optimizer], Any]:
    """What ``deepspeed.initialize(lr_scheduler=...)`` calls with the optimizer it built."""

    def build(optimizer: torch.optim.Optimizer):
        return _common.build_lr_scheduler(
            optimizer, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind
        )

    if kind not in _common.SCHEDULES:  # fail at construction, not inside deepspeed.initialize
        raise ValueError(
            f"unknown lr_scheduler_type {kind!r}; valid: {', '.join(_common.SCHEDULES)}"
        )
    return build
