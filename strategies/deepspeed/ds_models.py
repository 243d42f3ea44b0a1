"""A role's DeepSpeed config checked with DeepSpeed's own config models, in the driver, before any
actor starts.

DeepSpeed validates its sections with pydantic models that forbid unknown keys and check types
(``DeepSpeedZeroConfig`` for ``zero_optimization`` with its offload sections, the precision and
monitor sections, ...), but only inside ``deepspeed.initialize``: a misspelt key in a preset
(``stage3_prefech_bucket_size``) or a wrong type (``overlap_comm: "yes"``) surfaced after every
actor had started. Here the same models see the same sections first, and each error names the
key, the preset it came from and the fix (the nearest known key for a misspelling).

The hand-written checks of ``roll_ds/config/deepspeed.py`` stay: they run without DeepSpeed
(``roll_ds/config`` imports no torch) and know what DeepSpeed does not (stages against offload,
minimums with their meaning). This module imports DeepSpeed, so validation calls it only with
``check_files`` (the checks that read the installed world: files, the disk, libraries).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

AUTO = "auto"


def _section_models() -> dict[str, Callable[..., Any]]:
    """Top-level section -> DeepSpeed's model for it (what ``DeepSpeedConfig`` builds it with)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
        "comms_logger": CommsLoggerConfig,
    }


def _without_auto(value: Any) -> Any:
    """``"auto"`` values dropped at every depth: roll_ds fills them when it builds the config
    (DeepSpeed's models drop them only at a model's top level)."""
    if isinstance(value, Mapping):
        return {k: _without_auto(v) for k, v in value.items() if v != AUTO}
    return value


def _known_keys(model: Any, loc: tuple) -> list[str]:
    """The keys the (nested) model at ``loc`` accepts: field names and their aliases."""
    for key in loc[:-1]:
        field = model.model_fields.get(key) or next(
            (f for f in model.model_fields.values() if f.alias == key), None
        )
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if hasattr(c, "model_fields")), None)
        if model is None:
            return []
    names = [f.alias or n for n, f in model.model_fields.items()]
    return [n for n in names if not n.startswith("_")]


def _line(field: str, section: str, model: Any, error: Mapping[str, Any], origin: str) -> str:
    loc = tuple(str(p) for p in error["loc"])
    key = ".".join((section, *loc))
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], _known_keys(model, loc), n=1, cutoff=0.75)
        fix = f"did you mean {close[0]}?" if close else "remove it (DeepSpeed has no such key)"
        return f"{field}.{key}: DeepSpeed does not know this key{origin}; {fix}"
    return (
        f"{field}.{key}: {error['msg']} (got {error.get('input')!r}){origin}; DeepSpeed "
        f"{_version()} refuses it at engine start"
    )


def _version() -> str:
    import deepspeed

    return deepspeed.__version__


def _checked_by_roll_ds(section: str, error: Mapping[str, Any]) -> bool:
    """A wrong value of a key roll_ds's own checks read (``MIN_VALUES``, ``BOOL_KEYS``): already
    reported, with its meaning."""
    from roll_ds.config.deepspeed import BOOL_KEYS, MIN_VALUES

    key = ".".join((section, *(str(p) for p in error["loc"])))
    return error["type"] != "extra_forbidden" and (key in MIN_VALUES or key in BOOL_KEYS)


def deepspeed_model_problems(
    ds_config: Mapping[str, Any], field: str, preset: str | None = None
) -> list[str]:
    """Problems DeepSpeed's own models find in ``ds_config``'s sections (``field``: the config's
    name in the run's config; ``preset``: the preset it came from, when known)."""
    from pydantic import ValidationError

    origin = f" (from the preset {preset})" if preset else ""
    problems = []
    for section, model in _section_models().items():
        value = ds_config.get(section)
        if not isinstance(value, Mapping):
            continue  # absent, or not a mapping: roll_ds's own checks say so
        try:
            model(**_without_auto(value))
        except ValidationError as exc:
            problems += [
                _line(field, section, model, e, origin)
                for e in exc.errors()
                if not _checked_by_roll_ds(section, e)
            ]
        except (ValueError, TypeError, AssertionError) as exc:  # a model's own validator
            problems.append(f"{field}.{section}: {exc}{origin}")
    return problems
