"""A role's ``max_tokens_per_micro_batch`` and ``use_sequence_packing`` (strategies/
micro_batches.py): read by the backends that say so (``StrategySpec.token_micro_batches``), a
budget that holds the longest sequence, and an attention implementation that masks packed
sequences apart (``packing_warnings``: and one that makes packing pay)."""

from __future__ import annotations

from roll_ds.config.checks.lengths import longest_sequence
from roll_ds.config.schema import RLVRConfig, WorkerConfig
from roll_ds.config.strategies import STRATEGY_SPECS

# model_args.attn_implementation values whose attention keeps packed sequences apart given
# restarting position ids and attention_mask=None: eager and sdpa through the block-diagonal
# mask transformers builds from the position ids (masking_utils.find_packed_sequence_indices),
# fa2 (flash_attention_2) through flash-attn's varlen kernel fed by the same position ids; None
# is transformers' default, sdpa (eager where sdpa is missing). An implementation added to the
# schema's ATTN_IMPLEMENTATIONS is refused for packing until it is shown to do this.
PACKING_ATTENTION = (None, "eager", "sdpa", "fa2", "flash_attention_2")
# The roles whose passes go by micro-batches of the rollout batch.
ROLES = ("actor_train", "reference", "critic")


def micro_batch_problems(cfg: RLVRConfig, name: str, role: WorkerConfig) -> list[str]:
    budget, packing = role.max_tokens_per_micro_batch, role.use_sequence_packing
    if budget is None and not packing:
        return []
    strategy = role.strategy_args.strategy_name
    spec = STRATEGY_SPECS.get(strategy or "")
    if spec is None:
        return []  # an unknown strategy is reported by the role's strategy check
    keys = ["max_tokens_per_micro_batch"] if budget is not None else []
    keys += ["use_sequence_packing"] if packing else []
    if name not in ROLES:  # rollouts are the engine's batching; reward models score by rows
        return [
            f"{name}.{key}: only {', '.join(ROLES)} read it (their train, log-prob, reference "
            "and value passes); remove it"
            for key in keys
        ]
    if not spec.token_micro_batches:
        readers = [n for n, s in STRATEGY_SPECS.items() if s.token_micro_batches]
        return [
            f"{name}.{key}: strategy {strategy!r} does not read it (only "
            f"{', '.join(readers)} do); remove it from {name}"
            for key in keys
        ]
    problems = []
    if budget is not None and budget >= 1:
        longest, how = longest_sequence(cfg)
        if budget < longest:
            problems.append(
                f"{name}.max_tokens_per_micro_batch: {budget} cannot hold the longest sequence "
                f"({how}); raise it to at least {longest}, or set it to null for micro-batches "
                "of rows"
            )
    attn = role.model_args.attn_implementation
    if packing and attn not in PACKING_ATTENTION:
        valid = ", ".join("null" if a is None else a for a in PACKING_ATTENTION)
        problems.append(
            f"{name}.use_sequence_packing: attention implementation {attn!r} cannot keep packed "
            f"sequences apart; set {name}.model_args.attn_implementation to one of {valid}, or "
            "use_sequence_packing: false"
        )
    return problems


# Measured with benchmarks/train_packing.py on an H100 (one rank, ~20M Qwen2, fp32, 128 rows of a
# 32-token prompt and 8-1024 response tokens, micro 16 x accumulation 8): train phase against
# padded row-count micro-batches.
PACKING_DENSE_MASK = "packed 0.48x, budget + packing 0.34x, budget alone 1.63x"


def packing_warnings(cfg: RLVRConfig) -> list[str]:
    """Packing where it measured slower than not packing: with eager or sdpa (transformers'
    default) the packed row attends through a dense block-diagonal mask, whose cost grows with
    the square of the row's length; fa2's varlen kernel pays by each sequence's own length."""
    warnings = []
    for name in ROLES:
        role = getattr(cfg, name, None)
        if role is None or not role.use_sequence_packing:
            continue
        attn = role.model_args.attn_implementation
        if attn in (None, "eager", "sdpa"):
            warnings.append(
                f"{name}.use_sequence_packing with attn_implementation {attn or 'null (sdpa)'}: "
                "the packed row attends through a dense block-diagonal mask, slower than "
                f"padding on GPU and CPU (H100, responses of 8-1024 tokens: {PACKING_DENSE_MASK}"
                f" of padded rows); set {name}.model_args.attn_implementation: fa2 (flash-attn, "
                f"on GPUs) with {name}.model_args.dtype: bf16 or fp16 (flash-attn has no fp32 "
                f"kernels; the role's is {role.model_args.dtype}), or use_sequence_packing: "
                "false and keep max_tokens_per_micro_batch"
            )
    return warnings
