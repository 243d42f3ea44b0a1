"""Map a (possibly peft-wrapped) model's parameters to HF names and merged weights.

A peft LoRA model names the frozen base weight ``...q_proj.base_layer.weight`` next to the
adapter's ``...q_proj.lora_A.default.weight`` / ``lora_B``; a served model (vLLM, plain
transformers) wants ``...q_proj.weight = W + B @ A * scale``. ``weight_units`` walks a model once
and returns, in parameter order, the units that produce those HF tensors, each with the
parameters it reads, so a caller can gather a ZeRO-3 partitioned model unit by unit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BASE_LAYER = ".base_layer."
LORA_MARKERS = (
    ".lora_A.",
    ".lora_B.",
    ".lora_embedding_A.",
    ".lora_embedding_B.",
    ".lora_magnitude",
)


@dataclass
class WeightUnit:
    """HF tensors produced from ``params`` (which must be gathered while ``produce`` runs)."""

    params: list[torch.nn.Parameter]
    produce: Callable[[], list[tuple[str, torch.Tensor]]]
    nbytes: int
    names: list[str] = field(default_factory=list)


def hf_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (LoRA layers injected), or ``model``."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return model
    return model.get_base_model() if isinstance(model, PeftModel) else model


def is_lora_param(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


def hf_param_name(name: str) -> str:
    """``model.layers.0.mlp.up_proj.base_layer.weight`` -> ``model.layers.0.mlp.up_proj.weight``."""
    return name.replace(BASE_LAYER, ".")


def _nbytes(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel())) * p.element_size()


def _module_by_name(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return dict(model.named_modules())


def weight_units(model: torch.nn.Module, adapter: str = "default") -> list[WeightUnit]:
    """Units producing every HF weight of ``model`` with LoRA merged; a tied output embedding is
    produced a second time under its own name (``lm_head.weight``), as vLLM requires."""
    from peft.tuners.lora import LoraLayer

    from roll_ds.models.frozen_base import named_weights

    hf = hf_model_of(model)
    modules = _module_by_name(hf)
    units: list[WeightUnit] = []
    for name, param in named_weights(hf):  # a frozen base kept whole is buffers: those too
        if is_lora_param(name):
            continue
        out_name = hf_param_name(name)
        owner_name, _, attr = name.rpartition(".")
        owner = modules.get(owner_name.removesuffix(".base_layer"))
        if BASE_LAYER in name and attr == "weight" and isinstance(owner, LoraLayer):
            units.append(_merged_unit(owner, param, out_name, adapter))
        else:
            units.append(
                WeightUnit(
                    [param],
                    lambda n=out_name, p=param: [(n, p.detach().clone())],
                    _nbytes(param),
                    [out_name],
                )
            )
    _add_tied_output(hf, units)
    return units


def _merged_unit(layer, weight, out_name: str, adapter: str) -> WeightUnit:
    if adapter not in layer.lora_A:
        return WeightUnit(
            [weight], lambda: [(out_name, weight.detach().clone())], _nbytes(weight), [out_name]
        )
    lora_a, lora_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight

    def produce() -> list[tuple[str, torch.Tensor]]:
        delta = layer.get_delta_weight(adapter)
        return [(out_name, (weight.detach() + delta.to(weight.dtype)).detach())]

    return WeightUnit([weight, lora_a, lora_b], produce, _nbytes(weight), [out_name])


def _add_tied_output(hf: torch.nn.Module, units: list[WeightUnit]) -> None:
    """Re-emit a tied input embedding under the output head's name (omitted by
    ``named_parameters``, which drops shared parameters)."""
    get_in = getattr(hf, "get_input_embeddings", None)
    get_out = getattr(hf, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return
    emb, head = get_in(), get_out()
    if emb is None or head is None or head.weight is not emb.weight:
        return
    head_name = next(n for n, m in hf.named_modules(remove_duplicate=False) if m is head)
    out_name = f"{head_name}.weight"
    for unit in units:
        if any(p is emb.weight for p in unit.params):
            inner = unit.produce

            def produce(inner=inner) -> list[tuple[str, torch.Tensor]]:
                produced = inner()
                return [*produced, (out_name, produced[0][1])]  # same tensor, second name

            unit.produce = produce
            unit.names.append(out_name)
            return
