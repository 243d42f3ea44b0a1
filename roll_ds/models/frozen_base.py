"""A LoRA model's frozen base kept out of ZeRO-3 (``zero3_frozen_base: whole``).

ZeRO-3 partitions every ``nn.Parameter`` of the module it wraps and all-gathers it around every
forward and backward, and again after every optimizer step and cache release, frozen or not.
DeepSpeed has no switch that leaves some parameters whole: its persistence threshold keeps them
gathered between passes but still re-partitions them at every optimizer step and cache release
and gathers them again, which measured no faster than partitioning, while this is ~0.8x of it
(benchmarks/zero3_frozen_base.py; figures in examples/config/deepspeed_zero3.yaml). So the frozen
weights stop being parameters: each becomes a non-persistent buffer of its module under the same
name (``F.linear(x, self.weight)`` reads it the same way), listed in the module's
``FROZEN_NAMES`` attribute (a name survives ``.to()``, which replaces buffer tensors), and ZeRO-3
partitions only the adapter. Non-persistent: a ``state_dict`` (hence a DeepSpeed checkpoint)
leaves them out, as ``exclude_frozen_parameters`` leaves out frozen parameters.

``named_weights`` lists parameters and these buffers together, in ``named_parameters`` order,
for whatever produces full weights (sync, export).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

FROZEN_NAMES = "_roll_ds_frozen_base"  # module attribute: its buffers that are frozen weights


def keep_frozen_base_whole(model: torch.nn.Module, device: torch.device | None = None) -> int:
    """Move ``model`` to ``device`` (first: moving buffers later would untie a tied weight),
    then turn every parameter that does not require grad into a buffer (before
    ``deepspeed.initialize``; a tied weight stays one tensor). Returns how many moved."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError("the frozen base is already ZeRO-3 partitioned; load it whole")
    if device is not None:
        model.to(device)
    whole: dict[int, torch.Tensor] = {}  # parameter id -> its buffer (tied weights: one)
    for module in model.modules():
        names = []
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad:
                continue
            whole.setdefault(id(param), param.data)
            del module._parameters[name]
            module.register_buffer(name, whole[id(param)], persistent=False)
            names.append(name)
        if names:
            setattr(module, FROZEN_NAMES, (*getattr(module, FROZEN_NAMES, ()), *names))
    return len(whole)


def frozen_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s own (not its children's) frozen weights kept whole."""
    return [(n, module._buffers[n]) for n in getattr(module, FROZEN_NAMES, ())]


def count_frozen_whole(model: torch.nn.Module) -> int:
    """Frozen weights of ``model`` kept whole (a tied weight once)."""
    return len({id(t) for m in model.modules() for _, t in frozen_buffers(m)})


def named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_parameters()`` plus the frozen-base buffers, module by module in registration
    order, each tensor once (a tied weight under its first name)."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        local = list(module._parameters.items()) + frozen_buffers(module)
        for name, tensor in local:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield (f"{prefix}.{name}" if prefix else name), tensor


def move_frozen_base(model: torch.nn.Module, device: torch.device | str) -> int:
    """Move the frozen weights kept whole to ``device`` in place (``tensor.data`` swapped, so a
    tied weight stays one tensor in every module holding it); pinned when ``device`` is the
    CPU and CUDA is there, for a fast way back. Returns the bytes moved. Colocated trainers
    call it around generation (``offload_states``): DeepSpeed's offload moves only the states
    it owns, and these weights are not among them."""
    device = torch.device(device)
    moved, seen = 0, set()
    for module in model.modules():
        for _, tensor in frozen_buffers(module):
            if id(tensor) in seen or tensor.device == device:
                continue
            seen.add(id(tensor))
            data = tensor.data.to(device)
            if device.type == "cpu" and torch.cuda.is_available():
                data = data.pin_memory()
            tensor.data = data
            moved += data.numel() * data.element_size()
    return moved
