"""The split / gather math of Ulysses sequence parallelism (``strategies/deepspeed/
sequence_parallel.py``) without a process group: the group's rows, the packed row's attention
per sequence, the column shards and their gradient, the mini-batch counts of an SP group. The
all-to-all itself runs in tests/integration/test_sequence_parallel.py on two gloo ranks."""

from __future__ import annotations

import pytest
import torch

from roll_ds.algorithms.aggregation import MiniBatchNorm
from strategies.deepspeed import sequence_parallel as sp_module
from strategies.deepspeed.sequence_parallel import (
    SequenceParallel,
    _by_sequence,
    _GatherColumns,
    _interleaved,
    check_right_padded,
)
from strategies.deepspeed.step import mini_batch_norms


def _sp(rank: int, size: int = 2) -> SequenceParallel:
    return SequenceParallel(size=size, rank=rank, group=None, _restore=lambda: None)


def test_interleaved_puts_each_step_of_every_rank_together():
    # 2 ranks x 4 rows, 2 rows per optimizer step: step 0 = rank 0's 0-1 then rank 1's 4-5
    assert _interleaved(4, 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert _interleaved(3, 2, 3) == [0, 1, 2, 3, 4, 5]


def test_gather_rows_widens_and_finds_own_rows(monkeypatch):
    """The group's rows: every rank's batch (a boundary fake stands in for all_gather_object),
    columns right-padded to the widest, ``[B, T-1]`` tensors too."""
    batches = [
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "old_logprobs": torch.ones(2, 2)},
        {"input_ids": torch.full((1, 5), 2), "old_logprobs": torch.full((1, 4), 2.0)},
    ]

    def all_gather_object(out, obj, group=None):
        out[:] = batches

    monkeypatch.setattr(sp_module.dist, "all_gather_object", all_gather_object)
    group, own = _sp(rank=1).gather_rows({**batches[1], "note": "kept"})
    assert group["input_ids"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [2] * 5]
    assert group["old_logprobs"].shape == (3, 4) and group["note"] == "kept"
    assert own == slice(2, 3)
    with pytest.raises(ValueError, match="the same number"):
        _sp(rank=0).gather_rows(batches[0], rows_per_step=2)


def test_right_padding_required():
    check_right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="right-padded"):
        check_right_padded(torch.tensor([[0, 1, 1]]))


def test_packed_row_attends_per_sequence():
    """After the all-to-all a rank holds the whole packed row: attention over each sequence on
    its own equals the block-diagonal masked attention transformers would use unsplit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])  # sequences of 3, 2 and 2 tokens
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    got, _ = _by_sequence(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions)
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(7, 7, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-6)
    # one sequence: passed through unchanged
    whole, _ = _by_sequence(sdpa_attention_forward)(
        module, q, k, v, None, position_ids=torch.arange(7)[None]
    )
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(whole, causal.transpose(1, 2), rtol=0, atol=1e-6)


def test_gathered_columns_give_each_rank_its_own_gradient(monkeypatch):
    """Every rank computes the same loss from the gathered row, so each rank's shard gets that
    loss's gradient of its own columns, not the sum over the group."""
    shards = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])]

    def all_gather(out, local, group=None):
        for i, shard in enumerate(shards):
            out[i].copy_(shard)

    monkeypatch.setattr(sp_module.dist, "all_gather", all_gather)
    weights = torch.tensor([[1.0, 10.0, 100.0, 1000.0]])
    for rank in (0, 1):
        local = shards[rank].clone().requires_grad_()
        full = _GatherColumns.apply(local, None, rank, 2)
        assert full.tolist() == [[1.0, 2.0, 3.0, 4.0]]
        (full * weights).sum().backward()
        assert local.grad.tolist() == [weights[0, 2 * rank : 2 * rank + 2].tolist()]


class _CountingLoss:
    def __call__(self, *args, **kwargs):
        raise AssertionError("not called")

    @staticmethod
    def mini_batch_counts(mb):
        return torch.tensor([float(mb["attention_mask"].sum()), float(len(mb["attention_mask"]))])


def test_mini_batch_counts_of_an_sp_group():
    """An SP group's ranks hold the same micro-batches: the counts over the ranks (no process
    group here: one rank's) are divided by the group size, and so is the scale that undoes
    DeepSpeed's averaging (each rank's loss is multiplied by the size instead)."""
    chunks = [{"attention_mask": torch.ones(2, 3)}, {"attention_mask": torch.ones(1, 4)}]
    cpu = torch.device("cpu")
    [plain] = mini_batch_norms(chunks, _CountingLoss(), steps=[2], world_size=1, device=cpu)
    assert plain == MiniBatchNorm(tokens=10.0, sequences=3.0, scale=2.0)
    [split] = mini_batch_norms(
        chunks, _CountingLoss(), steps=[2], world_size=1, device=cpu, replicas=2
    )
    assert split == MiniBatchNorm(tokens=5.0, sequences=1.5, scale=1.0)
    assert _sp(rank=0).loss_factor == 2.0
