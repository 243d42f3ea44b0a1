"""Turn a composed ``strategy_config`` (DeepSpeed JSON with ``"auto"`` values) into the final dict.

``"auto"`` follows the convention of the HF/Accelerate integration: values the role's training
arguments already state (micro batch, accumulation, clipping, precision) are copied from them, and
bucket sizes derive from the model's hidden size. Whatever stays ``"auto"`` is an error naming the
key, so DeepSpeed never sees the string.

``zero3_frozen_base`` (top level, roll_ds's own key; DeepSpeed ignores it) says where a LoRA
model's frozen base lives under ZeRO-3: ``partitioned`` like every other parameter (gathered in
every forward and backward), or ``whole`` on every rank, kept out of ZeRO-3 (never gathered; only
the adapter is partitioned). ``auto`` picks ``whole`` when the base's bytes are at most
``FROZEN_BASE_BUDGET_FRACTION`` of one rank's memory and parameters are not offloaded, else
``partitioned``; the built config carries the decision (``frozen_base_whole`` reads it).

``zero3_adapter_stage`` (also roll_ds's) says which ZeRO stage trains the adapter once the base
is whole: ``3`` partitions the adapter's weights too (gathered around every module's forward and
backward); ``2`` keeps them replicated and partitions their gradients (reduced after every
micro-batch) and optimizer states; ``1`` keeps weights and gradients replicated and partitions
the optimizer states, so gradients are reduced once per optimizer step (no per-module gather
hooks in either; the adapter of a LoRA r16 model is ~0.5% of its base, its gradients as small).
``auto`` picks 1 whenever the base is whole, 2 if optimizer states are offloaded (DeepSpeed
offloads them from stage 2 up); with a partitioned base it is always 3 (stages 1 and 2 cannot
partition the base). A stage-1 or -2 pick rewrites the built config's
``zero_optimization.stage`` (its ``stage3_*`` keys dropped), so every later reader (engine,
weight sync, export, offload, checkpoints) sees the engine it gets; the kept
``zero3_adapter_stage`` says it was lowered.

With LoRA, an ``"auto"`` ``reduce_bucket_size`` holds the whole adapter's gradients
(``DeepSpeedInputs.trainable_numel``, at least hidden x hidden): one reduction per step instead
of one per hidden x hidden elements.

NVMe offload (ZeRO-Infinity, ``${deepspeed_zero3_nvme}``): an ``"auto"`` ``nvme_path`` is the
role's own directory under the run's output (``DeepSpeedInputs.nvme_dir``), an ``"auto"``
``offload_param.buffer_size`` the largest parameter's partition (``largest_numel`` over
``dp_size``). The checks of the path itself (room, file system, libaio) need the disk and the
model: ``strategies/deepspeed/nvme.py``.

ZeRO++ keys are checked in ``roll_ds.config.zeropp``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from roll_ds.config.zeropp import zeropp_problems

AUTO = "auto"
VALID_STAGES = (0, 1, 2, 3)
FROZEN_BASE_KEY = "zero3_frozen_base"
FROZEN_BASE_MODES = (AUTO, "whole", "partitioned")
ADAPTER_STAGE_KEY = "zero3_adapter_stage"
ADAPTER_STAGES = (AUTO, 1, 2, 3)
DEEPSPEED_BUCKET_DEFAULT = 500_000_000  # DeepSpeed's own reduce_bucket_size (elements)
# "auto" keeps a LoRA base whole when it takes at most this share of a rank's memory (a GPU's, or
# its share of host memory): the rest is left to activations, the adapter and colocated engines.
FROZEN_BASE_BUDGET_FRACTION = 0.25


@dataclass(frozen=True, kw_only=True)
class DeepSpeedInputs:
    """The plain numbers ``"auto"`` is filled from (flattened out of the role's config)."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    dp_size: int
    max_grad_norm: float
    dtype: str  # fp32 | bf16 | fp16
    hidden_size: int | None = None  # None: bucket-size "auto" values fall back to DeepSpeed's
    lora: bool = False  # LoRA: a frozen base with a trainable adapter
    frozen_base_bytes: int | None = None  # the frozen base's bytes; None: unknown
    rank_memory_bytes: int | None = None  # one rank's device memory; None: unknown
    trainable_numel: int | None = None  # LoRA: the adapter's parameter count; None: unknown
    nvme_dir: str | None = None  # where an "auto" nvme_path points (the role's own directory)
    largest_numel: int | None = None  # the model's largest parameter (NVMe swap buffers)


class DeepSpeedConfigError(ValueError):
    pass


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def offload_devices(ds_config: Mapping[str, Any]) -> dict[str, str]:
    """``{"offload_optimizer": "cpu", ...}`` for the offload sections that are switched on."""
    zero = ds_config.get("zero_optimization") or {}
    found = {}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            found[key] = device
    return found


# Numeric settings of the presets: key path -> (lowest value, what the boundary means). "auto" is
# left to build_deepspeed_config, which fills it or names the key it cannot fill.
MIN_VALUES: dict[str, tuple[int, str]] = {
    "train_batch_size": (1, ""),
    "train_micro_batch_size_per_gpu": (1, ""),
    "gradient_accumulation_steps": (1, ""),
    "gradient_clipping": (0, "0: no clipping"),
    "steps_per_print": (1, ""),
    "fp16.loss_scale": (0, "0: dynamic loss scaling"),
    "fp16.initial_scale_power": (0, ""),
    "fp16.loss_scale_window": (1, ""),
    "fp16.hysteresis": (1, ""),
    "fp16.min_loss_scale": (0, ""),
    "zero_optimization.allgather_bucket_size": (1, ""),
    "zero_optimization.reduce_bucket_size": (1, ""),
    "zero_optimization.sub_group_size": (1, ""),
    "zero_optimization.stage3_prefetch_bucket_size": (0, ""),
    "zero_optimization.stage3_param_persistence_threshold": (0, ""),
    "zero_optimization.stage3_max_live_parameters": (0, ""),
    "zero_optimization.stage3_max_reuse_distance": (0, ""),
    "zero_optimization.offload_optimizer.buffer_count": (1, ""),
    "zero_optimization.offload_param.buffer_count": (1, ""),
    "zero_optimization.offload_param.buffer_size": (1, ""),
    "zero_optimization.offload_param.max_in_cpu": (0, "0: every parameter read from NVMe"),
    "zero_optimization.zero_hpz_partition_size": (1, "1: no secondary partition"),
    "aio.block_size": (1, ""),
    "aio.queue_depth": (1, ""),
    "aio.intra_op_parallelism": (1, ""),
}
BOOL_KEYS = (
    "wall_clock_breakdown",
    "zero_optimization.allgather_partitions",
    "zero_optimization.overlap_comm",
    "zero_optimization.reduce_scatter",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.zero_quantized_weights",
    "zero_optimization.zero_quantized_gradients",
    "zero_optimization.zero_quantized_nontrainable_weights",
    "aio.single_submit",
    "aio.overlap_events",
    "aio.use_gds",
)
SECTIONS = (
    "zero_optimization",
    "fp16",
    "bf16",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "aio",
)
OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")


def check_deepspeed_config(ds_config: Mapping[str, Any], where: str) -> list[str]:
    """Problems a DeepSpeed config has on its own (before "auto" is filled); ``where`` names it."""
    for path in SECTIONS:
        section = _lookup(ds_config, path)
        if section is not None and not isinstance(section, Mapping):
            return [f"{where}.{path}: must be a mapping, got {section!r}"]
    problems = []
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in VALID_STAGES:
        problems.append(
            f"{where}.zero_optimization.stage: {stage!r} is not a ZeRO stage; use one of 0, 1, 2, 3"
        )
        return problems
    problems += _offload_problems(ds_config, stage, where)
    problems += _value_problems(ds_config, where)
    problems += zeropp_problems(ds_config, stage, where)
    mode = ds_config.get(FROZEN_BASE_KEY, AUTO)
    if mode not in FROZEN_BASE_MODES:
        problems.append(
            f"{where}.{FROZEN_BASE_KEY}: {mode!r} is not one of {', '.join(FROZEN_BASE_MODES)}"
        )
    adapter = ds_config.get(ADAPTER_STAGE_KEY, AUTO)
    if isinstance(adapter, bool) or adapter not in ADAPTER_STAGES:
        problems.append(f"{where}.{ADAPTER_STAGE_KEY}: {adapter!r} is not one of auto, 1, 2, 3")
    elif adapter in (1, 2) and mode == "partitioned":
        problems.append(
            f"{where}.{ADAPTER_STAGE_KEY}: {adapter} needs the frozen base whole, but "
            f"{FROZEN_BASE_KEY} is partitioned (only ZeRO-3 can partition it); set "
            f"{ADAPTER_STAGE_KEY}: auto or 3, or {FROZEN_BASE_KEY}: whole"
        )
    elif adapter == 1 and "offload_optimizer" in offload_devices(ds_config):
        problems.append(
            f"{where}.{ADAPTER_STAGE_KEY}: 1 cannot offload the optimizer (DeepSpeed offloads "
            f"from stage 2 up); set {ADAPTER_STAGE_KEY}: auto or 2, or drop offload_optimizer"
        )
    fp16 = (ds_config.get("fp16") or {}).get("enabled") is True
    bf16 = (ds_config.get("bf16") or {}).get("enabled") is True
    if fp16 and bf16:
        problems.append(f"{where}: fp16.enabled and bf16.enabled are both true; pick one")
    return problems


def _offload_problems(ds_config: Mapping[str, Any], stage: int, where: str) -> list[str]:
    problems = []
    offloads = offload_devices(ds_config)
    if "offload_optimizer" in offloads and stage < 2:
        problems.append(
            f"{where}.zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 2 or "
            f"3 (stage is {stage}); use ${{deepspeed_zero2_cpuoffload}} or "
            f"${{deepspeed_zero3_cpuoffload}}, or set offload_optimizer.device: none"
        )
    if "offload_param" in offloads and stage != 3:
        problems.append(
            f"{where}.zero_optimization.offload_param: parameter offload needs ZeRO stage 3 "
            f"(stage is {stage}); use ${{deepspeed_zero3_cpuoffload}} or remove offload_param"
        )
    for key, device in offloads.items():
        if device not in ("cpu", "nvme"):
            problems.append(
                f"{where}.zero_optimization.{key}.device: {device!r} is not cpu, nvme or none"
            )
        elif device == "nvme":
            path = (ds_config["zero_optimization"][key]).get("nvme_path")
            if not isinstance(path, str) or not path:
                problems.append(
                    f"{where}.zero_optimization.{key}.nvme_path: NVMe offload needs a directory, "
                    f"got {path!r}; set it to a directory on a local NVMe drive, or auto (the "
                    "role's directory under output_dir)"
                )
    return problems


def role_nvme_dir(output_dir: str, exp_name: str, role: str) -> str:
    """Where ``nvme_path: auto`` puts role ``role``'s swap files: its own directory, since
    DeepSpeed names them by rank and parameter id only (two roles in one directory would
    overwrite each other's)."""
    return os.path.abspath(os.path.join(output_dir, exp_name, "nvme", role))


def nvme_paths(ds_config: Mapping[str, Any]) -> dict[str, str]:
    """``{"offload_param": "<nvme_path>", ...}`` for the sections offloaded to NVMe."""
    zero = ds_config.get("zero_optimization") or {}
    return {
        key: zero[key].get("nvme_path")
        for key, device in offload_devices(ds_config).items()
        if device == "nvme"
    }


def _value_problems(ds_config: Mapping[str, Any], where: str) -> list[str]:
    """Numbers below their minimum, strings where numbers or booleans belong."""
    problems = []
    for path, (low, meaning) in MIN_VALUES.items():
        value = _lookup(ds_config, path)
        if value is None or value == AUTO:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
            note = f" ({meaning})" if meaning else ""
            problems.append(f"{where}.{path}: must be a number >= {low}{note}, got {value!r}")
    for path in BOOL_KEYS:
        value = _lookup(ds_config, path)
        if value is not None and not isinstance(value, bool):
            problems.append(f"{where}.{path}: must be true or false, got {value!r}")
    for name in ("fp16", "bf16"):
        enabled = (ds_config.get(name) or {}).get("enabled")
        if enabled is not None and enabled != AUTO and not isinstance(enabled, bool):
            problems.append(f"{where}.{name}.enabled: must be true, false or auto, got {enabled!r}")
    return problems


def _lookup(ds_config: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path``, or None where a section or key is absent."""
    node: Any = ds_config
    for key in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def build_deepspeed_config(
    strategy_config: Mapping[str, Any], inputs: DeepSpeedInputs
) -> dict[str, Any]:
    """Return a copy of ``strategy_config`` with every ``"auto"`` filled and batch sizes checked."""
    cfg = copy.deepcopy(dict(strategy_config))
    problems = check_deepspeed_config(cfg, "strategy_config")
    expected_train_batch = (
        inputs.micro_batch_size * inputs.gradient_accumulation_steps * inputs.dp_size
    )

    _fill(cfg, "train_micro_batch_size_per_gpu", inputs.micro_batch_size)
    _fill(cfg, "gradient_accumulation_steps", inputs.gradient_accumulation_steps)
    _fill(cfg, "train_batch_size", expected_train_batch)
    _fill(cfg, "gradient_clipping", inputs.max_grad_norm)
    for name in ("fp16", "bf16"):
        if name in cfg:
            _fill(cfg[name], "enabled", inputs.dtype == name)
    if inputs.dtype in ("fp16", "bf16") and not (cfg.get(inputs.dtype) or {}).get("enabled"):
        cfg[inputs.dtype] = {**(cfg.get(inputs.dtype) or {}), "enabled": True}

    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        hidden = inputs.hidden_size
        reduce = hidden * hidden if hidden else None
        if inputs.lora and inputs.trainable_numel:  # the adapter's gradients in one bucket
            reduce = min(max(reduce or 0, inputs.trainable_numel), DEEPSPEED_BUCKET_DEFAULT)
        sizes = {
            "reduce_bucket_size": reduce,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden) if hidden else None,
            "stage3_param_persistence_threshold": 10 * hidden if hidden else None,
        }
        for key, value in sizes.items():
            if zero.get(key) == AUTO:
                if value is None:
                    del zero[key]  # DeepSpeed's own default
                else:
                    zero[key] = value
        _fill_nvme(zero, inputs)

    if zero_stage(cfg) == 3 and not problems:
        cfg[FROZEN_BASE_KEY] = frozen_base_mode(cfg, inputs)
        cfg[ADAPTER_STAGE_KEY] = adapter_stage(cfg)
        if cfg[ADAPTER_STAGE_KEY] < 3:
            _lower_stage(cfg, cfg[ADAPTER_STAGE_KEY])
    else:
        cfg.pop(FROZEN_BASE_KEY, None)  # only ZeRO-3 partitions parameters
        cfg.pop(ADAPTER_STAGE_KEY, None)

    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    total = cfg.get("train_batch_size")
    if (micro, accum) != (inputs.micro_batch_size, inputs.gradient_accumulation_steps):
        problems.append(
            "strategy_config: train_micro_batch_size_per_gpu/gradient_accumulation_steps "
            f"({micro}/{accum}) disagree with training_args per_device_train_batch_size/"
            f"gradient_accumulation_steps ({inputs.micro_batch_size}/"
            f"{inputs.gradient_accumulation_steps}); set them to auto"
        )
    elif total != expected_train_batch:
        problems.append(
            f"strategy_config.train_batch_size: {total} != micro batch {micro} x accumulation "
            f"{accum} x data-parallel size {inputs.dp_size} = {expected_train_batch}; "
            "set it to auto or fix the training_args"
        )
    leftovers = list(_auto_paths(cfg))
    if leftovers:
        problems.append(
            "strategy_config: no value known for "
            + ", ".join(leftovers)
            + "; replace 'auto' with a number"
        )
    if problems:
        raise DeepSpeedConfigError("\n".join(problems))
    return cfg


def fp16_train_problems(ds_config: Mapping[str, Any], where: str) -> list[str]:
    """Problems of a built training config (``build_deepspeed_config``'s output) with fp16 on:
    DeepSpeed 0.19's ``engine.backward`` scales the loss only for its ZeRO optimizers (stages
    1-3). At stage 0 its fp16 optimizer still divides the gradients by the loss scale at every
    step, so the update shrinks by ``2**initial_scale_power`` and an overflow is never seen
    (measured on the CPU accelerator: with ``initial_scale_power: 40`` the weights stayed
    unchanged and no step was skipped)."""
    if not (ds_config.get("fp16") or {}).get("enabled") or zero_stage(ds_config) != 0:
        return []
    return [
        f"{where}.fp16: fp16 training needs ZeRO stage 1, 2 or 3 (DeepSpeed scales the loss only "
        "for its ZeRO optimizers; at stage 0 the loss scale would shrink every update); use "
        "${deepspeed_zero2} or ${deepspeed_zero3}, or model_args.dtype: bf16"
    ]


HALF_PRECISIONS = ("bf16", "fp16")


def precision_problems(
    ds_config: Mapping[str, Any], where: str, role: str, dtype: str
) -> list[str]:
    """A ``bf16`` / ``fp16`` section whose explicit ``enabled`` disagrees with the role's
    ``model_args.dtype``. ``build_deepspeed_config`` trains in the dtype's precision, but an
    explicit ``enabled: true`` of another one wins: a bf16 preset under an fp32 model trains in
    bf16 while the config (and an fp32 rollout engine) says fp32, and the trainer's log-probs
    drift from the engine's far beyond fp32's gap. An explicit ``enabled: false`` under that
    dtype is overridden. ``auto`` follows the dtype. Both enabled: ``check_deepspeed_config``."""
    on = {name: (ds_config.get(name) or {}).get("enabled") for name in HALF_PRECISIONS}
    if all(value is True for value in on.values()):
        return []  # reported by check_deepspeed_config
    dtype_field = f"{role}.model_args.dtype"
    problems = []
    for name, enabled in on.items():
        if enabled is True and dtype != name:
            problems.append(
                f"{where}.{name}.enabled: true trains {role} in {name}, but {dtype_field} is "
                f"{dtype}: the weights are cast to {name} for every forward and backward while "
                f"the config (and a rollout engine in {dtype}) says {dtype}, so the trainer's "
                f"log-probs drift from the engine's; align them: {name}.enabled: auto (follows "
                f"the dtype) or {dtype_field}: {name} (with actor_infer.model_args.dtype to match)"
            )
        elif enabled is False and dtype == name:
            problems.append(
                f"{where}.{name}.enabled: false, but {dtype_field} is {name}, which trains in "
                f"{name} whatever enabled says; set {name}.enabled: auto, or {dtype_field}: fp32 "
                "to train in fp32"
            )
    return problems


def _fill_nvme(zero: dict[str, Any], inputs: DeepSpeedInputs) -> None:
    """The NVMe sections' ``"auto"``: the role's directory, a swap buffer holding the largest
    parameter's partition (unknown ones stay ``"auto"`` and are reported)."""
    for key in OFFLOAD_SECTIONS:
        section = zero.get(key)
        if isinstance(section, dict) and section.get("nvme_path") == AUTO and inputs.nvme_dir:
            section["nvme_path"] = inputs.nvme_dir
    param = zero.get("offload_param")
    if isinstance(param, dict) and param.get("buffer_size") == AUTO:
        if inputs.largest_numel is not None:
            param["buffer_size"] = -(-inputs.largest_numel // inputs.dp_size)
        elif param.get("device") != "nvme":
            del param["buffer_size"]  # unused without NVMe


def frozen_base_mode(ds_config: Mapping[str, Any], inputs: DeepSpeedInputs) -> str:
    """``whole`` or ``partitioned``: where a stage-3 config keeps the frozen base (module doc).
    Without LoRA there is no frozen base: always ``partitioned``."""
    mode = ds_config.get(FROZEN_BASE_KEY, AUTO)
    if not inputs.lora:
        return "partitioned"
    if mode != AUTO:
        return mode
    if "offload_param" in offload_devices(ds_config):
        return "partitioned"  # offloaded parameters ask for the least device memory
    if inputs.frozen_base_bytes is None or inputs.rank_memory_bytes is None:
        return "partitioned"
    budget = FROZEN_BASE_BUDGET_FRACTION * inputs.rank_memory_bytes
    return "whole" if inputs.frozen_base_bytes <= budget else "partitioned"


def adapter_stage(ds_config: Mapping[str, Any]) -> int:
    """1, 2 or 3: the stage that trains a LoRA adapter under a stage-3 config whose frozen base
    is resolved (module doc). ``auto``: 1 when the base is whole, 2 if the optimizer is
    offloaded."""
    whole = ds_config.get(FROZEN_BASE_KEY) == "whole"
    stage = ds_config.get(ADAPTER_STAGE_KEY, AUTO)
    if stage != AUTO:
        return int(stage)
    if not whole:
        return 3
    return 2 if "offload_optimizer" in offload_devices(ds_config) else 1


def _lower_stage(cfg: dict[str, Any], stage: int) -> None:
    """Make a stage-3 config whose base is whole a stage-``stage`` one (its stage-3 knobs
    dropped)."""
    zero = cfg["zero_optimization"]
    zero["stage"] = stage
    for key in [k for k in zero if k.startswith("stage3_") or k == "sub_group_size"]:
        del zero[key]


def frozen_base_whole(ds_config: Mapping[str, Any]) -> bool:
    """Whether a config built by ``build_deepspeed_config`` keeps the frozen base whole."""
    return ds_config.get(FROZEN_BASE_KEY) == "whole"


def _fill(section: dict[str, Any], key: str, value: Any) -> None:
    if section.get(key, AUTO) == AUTO:
        section[key] = value


def _auto_paths(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_paths(value, f"{prefix}.{key}" if prefix else str(key))
    elif node == AUTO:
        yield prefix
