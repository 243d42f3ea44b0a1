"""Adapter-only sync for LoRA policies (``weight_sync.lora_sync: adapter``).

With ``lora_sync: merged`` (the default) every sync gathers the full model from the ZeRO shards
and reloads it into vLLM with the adapter merged in. Under LoRA the base weights never change,
so with ``adapter`` the rollout engine keeps the base it loaded at start-up and each sync ships
only the adapter (rank x (in + out) per adapted layer: ~1-2 % of the model at r16); vLLM serves
base + adapter through its LoRA kernels (``enable_lora``).

The trainer publishes the adapter tensors under the names peft saves them with, through the
configured transport like any other weights. The receiving side writes them as a peft adapter
directory (``adapter_model.safetensors`` + ``adapter_config.json``, the trainer's own config)
in a fresh version directory, and the rollout strategy registers that directory with vLLM as a
new LoRA, dropping the previous one (``AdapterVersions``).

Importing this module must not import vLLM (vLLM's worker extension uses it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LORA_SYNC_MODES = ("merged", "adapter")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def check_lora_sync(mode: str) -> str:
    if mode not in LORA_SYNC_MODES:
        raise ValueError(
            f"weight_sync.lora_sync: unknown mode {mode!r}; valid: {', '.join(LORA_SYNC_MODES)}"
        )
    return mode


def write_adapter(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: Mapping[str, Any],
    directory: str,
) -> dict[str, Any]:
    """Write one peft adapter directory from the received tensors (``directory`` must not
    exist; it appears complete or not at all). Returns ``num_tensors`` / ``bytes`` /
    ``seconds``."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    # copies: a transport may reuse its receive buffer for the next bucket
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
    if not tensors:
        raise RuntimeError("adapter sync received no tensors")
    not_lora = [n for n in tensors if "lora_" not in n]
    if not_lora:
        raise RuntimeError(
            f"adapter sync received non-adapter tensors (e.g. {not_lora[0]!r}): the trainer "
            "sent merged weights; both sides must use the same weight_sync.lora_sync"
        )
    partial = f"{directory}.partial"
    os.makedirs(partial)
    save_file(tensors, os.path.join(partial, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(partial, ADAPTER_CONFIG), "w") as f:
        json.dump(dict(config), f, indent=1)
    os.replace(partial, directory)
    return {
        "num_tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "seconds": time.perf_counter() - start,
    }


class AdapterVersions:
    """Version directories of the synced adapter under one temporary root: ``next_dir()`` for
    the sync being received, ``commit()`` once the engine has it (the previous version's
    directory is removed then), ``close()`` removes everything."""

    def __init__(self, config: Mapping[str, Any], root: str | None = None) -> None:
        self.config = dict(config)
        self.root = root or tempfile.mkdtemp(prefix="roll_ds_adapter_")
        self.version = 0  # committed version; 0: none yet

    def next_dir(self) -> str:
        return os.path.join(self.root, f"v{self.version + 1:06d}")

    def commit(self) -> int:
        """Make ``next_dir()`` the current version; returns its number (a LoRA id >= 1)."""
        previous = os.path.join(self.root, f"v{self.version:06d}")
        self.version += 1
        if self.version > 1:
            shutil.rmtree(previous, ignore_errors=True)
        return self.version

    @property
    def current_dir(self) -> str:
        return os.path.join(self.root, f"v{self.version:06d}")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
