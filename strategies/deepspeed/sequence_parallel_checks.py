"""Config checks of ``sequence_parallel_size`` (``strategies/deepspeed/sequence_parallel.py``),
reached through the ``sequence_parallel`` component check before any actor starts. Light: no
torch, DeepSpeed or transformers import; the head counts come from the model's config.json.

What Ulysses needs, each refused by name with its fix: a role that computes log-probs with a
DeepSpeed strategy (actor_train on ``deepspeed_train``, reference on ``deepspeed_infer`` or
``deepspeed_train``; the critic's value head, reward models and ``hf_infer`` / vLLM have none),
a world size the SP size divides (groups of consecutive ranks), attention heads and key-value
heads it divides (each rank attends with its share of both), and an attention implementation
that needs no 4D mask (sdpa or fa2: eager's mask would be the whole sequence's, per rank).
Lengths need no setting: each micro-batch's columns are padded to a multiple of the SP size.
"""

from __future__ import annotations

import json
import os

from roll_ds.config.role_placement import placement, role_configs
from roll_ds.config.schema import RLVRConfig, WorkerConfig

SP_ROLES = ("actor_train", "reference")
SP_STRATEGIES = ("deepspeed_train", "deepspeed_infer")
# model_args.attn_implementation values Ulysses runs (None: transformers' default, sdpa)
SP_ATTENTION = (None, "sdpa", "fa2", "flash_attention_2")


def sequence_parallel_problems(cfg: RLVRConfig, *, check_files: bool = True) -> list[str]:
    """Every role's ``sequence_parallel_size`` against its role, strategy, world size,
    attention and (``check_files``) its model's head counts."""
    problems = []
    for name, role in role_configs(cfg):
        size = role.sequence_parallel_size
        if size == 1 or not isinstance(size, int) or size < 1:
            continue  # 1: off; below 1: the field's range check reports it
        problems += role_problems(name, role, size)
        if check_files:
            path = role.model_args.model_name_or_path or cfg.pretrain
            problems += head_problems(name, size, model_config(path))
    return problems


def role_problems(name: str, role: WorkerConfig, size: int) -> list[str]:
    field = f"{name}.sequence_parallel_size"
    if name not in SP_ROLES:
        return [
            f"{field}: {size}, but only {' and '.join(SP_ROLES)} run sequence parallelism (it "
            "splits the log-prob forwards; the critic's values and reward scores are not "
            f"split); set it to 1"
        ]
    strategy = role.strategy_args.strategy_name
    if strategy not in SP_STRATEGIES:
        return [
            f"{field}: {size}, but strategy {strategy!r} has no sequence parallelism; set "
            f"{name}.strategy_args.strategy_name to one of {', '.join(SP_STRATEGIES)} (with a "
            "DeepSpeed strategy_config), or sequence_parallel_size: 1"
        ]
    problems = []
    try:
        world = placement(name, role).world_size
    except ValueError:
        world = None  # reported by the placement check
    if world is not None and world % size:
        problems.append(
            f"{field}: {size} does not divide the role's world size {world} (SP groups are "
            f"consecutive ranks); set it to a divisor of {world}, or change "
            f"{name}.device_mapping"
        )
    attn = role.model_args.attn_implementation
    if attn not in SP_ATTENTION:
        problems.append(
            f"{field}: {size} with attention {attn!r}, which needs a 4D attention mask over the "
            f"whole sequence on every rank; set {name}.model_args.attn_implementation: sdpa (or "
            "fa2 on GPUs), or sequence_parallel_size: 1"
        )
    return problems


def head_problems(name: str, size: int, config: dict | None) -> list[str]:
    """Heads the SP size must divide (``config``: the model's config.json, None: unreadable,
    reported by the model path checks)."""
    if config is None:
        return []
    text = config.get("text_config") or config  # multimodal configs nest the LM's
    problems = []
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = text.get(key, text.get("num_attention_heads"))
        if isinstance(heads, int) and heads % size:
            problems.append(
                f"{name}.sequence_parallel_size: {size} does not divide the model's {key} "
                f"({heads}): each rank attends with 1/{size} of the heads; set it to a divisor "
                f"of {heads}"
            )
    return problems


def model_config(path: str | None) -> dict | None:
    """The config.json of a local or embedded model; None when there is none to read."""
    from roll_ds.models.shipped import EMBEDDED_PREFIX, resolve_embedded

    if not path:
        return None
    try:
        model_dir = resolve_embedded(path) if path.startswith(EMBEDDED_PREFIX) else path
    except (ValueError, FileNotFoundError):
        return None
    file = os.path.join(model_dir, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)
