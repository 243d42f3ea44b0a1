"""Hugging Face model directories of a trained policy, from a run or from any checkpoint.

A run writes them itself (``export:`` in the config): ``<output_dir>/<exp_name>/hf/step_NNNNNN/``
holds the merged weights (safetensors), ``config.json``, the tokenizer files and the generation
config of ``pretrain``, and loads in plain transformers and vLLM; under LoRA ``adapter/`` beside
them is a peft adapter over ``pretrain``. Afterwards, any checkpoint converts without Ray or a
process group::

    python -m roll_ds.export output/rlvr_lora_zero3/checkpoints/step_000020 --out DIR
    python -m roll_ds.export output/rlvr_lora_zero3/checkpoints --out DIR   # the newest one
    python -m roll_ds.export CHECKPOINT --out DIR --adapter-only            # LoRA: peft adapter

The converter consolidates the ZeRO-3 shards of ``actor_train`` with DeepSpeed's ``zero_to_fp32``
(the fp32 master weights; ZeRO 0-2 checkpoints hold the module itself). Under LoRA
the checkpoint holds only the adapter (frozen parameters are not saved): the base model comes from
the ``pretrain`` the checkpoint's ``export_info.json`` records (``--base`` overrides it), and the
weights are merged exactly as the run's own export merges them (``roll_ds.models.weights``).

Every directory is written as ``<dir>.partial`` and renamed into place once complete and
fsynced, so a reader never sees half an export. DeepSpeed checkpoints are pickles: convert only
checkpoints you trust (resuming from one runs the same risk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll_ds.checkpoint import (
    COMPLETE,
    LATEST,
    OLD,
    PARTIAL,
    STATE_FILE,
    CheckpointManager,
    _fsync_dir,
    _fsync_tree,
    step_name,
)

if TYPE_CHECKING:
    import torch

    from roll_ds.config.schema import RLVRConfig

EXPORT_INFO = "export_info.json"
HF_DIR = "hf"
ADAPTER_DIR = "adapter"
ROLE = "actor_train"
ENGINE_TAG = "engine"  # the DeepSpeed tag RLVRPipeline.save_checkpoint saves under


@dataclass(frozen=True)
class ExportInfo:
    """What a checkpoint needs beyond its DeepSpeed state to become an HF model: the base model
    (as configured, and where it was found at save time), the training dtype and, under LoRA,
    the adapter's settings (``roll_ds.models.loading.apply_lora`` arguments)."""

    base_model: str
    base_model_path: str
    dtype: str = "fp32"
    lora: dict[str, Any] | None = None
    role: str = ROLE
    tag: str = ENGINE_TAG

    @classmethod
    def from_config(cls, cfg: RLVRConfig, model_dir: str) -> ExportInfo:
        """The policy of ``cfg``; ``model_dir`` is where the run resolved ``pretrain``."""
        from roll_ds.models.loading import resolve_model_path

        args = cfg.actor_train.model_args
        base = args.model_name_or_path or cfg.pretrain
        path = resolve_model_path(args.model_name_or_path) if args.model_name_or_path else model_dir
        lora = None
        if args.lora_rank is not None:
            lora = {
                "rank": args.lora_rank,
                "alpha": args.lora_alpha,
                "dropout": args.lora_dropout,
                "target": args.lora_target,
            }
        absolute = os.path.abspath(path) if os.path.isdir(path) else path
        return cls(base_model=base, base_model_path=absolute, dtype=args.dtype, lora=lora)

    def save(self, directory: str | Path) -> None:
        (Path(directory) / EXPORT_INFO).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ExportInfo:
        path = Path(directory) / EXPORT_INFO
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was saved by a roll_ds without export "
                "support; no record says which base model and LoRA settings it was trained with"
            )
        data = json.loads(path.read_text())
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def base_dir(self, override: str | None = None) -> str:
        """The base model directory: ``override``, else the embedded model (resolved on this
        machine), else the recorded path if it exists, else the configured name."""
        from roll_ds.models.loading import EMBEDDED_PREFIX, resolve_model_path

        if override:
            return resolve_model_path(override)
        if self.base_model.startswith(EMBEDDED_PREFIX):
            return resolve_model_path(self.base_model)
        if os.path.isdir(self.base_model_path):
            return self.base_model_path
        return self.base_model


# ---------------------------------------------------------------------------------------------
# atomic directories


def hf_step_dir(run_dir: str | Path, step: int) -> Path:
    """Where a run exports the policy after ``step`` train steps."""
    return Path(run_dir) / HF_DIR / step_name(step)


def begin_dir(final: str | Path) -> Path:
    """An empty ``<final>.partial`` to write into (what an interrupted write left there is
    deleted)."""
    final = Path(final)
    partial = final.with_name(final.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish_dir(partial: str | Path, final: str | Path) -> Path:
    """fsync ``partial`` and rename it to ``final``; an existing ``final`` (a step exported
    again after a resume) is renamed aside first and deleted after."""
    partial, final = Path(partial), Path(final)
    _fsync_tree(partial)
    aside = final.with_name(final.name + OLD)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def export_run_step(actor_train: Any, run_dir: str | Path, step: int) -> Path:
    """Export the trainer's current policy (the ``actor_train`` cluster: every rank joins, rank
    0 writes) to ``hf/step_NNNNNN`` of ``run_dir``; returns that directory."""
    final = hf_step_dir(run_dir, step)
    partial = begin_dir(final)
    actor_train.export_hf(str(partial))
    return publish_dir(partial, final)


# ---------------------------------------------------------------------------------------------
# checkpoint -> HF directory


def locate_checkpoint(path: str | Path) -> Path:
    """A complete pipeline checkpoint (``checkpoints/step_NNNNNN``) from itself or from the
    ``checkpoints`` directory (its newest complete one)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if (path / LATEST).is_file() and not (path / STATE_FILE).is_file():
        latest = CheckpointManager(path).latest()
        if latest is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint in it")
        return latest
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete roll_ds checkpoint (no {COMPLETE} marker); pass a "
            "checkpoints/step_NNNNNN directory or the checkpoints directory itself"
        )
    return path


def load_policy_state(engine_dir: str | Path, tag: str = ENGINE_TAG) -> dict[str, torch.Tensor]:
    """The module state a DeepSpeed engine saved under ``engine_dir/tag``, without a process
    group; only what was saved (under LoRA: the adapter). ZeRO-3 keeps it in shards, which
    DeepSpeed's ``zero_to_fp32`` consolidates (the fp32 master weights); ZeRO 0-2 save the module
    whole, in the training dtype, in ``mp_rank_00_model_states.pt``."""
    import contextlib

    import torch

    ds_dir = Path(engine_dir) / tag
    if not ds_dir.is_dir():
        raise FileNotFoundError(f"{ds_dir}: no DeepSpeed checkpoint {tag!r} there")
    if any(ds_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):  # ZeRO-3
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr):  # its progress prints
            return get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag=tag)
    states = ds_dir / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise FileNotFoundError(f"{ds_dir}: neither ZeRO-3 shards nor {states.name}")
    return torch.load(states, map_location="cpu", weights_only=False)["module"]


def build_policy(
    info: ExportInfo, state: Mapping[str, torch.Tensor], base: str | None = None
) -> torch.nn.Module:
    """The trained policy as a plain (peft-wrapped under LoRA) model on CPU: the base model, the
    LoRA layers of ``info``, the checkpoint's ``state`` loaded over them."""
    from roll_ds.models.loading import apply_lora, load_causal_lm
    from roll_ds.models.lora import is_lora_param

    model = load_causal_lm(info.base_dir(base), dtype=info.dtype)
    if info.lora is not None:
        model = apply_lora(model, **info.lora)
    result = model.load_state_dict(dict(state), strict=False)
    missing = list(result.missing_keys)
    if info.lora is not None:  # the frozen base is not in the checkpoint, its adapter must be
        missing = [k for k in missing if is_lora_param(k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint does not fit the model built from {info.base_dir(base)} "
            f"(lora={info.lora}): missing {missing[:5]} ({len(missing)}), unexpected "
            f"{list(result.unexpected_keys)[:5]} ({len(result.unexpected_keys)})"
        )
    return model.eval()


def convert_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    adapter_only: bool = False,
    base: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> dict[str, str]:
    """Write the policy of ``checkpoint`` (a pipeline checkpoint or the ``checkpoints``
    directory) to ``out``: an HF model directory (LoRA merged, plus ``adapter/`` under LoRA),
    or with ``adapter_only`` the peft adapter directory alone. Returns what was written."""
    from roll_ds.models.weights import write_adapter, write_hf_model

    ckpt = locate_checkpoint(checkpoint)
    info = ExportInfo.load(ckpt)
    if adapter_only and info.lora is None:
        raise ValueError(f"{ckpt} is a full fine-tune (no LoRA): there is no adapter to export")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not empty; remove it or pick another")
    model = build_policy(info, load_policy_state(ckpt / info.role, info.tag), base)
    partial = begin_dir(out)
    written: dict[str, str] = {}
    if adapter_only:
        write_adapter(model, str(partial), write=True, base_model=base or info.base_model)
        written["adapter"] = str(out)
    else:
        write_hf_model(
            model,
            str(partial),
            source_dir=info.base_dir(base),
            write=True,
            max_shard_bytes=max_shard_bytes,
        )
        written["model"] = str(out)
        if info.lora is not None:
            write_adapter(
                model, str(partial / ADAPTER_DIR), write=True, base_model=base or info.base_model
            )
            written["adapter"] = str(out / ADAPTER_DIR)
    if out.exists():  # empty
        out.rmdir()
    publish_dir(partial, out)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roll_ds.export",
        description="Convert a roll_ds checkpoint into a Hugging Face model directory (merged "
        "weights, config, tokenizer; under LoRA also adapter/), without Ray.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoints/step_NNNNNN directory, or checkpoints/ (the newest)"
    )
    parser.add_argument("--out", required=True, help="directory to create")
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA: write only the peft adapter directory (loads on the base model with peft)",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="base model directory (default: the pretrain the checkpoint records)",
    )
    args = parser.parse_args(argv)
    try:
        written = convert_checkpoint(
            args.checkpoint, args.out, adapter_only=args.adapter_only, base=args.base
        )
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"roll_ds.export: {exc}", file=sys.stderr)
        return 2
    for kind, path in written.items():
        print(f"roll_ds.export: {kind} written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
