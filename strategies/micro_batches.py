"""Micro-batches cut by a token budget, and padding-free packing of a micro-batch's rows.

Both are per-role settings of the torch strategies (``WorkerConfig.max_tokens_per_micro_batch``,
``use_sequence_packing``). Everything here is pure planning on row lengths and index maps; the
strategies run the forwards.

    row_widths          columns each row needs: one past its last real token
    plan_micro_batches  rows sorted by width, filled greedily into groups under the budget
    match_count         the biggest groups split until there are as many as another rank's
    select_rows         a micro-batch of chosen rows, cut to its own longest row
    PackedRows          one row of a micro-batch's real tokens, and the map back to ``[B, T-1]``
    token_batched_forward  an inference pass over token-budget micro-batches

A group's cost is its padded size ``rows x longest width``, or with packing the sum of its
widths (the packed row's length). Rows are right-padded (``roll_ds/pipeline/sequences.py``); a
left-padded row needs the full width and so is never trimmed, and packing takes the real tokens
of any row with contiguous real tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def row_widths(attention_mask_BT: torch.Tensor) -> list[int]:
    """One past each row's last real token (at least 2, so a row keeps a log-prob column)."""
    width = attention_mask_BT.shape[1]
    columns_T = torch.arange(1, width + 1, device=attention_mask_BT.device)
    last_B = (attention_mask_BT.bool() * columns_T).amax(-1)
    return last_B.clamp(min=min(2, width)).tolist()


def group_cost(widths: Sequence[int], rows: Sequence[int], *, packed: bool) -> int:
    """Tokens a micro-batch of ``rows`` computes on: the packed row's length, or padded
    ``rows x longest``."""
    if not rows:
        return 0
    if packed:
        return sum(widths[i] for i in rows)
    return len(rows) * max(widths[i] for i in rows)


def plan_micro_batches(widths: Sequence[int], budget: int, *, packed: bool) -> list[list[int]]:
    """Row indices grouped so that each group costs at most ``budget`` tokens (a row wider than
    the budget alone). Rows are taken longest first and each group filled until the next row
    would overflow it, so that a group's rows have similar widths and trimming wastes little."""
    if budget < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {budget}")
    order = sorted(range(len(widths)), key=lambda i: (-widths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and group_cost(widths, [*groups[-1], i], packed=packed) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def match_count(
    groups: list[list[int]], widths: Sequence[int], count: int, *, packed: bool
) -> list[list[int]]:
    """``groups`` with the costliest split in two until there are ``count`` of them (data-parallel
    ranks must run as many micro-batches: each backward reduces gradients, and ZeRO-3's forwards
    gather parameters). Stops early when every group is a single row."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        biggest = max(splittable, key=lambda g: group_cost(widths, g, packed=packed))
        groups.remove(biggest)
        cut = min(
            range(1, len(biggest)),
            key=lambda c: max(
                group_cost(widths, biggest[:c], packed=packed),
                group_cost(widths, biggest[c:], packed=packed),
            ),
        )
        groups += [biggest[:cut], biggest[cut:]]
    return groups


def select_rows(
    batch: Mapping[str, Any], rows: Sequence[int], *, width: int | None = None
) -> dict[str, Any]:
    """The micro-batch of ``rows``: every tensor whose first dimension is the batch's takes
    those rows, and with ``width`` its token columns (``T``, or ``T - 1`` in the shifted space)
    are cut to ``width`` (``width - 1``). Other values are shared."""
    ids = batch["input_ids"]
    size, full = ids.shape
    index = torch.as_tensor(list(rows), dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if not (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size):
            out[key] = value
            continue
        value = value.index_select(0, index.to(value.device))
        if width is not None and value.dim() > 1 and value.shape[1] in (full, full - 1):
            value = value[:, : width - (full - value.shape[1])]
        out[key] = value
    return out


def widen(values_BW: torch.Tensor, width: int) -> torch.Tensor:
    """``values_BW`` padded with zero columns to ``width`` (the inverse of ``select_rows``'s
    cut, for outputs in the shifted ``[B, T-1]`` space)."""
    missing = width - values_BW.shape[1]
    return torch.nn.functional.pad(values_BW, (0, missing)) if missing > 0 else values_BW


@dataclass(frozen=True)
class PackedRows:
    """The index maps of one padded micro-batch ``[B, T]`` packed into one row ``[1, N]``.

    The row holds the real tokens of every row in order, with position ids restarting at 0 for
    each sequence; a model called with it and ``attention_mask=None`` sees a block-diagonal
    causal mask (transformers detects the sequences from the position ids). Packed position
    ``source_M[m]`` predicts the token after it in the same sequence; its output belongs in
    ``[B, T-1]`` at ``(rows_M[m], cols_M[m])`` (column ``t`` scores token ``t + 1``), and
    columns whose next token is padding stay 0.
    """

    rows_N: torch.Tensor  # padded row of each packed token
    cols_N: torch.Tensor  # its padded column
    position_ids_1N: torch.Tensor
    source_M: torch.Tensor
    shape: tuple[int, int]  # (B, T - 1)

    @classmethod
    def of(cls, attention_mask_BT: torch.Tensor) -> PackedRows:
        batch, width = attention_mask_BT.shape
        rows_N, cols_N = attention_mask_BT.bool().nonzero(as_tuple=True)  # row-major order
        lengths_B = torch.bincount(rows_N, minlength=batch)
        starts_B = lengths_B.cumsum(0) - lengths_B
        positions_N = torch.arange(rows_N.numel(), device=rows_N.device) - starts_B[rows_N]
        follows = (rows_N[1:] == rows_N[:-1]) & (cols_N[1:] == cols_N[:-1] + 1)
        return cls(
            rows_N=rows_N,
            cols_N=cols_N,
            position_ids_1N=positions_N.unsqueeze(0),
            source_M=follows.nonzero(as_tuple=True)[0],
            shape=(batch, width - 1),
        )

    def pack(self, values_BT: torch.Tensor) -> torch.Tensor:
        """``[1, N]``: the real tokens' entries of ``values_BT`` in packed order."""
        return values_BT[self.rows_N, self.cols_N].unsqueeze(0)

    @property
    def targets_M(self) -> torch.Tensor:
        """Packed positions of the tokens that ``source_M`` predicts."""
        return self.source_M + 1

    def unpack(self, values_M: torch.Tensor) -> torch.Tensor:
        """``values_M`` (one per ``source_M``) scattered into ``[B, T-1]`` zeros; gradients flow
        back through the scatter."""
        out_BT = values_M.new_zeros(self.shape)
        index = (self.rows_N[self.source_M], self.cols_N[self.source_M])
        return out_BT.index_put(index, values_M)


def packed_forward(model: Any, input_ids_BT: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """The model's logits (``[M, ...]``) at ``rows.source_M`` of the packed micro-batch: one
    forward over ``[1, N]`` with restarting position ids and no attention mask."""
    out = model(
        input_ids=rows.pack(input_ids_BT),
        attention_mask=None,
        position_ids=rows.position_ids_1N,
        use_cache=False,
    )
    return out.logits[0, rows.source_M]


def token_batched_forward(
    forward: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    max_tokens: int,
    packed: bool,
    device: torch.device,
    lockstep: bool,
    empty_keys: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    """``forward(ids, mask)`` over micro batches of about ``max_tokens`` tokens
    (``plan_micro_batches``), each cut to its longest row; outputs on the CPU, widened back to
    ``T-1`` columns (zeros past a row's chunk) and in the rows' order (the ``empty_keys``,
    ``[0, T-1]``, when there are no rows). With ``lockstep`` (ZeRO-3 over several ranks) every
    rank runs as many forwards as the busiest: a rank with fewer splits its biggest micro
    batches, then repeats its last."""
    width = input_ids_BT.shape[1]
    widths = row_widths(attention_mask_BT)
    groups = plan_micro_batches(widths, max_tokens, packed=packed)
    rounds = len(groups)
    if lockstep:
        import torch.distributed as dist

        count = torch.tensor([rounds], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        rounds = int(count.item())
        groups = match_count(groups, widths, rounds, packed=packed)
    parts: dict[str, list[torch.Tensor]] = {}
    for i in range(rounds):
        if groups:
            mb = select_rows(
                {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT},
                groups[min(i, len(groups) - 1)],
                width=max(widths[r] for r in groups[min(i, len(groups) - 1)]),
            )
            ids, mask = mb["input_ids"], mb["attention_mask"]
        else:  # this rank has no rows at all: a 1-row dummy keeps the gathers paired
            ids = torch.zeros((1, max(2, width)), dtype=torch.long)
            mask = torch.ones_like(ids)
        out = forward(ids.to(device), mask.to(device))
        if i < len(groups):
            for k, v in out.items():
                parts.setdefault(k, []).append(widen(v.float().cpu(), width - 1))
    if not parts:
        return {k: torch.zeros((0, max(0, width - 1))) for k in empty_keys}
    order = torch.tensor([r for g in groups for r in g], dtype=torch.long)
    result = {}
    for k, v in parts.items():
        rows = torch.cat(v)
        result[k] = torch.empty_like(rows).index_copy_(0, order, rows)
    return result
