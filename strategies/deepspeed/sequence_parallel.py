"""Ulysses sequence parallelism (DeepSpeed's ALST ``UlyssesSPAttentionHF``) for the DeepSpeed
strategies: the ranks of a sequence-parallel (SP) group compute one micro-batch together, each
on ``1/size`` of its token columns, so a rank's activations (and its logits, the largest of
them at long responses) shrink by ``size``.

    SP groups      consecutive ranks ``[0..size)``, ``[size..2 size)``, ...; the data-parallel
                   ranks stay every rank to DeepSpeed (ZeRO partitions over all of them)
    rows           each rank keeps the rows dispatch gave it; ``gather_rows`` gives every rank
                   of a group the group's rows (DeepSpeed's ``UlyssesSPDataLoaderAdapter`` does
                   the same: SP over DP), and a rank's own outputs are its rows of the result
    forward        the stream of tokens (a padded ``[B, T]`` batch, or the packed ``[1, N]``
                   row) right-padded to a multiple of ``size``; each rank runs the model on its
                   columns with their global position ids; inside every attention layer
                   ``UlyssesSPAttentionHF`` swaps sequence shards for head shards (all-to-all),
                   attends over the whole sequence with ``size``-th of the heads, and swaps back
    outputs        log-probs / entropy of a rank's columns (labels are the next column's token,
                   which every rank holds), all-gathered into the whole row
    gradients      every rank of a group computes the same loss from the same gathered values,
                   so ``_GatherColumns`` hands back only the rank's own columns' gradient (no
                   sum over the group); the parameter gradients of a group's ranks then add up
                   to the micro-batch's, and since DeepSpeed averages over every rank the loss
                   is multiplied by ``size`` (``loss_factor``)

Attention runs with ``attention_mask=None`` and is causal (the SP wrapper drops the mask built
for a rank's shard): exact for right-padded rows, whose real tokens see only real tokens before
them (``check_right_padded``). A packed row holds several sequences: ``_by_sequence`` attends
over each one on its own (they are contiguous, starting where the position ids restart at 0).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from roll_ds.models.tensors import position_ids_from_mask
from strategies import _common
from strategies.micro_batches import PackedRows

logger = logging.getLogger(__name__)

SP_ATTENTION = ("sdpa", "flash_attention_2")  # what transformers resolves; eager needs a 4D mask


@dataclass
class SequenceParallel:
    """One rank's place in its SP group and the attention hook it installed."""

    size: int
    rank: int  # within the group
    group: Any  # the group's torch.distributed ProcessGroup
    _restore: Callable[[], None]

    @classmethod
    def setup(cls, size: int, model: torch.nn.Module) -> SequenceParallel | None:
        """Create the SP groups (collective: every rank calls it) and route ``model``'s attention
        through Ulysses; None for ``size == 1`` (nothing changes)."""
        if size == 1:
            return None
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"sequence_parallel_size {size} does not divide world size {world}")
        mine = None
        for start in range(0, world, size):  # new_group is collective: every rank makes each
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = group
        restore = _install_attention(model.config, mine, size)
        logger.info(
            "sequence parallelism: rank %d is rank %d of an SP group of %d (ranks %d-%d)",
            rank,
            rank % size,
            size,
            rank - rank % size,
            rank - rank % size + size - 1,
        )
        return cls(size=size, rank=rank % size, group=mine, _restore=restore)

    @property
    def loss_factor(self) -> float:
        """What a rank's loss is multiplied by: DeepSpeed averages gradients over every rank,
        but a group's ranks hold parts of one gradient (module doc)."""
        return float(self.size)

    def close(self) -> None:
        self._restore()

    # -----------------------------------------------------------------------------------------
    # rows

    def gather_rows(
        self, batch: Mapping[str, Any], *, rows_per_step: int | None = None
    ) -> tuple[dict[str, Any], slice]:
        """The group's rows on every rank of it, and where this rank's own rows are in them.
        Columns are right-padded to the group's widest batch. ``rows_per_step``: interleave
        the ranks' optimizer steps (step k: rank 0's rows of step k, rank 1's, ...), so that
        the group's step k is its ranks' steps k together (each rank must then hold as many
        rows)."""
        tensors = {k: v.cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, tensors, group=self.group)
        sizes = [int(p["input_ids"].shape[0]) for p in parts]
        width = max(int(p["input_ids"].shape[1]) for p in parts)
        parts = [_widen_columns(p, width) for p in parts]
        own_start = sum(sizes[: self.rank])
        if rows_per_step is None:
            order = list(range(sum(sizes)))
        else:
            if len(set(sizes)) > 1:
                raise ValueError(
                    f"sequence parallelism: the ranks of an SP group hold {sizes} rows; each "
                    "needs the same number (whole optimizer steps)"
                )
            order = _interleaved(sizes[0], self.size, rows_per_step)
            own_start = None
        combined = {k: torch.cat([p[k] for p in parts])[order] for k in tensors}
        combined.update({k: v for k, v in batch.items() if k not in tensors})
        if own_start is None:  # interleaved: own rows are spread out; the caller needs none
            return combined, slice(0, 0)
        return combined, slice(own_start, own_start + sizes[self.rank])

    # -----------------------------------------------------------------------------------------
    # forward

    def forward_logprobs(
        self,
        model: Any,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        *,
        with_entropy: bool = False,
        temperature: float = 1.0,
        packed: bool = False,
    ) -> dict[str, torch.Tensor]:
        """``_common.forward_logprobs``'s outputs (``[B, T-1]``), this rank computing its
        ``1/size`` of the token columns (module doc)."""
        if packed:
            rows = PackedRows.of(attention_mask_BT)
            ids, positions = rows.pack(input_ids_BT), rows.position_ids_1N
        else:
            check_right_padded(attention_mask_BT)
            ids, positions = input_ids_BT, position_ids_from_mask(attention_mask_BT)
        length = ids.shape[1]
        width = -(-length // self.size) * self.size
        extra = width - length
        ids = torch.nn.functional.pad(ids, (0, extra))
        if packed:  # the padding is a sequence of its own
            tail = torch.arange(extra, device=positions.device).expand(1, extra)
            positions = torch.cat([positions, tail], dim=1)
        else:  # padding repeats the last position, as position_ids_from_mask does
            positions = torch.nn.functional.pad(positions, (0, extra), mode="replicate")
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        chunk = width // self.size
        own = slice(self.rank * chunk, (self.rank + 1) * chunk)
        ids_own, positions_own = ids[:, own], positions[:, own]
        out = model(
            input_ids=ids_own, attention_mask=None, position_ids=positions_own, use_cache=False
        )
        local = _common._token_outputs(
            out.logits, labels[:, own], with_entropy=with_entropy, temperature=temperature
        )
        full = {
            k: _GatherColumns.apply(v, self.group, self.rank, self.size)[:, : length - 1]
            for k, v in local.items()
        }
        if packed:
            return {k: rows.unpack(v[0, rows.source_M]) for k, v in full.items()}
        return full


def group_budget(sp: SequenceParallel | None, budget: int | None) -> int | None:
    """A ``max_tokens_per_micro_batch`` counts a rank's share of a micro-batch's tokens: under
    SP a micro-batch of the group holds ``size`` times as many."""
    return budget * sp.size if sp is not None and budget is not None else budget


def over_rows(
    sp: SequenceParallel | None,
    run: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``run(ids, mask)`` (a pass over rows that returns ``[rows, ...]`` tensors); under SP
    over the group's rows, and this rank's rows of what it returns."""
    if sp is None:
        return run(input_ids_BT, attention_mask_BT)
    batch = {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT}
    group, own = sp.gather_rows(batch)
    out = run(group["input_ids"], group["attention_mask"])
    return {k: v[own] for k, v in out.items()}


def check_right_padded(attention_mask_BT: torch.Tensor) -> None:
    """Sequence parallelism attends causally without a mask: a row's real tokens must come
    first (right padding, as ``roll_ds/pipeline/sequences.py`` builds rows)."""
    mask = attention_mask_BT.bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "sequence parallelism needs right-padded rows (real tokens first); a row has padding "
            "before a real token"
        )


def _interleaved(rows: int, ranks: int, per_step: int) -> list[int]:
    """Indices into the ranks' rows concatenated (``rows`` each) that put step k of every rank
    together: rank 0's ``per_step`` rows of step k, then rank 1's, ..."""
    order = []
    for start in range(0, rows, per_step):
        for r in range(ranks):
            order += range(r * rows + start, r * rows + min(start + per_step, rows))
    return order


def _widen_columns(batch: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Every ``[B, T]`` / ``[B, T-1]`` tensor of ``batch`` right-padded with zeros to ``width``
    (``width - 1``) columns."""
    full = batch["input_ids"].shape[1]
    out = {}
    for key, value in batch.items():
        if value.dim() > 1 and value.shape[1] in (full, full - 1) and full < width:
            value = torch.nn.functional.pad(value, (0, width - full))
        out[key] = value
    return out


class _GatherColumns(torch.autograd.Function):
    """All-gather ``[B, C]`` column shards into ``[B, size x C]``; the backward keeps the
    rank's own columns of the gradient (the group's ranks compute the same loss)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.own = (rank * local.shape[1], (rank + 1) * local.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start, stop = ctx.own
        return grad[:, start:stop], None, None, None


def _install_attention(config: Any, group: Any, size: int) -> Callable[[], None]:
    """Route ``config``'s attention implementation through ``UlyssesSPAttentionHF`` (as
    DeepSpeed's ``register_with_transformers`` does: the name stays, so every transformers
    branch on it still runs) and return what puts the original back."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(config, "_attn_implementation", None)
    if impl not in SP_ATTENTION:
        raise ValueError(
            f"sequence parallelism needs attention {' or '.join(SP_ATTENTION)}; the model runs "
            f"{impl!r} (set model_args.attn_implementation: sdpa)"
        )
    text = config.get_text_config()
    heads = text.num_attention_heads
    core = ALL_ATTENTION_FUNCTIONS[impl]
    if getattr(core, "sp_group_size", None):  # a second wrapper would run Ulysses twice
        raise RuntimeError(
            "sequence parallelism is already routing this process's attention (one SP strategy "
            "per process: close the other first)"
        )

    class _Ulysses(UlyssesSPAttentionHF):
        """A batch size that varies between micro-batches (DeepSpeed's fixes it)."""

        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
            self.batch_size = batch = query.shape[0]
            hs = self.attn_head_size
            self.required_query_shape = torch.Size([1, batch, self.attn_head_count, hs])
            self.required_key_value_shape = torch.Size([1, batch, self.global_kv_head_count, hs])
            self.required_context_shape = torch.Size([1, batch, hs * self.attn_head_count // size])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    ulysses = _Ulysses(
        attn=_by_sequence(core),
        batch_size=1,
        attn_head_count=heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        kv_head_count=text.num_key_value_heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
    )

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        # the mask transformers built covers this rank's shard only; attention is causal
        return ulysses(module, query, key, value, None, *args, **kwargs)

    attention.sp_group_size = size
    ALL_ATTENTION_FUNCTIONS[impl] = attention
    return lambda: ALL_ATTENTION_FUNCTIONS.__setitem__(impl, core)


def _by_sequence(core: Callable[..., Any]) -> Callable[..., Any]:
    """``core`` attention run over each sequence of a packed row on its own (a row of one
    batch whose gathered position ids restart at 0); anything else passes through."""

    def attention(module, query, key, value, attention_mask, *args, position_ids=None, **kw):
        starts = []
        if query.shape[0] == 1 and position_ids is not None:
            starts = (position_ids[0, 1:] == 0).nonzero(as_tuple=True)[0].add(1).tolist()
        if not starts:
            return core(module, query, key, value, None, *args, position_ids=position_ids, **kw)
        bounds = [0, *starts, query.shape[2]]
        parts = [
            core(
                module,
                query[:, :, a:b],
                key[:, :, a:b],
                value[:, :, a:b],
                None,
                *args,
                position_ids=position_ids[:, a:b],
                **kw,
            )[0]
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat(parts, dim=1), None

    return attention
