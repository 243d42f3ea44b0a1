"""Full HF-named weights out of a (ZeRO-3 partitioned, LoRA-wrapped) model: size-bounded buckets
for weight sync, and safetensors shards for export.

Every rank of the data-parallel group must iterate ``iter_weight_buckets`` to the end together:
under ZeRO-3 each bucket is one ``GatheredParameters`` all-gather that all ranks join.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from roll_ds.models.lora import WeightUnit, weight_units

Bucket = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
EXPORT_BUCKET_BYTES = 256 * 2**20  # gathered at a time while exporting

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _gathered(params: list[torch.nn.Parameter]):
    import deepspeed

    zero3 = [p for p in params if hasattr(p, "ds_id")]
    return deepspeed.zero.GatheredParameters(zero3, modifier_rank=None, enabled=bool(zero3))


def _chunks(items: Iterable[T], nbytes: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """``items`` in consecutive lists of at most ``limit`` bytes (an item larger than that gets
    a list of its own)."""
    if limit <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {limit}")
    pending: list[T] = []
    size = 0
    for item in items:
        if pending and size + nbytes(item) > limit:
            yield pending
            pending, size = [], 0
        pending.append(item)
        size += nbytes(item)
    if pending:
        yield pending


def iter_weight_buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    """Lists of ``(hf_name, full tensor)`` of at most ``bucket_bytes`` each (a single tensor
    larger than that gets a bucket of its own). Tensors are fresh copies: the training
    parameters are never exposed, and LoRA layers come merged (``W + B @ A * scale``)."""
    for units in _chunks(weight_units(model), lambda u: u.nbytes, bucket_bytes):
        yield _materialise(units)


def sync_numels(model: torch.nn.Module, *, adapter_only: bool) -> dict[torch.dtype, int]:
    """Elements by dtype of what one sync sends, without gathering anything: every HF weight
    (``iter_weight_buckets``; a tied output embedding travels once, as an alias) or, with
    ``adapter_only``, the trainable adapter parameters (``iter_adapter_buckets``)."""
    if adapter_only:
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        params = [unit.params[0] for unit in weight_units(model)]  # the produced weight's own
    counts: dict[torch.dtype, int] = {}
    for p in params:
        counts[p.dtype] = counts.get(p.dtype, 0) + int(getattr(p, "ds_numel", p.numel()))
    return counts


def gathered_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of a peft model's trainable (adapter) parameters under their parameter names,
    gathered under ZeRO-3 (every rank calls this together)."""
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(_on_nvme(p) for _, p in lora):  # one swap buffer per gathered parameter: one at a time
        state = {}
        for n, p in lora:
            with torch.no_grad(), _gathered([p]):
                state[n] = p.detach().to("cpu").clone()
        return state
    with torch.no_grad(), _gathered([p for _, p in lora]):
        return {n: p.detach().to("cpu").clone() for n, p in lora}


def iter_adapter_buckets(model: torch.nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    """A peft model's LoRA adapter alone, under the names peft saves it with, in buckets of at
    most ``bucket_bytes`` (one ZeRO-3 gather of all adapter parameters, on the first bucket)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=gathered_adapter_state(model))
    yield from _chunks(state.items(), _item_nbytes, bucket_bytes)


def _item_nbytes(item: tuple[str, torch.Tensor]) -> int:
    return item[1].numel() * item[1].element_size()


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """A peft model's ``LoraConfig`` as plain JSON (``adapter_config.json``'s content, target
    modules resolved to names)."""
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=sorted))  # sets -> sorted lists


def _on_nvme(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 parameter whose partition ZeRO-Infinity swaps to NVMe (``offload_param``)."""
    location = getattr(getattr(param, "ds_tensor", None), "final_location", None)
    return location is not None and str(getattr(location, "value", location)) == "nvme"


def _materialise(units: list[WeightUnit]) -> Bucket:
    params = list({id(p): p for u in units for p in u.params}.values())
    if any(_on_nvme(p) for p in params):
        # ZeRO-Infinity swaps each gathered parameter in through one of offload_param's
        # buffer_count buffers: a bucket of many (a 256 MB bucket of a 3B model holds a dozen)
        # fails ("Not enough buffers 5 for swapping 6"), so gather one unit (a layer's few
        # tensors) at a time; the bucket is the same, built from more, smaller all-gathers.
        bucket: Bucket = []
        for unit in units:
            with torch.no_grad(), _gathered(list(unit.params)):
                bucket.extend(unit.produce())
        return bucket
    with torch.no_grad(), _gathered(params):
        return [item for u in units for item in u.produce()]


def save_hf_weights(
    buckets: Iterator[Bucket],
    out_dir: str,
    *,
    write: bool,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Stream buckets into ``model-XXXXX.safetensors`` shards (+ index when sharded).

    Ranks with ``write=False`` still consume the iterator (they take part in the gathers). A
    tensor yielded twice under two names (a tied output embedding) is written once, as
    transformers does; loaders re-tie it from ``tie_word_embeddings``.
    """
    from safetensors.torch import save_file

    current: dict[str, torch.Tensor] = {}
    current_bytes = 0
    files: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            path = os.path.join(out_dir, f"model-{len(files) + 1:05d}.safetensors")
            save_file(current, path, metadata={"format": "pt"})
            files.append(path)
            current, current_bytes = {}, 0

    for bucket in buckets:
        if not write:
            continue
        seen: set[int] = set()  # aliases arrive in the same bucket, alive while it is
        for name, tensor in bucket:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            nbytes = tensor.numel() * tensor.element_size()
            if current and current_bytes + nbytes > max_shard_bytes:
                flush()
            current[name] = tensor.detach().to("cpu").contiguous()
            current_bytes += nbytes
            weight_map[name] = f"model-{len(files) + 1:05d}.safetensors"
    if not write:
        return []
    flush()
    return _finish_shards(out_dir, files, weight_map)


def _finish_shards(out_dir: str, files: list[str], weight_map: dict[str, str]) -> list[str]:
    if len(files) == 1:
        single = os.path.join(out_dir, "model.safetensors")
        os.replace(files[0], single)
        return [single]
    renamed = []
    n = len(files)
    for i, path in enumerate(files, start=1):
        target = os.path.join(out_dir, f"model-{i:05d}-of-{n:05d}.safetensors")
        os.replace(path, target)
        renamed.append(target)
    index = {
        "metadata": {"total_size": sum(os.path.getsize(p) for p in renamed)},
        "weight_map": {
            k: v.replace(".safetensors", f"-of-{n:05d}.safetensors") for k, v in weight_map.items()
        },
    }
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return renamed


def write_hf_model(
    module: torch.nn.Module,
    out_dir: str,
    *,
    source_dir: str,
    write: bool,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """An HF model directory from ``module`` (LoRA merged): safetensors shards, ``config.json``,
    the tokenizer files of ``source_dir`` and a generation config (``source_dir``'s, else the
    model's). Under ZeRO-3 every rank calls this together; only ``write=True`` writes."""
    from roll_ds.models.lora import hf_model_of

    buckets = iter_weight_buckets(module, bucket_bytes=EXPORT_BUCKET_BYTES)
    save_hf_weights(buckets, out_dir, write=write, max_shard_bytes=max_shard_bytes)
    if not write:
        return
    hf = hf_model_of(module)
    hf.config.save_pretrained(out_dir)
    copied = copy_tokenizer_files(source_dir, out_dir)
    generation = getattr(hf, "generation_config", None)
    if "generation_config.json" not in copied and generation is not None:
        generation.save_pretrained(out_dir)


def write_adapter(
    module: torch.nn.Module, adapter_dir: str, *, write: bool, base_model: str | None = None
) -> None:
    """A peft model's adapter as a peft adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``); under ZeRO-3 every rank calls this together.
    ``base_model``: what ``adapter_config.json`` records as ``base_model_name_or_path``, the
    ``pretrain`` as configured (peft would record the directory the base was loaded from: for
    an ``embedded:`` model an absolute path inside the install, wrong on any other machine)."""
    state = gathered_adapter_state(module)
    if write:
        module.save_pretrained(adapter_dir, state_dict=state, safe_serialization=True)
        if base_model is not None:
            config = Path(adapter_dir) / "adapter_config.json"
            data = json.loads(config.read_text())
            data["base_model_name_or_path"] = base_model
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def copy_tokenizer_files(src_dir: str, out_dir: str) -> list[str]:
    """Copy tokenizer (and generation config) files a model directory ships, if any."""
    copied = []
    if not os.path.isdir(src_dir):
        return copied
    for name in TOKENIZER_FILES:
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, name))
            copied.append(name)
    return copied
