"""Token-budget micro-batches and padding-free packing (strategies/micro_batches.py): the
planner against hand-made lengths, and packed forwards against padded ones on the tiny Qwen2."""

from __future__ import annotations

import pytest
import torch

from strategies._common import forward_logprobs
from strategies.micro_batches import (
    PackedRows,
    group_cost,
    match_count,
    packed_forward,
    plan_micro_batches,
    row_widths,
    select_rows,
    token_batched_forward,
    widen,
)

WIDTHS = [40, 7, 300, 12, 96, 3, 55, 128, 9, 64]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("budget", [1, 64, 200, 512, 10_000])
def test_plan_respects_the_budget_and_keeps_every_row_once(budget, packed):
    groups = plan_micro_batches(WIDTHS, budget, packed=packed)
    assert sorted(i for g in groups for i in g) == list(range(len(WIDTHS)))
    for g in groups:  # over budget only as a single overlong row
        assert group_cost(WIDTHS, g, packed=packed) <= budget or len(g) == 1
    if budget >= 10_000:
        assert len(groups) == 1


def test_plan_sorts_by_length_and_fills_greedily():
    assert plan_micro_batches([5, 9, 2, 9, 4], 18, packed=False) == [[1, 3], [0, 4, 2]]
    assert plan_micro_batches([5, 9, 2, 9, 4], 18, packed=True) == [[1, 3], [0, 4, 2]]
    assert plan_micro_batches([5, 9, 2, 9, 4], 14, packed=True) == [[1], [3, 0], [4, 2]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches([3], 0, packed=False)


@pytest.mark.parametrize("packed", [False, True])
def test_match_count_splits_the_biggest_groups(packed):
    groups = plan_micro_batches(WIDTHS, 10_000, packed=packed)
    for count in range(1, len(WIDTHS) + 1):
        matched = match_count(groups, WIDTHS, count, packed=packed)
        assert len(matched) == count
        assert sorted(i for g in matched for i in g) == list(range(len(WIDTHS)))
    # cannot go past one row per group
    assert len(match_count(groups, WIDTHS, 99, packed=packed)) == len(WIDTHS)
    # the costliest group is the one split
    split = match_count([[0, 1], [2, 3, 4, 5]], [1, 1, 9, 8, 2, 1], 3, packed=packed)
    assert [0, 1] in split and len(split) == 3


def test_row_widths_and_select_rows_trim_to_the_longest_row():
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
    assert row_widths(mask) == [3, 2, 6]  # at least 2; a left-padded row needs every column
    batch = {
        "input_ids": torch.arange(18).reshape(3, 6),
        "attention_mask": mask,
        "response_mask": torch.ones(3, 5),
        "advantages": torch.ones(3, 1),
        "scalar": 1.5,
    }
    mb = select_rows(batch, [1, 0], width=3)
    assert mb["input_ids"].tolist() == [[6, 7, 8], [0, 1, 2]]
    assert mb["response_mask"].shape == (2, 2) and mb["advantages"].shape == (2, 1)
    assert mb["scalar"] == 1.5
    assert widen(mb["response_mask"], 5).tolist() == [[1, 1, 0, 0, 0]] * 2


def test_packed_rows_index_maps():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [1, 0, 0, 0]])
    rows = PackedRows.of(mask)
    ids = torch.arange(12).reshape(3, 4)
    assert rows.pack(ids).tolist() == [[0, 1, 2, 5, 6, 8]]
    assert rows.position_ids_1N.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert rows.source_M.tolist() == [0, 1, 3]  # each predicts the next token of its sequence
    out = rows.unpack(torch.tensor([10.0, 11.0, 12.0]))
    assert out.tolist() == [[10, 11, 0], [0, 12, 0], [0, 0, 0]]


# ---------------------------------------------------------------------------------------------
# packed forwards equal padded ones (fp32, tiny Qwen2)

LENGTHS = [5, 14, 1, 9, 2, 11]


def _tiny_model(attn: str, lora: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import TINY_QWEN2

    torch.manual_seed(0)
    config = Qwen2Config(**TINY_QWEN2)
    config._attn_implementation = attn
    model = Qwen2ForCausalLM(config).float()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        for name, param in model.named_parameters():  # B = 0 at init: make the adapter count
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS) + 2
    ids = torch.randint(1, 128, (len(LENGTHS), width), generator=g)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    mask[3] = 0
    mask[3, 4:13] = 1  # one left-padded row
    return ids * mask, mask


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_against_padded(attn: str, lora: bool, device: str) -> None:
    model = _tiny_model(attn, lora).to(device)
    ids, mask = (t.to(device) for t in _batch())
    valid = (mask[:, 1:] * mask[:, :-1]).float()  # a column whose token and next are real
    weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(1)).to(device)
    weights = weights * valid
    results = []
    for packed in (False, True):
        out = forward_logprobs(model, ids, mask, with_entropy=True, packed=packed)
        loss = (out["logprobs_BT"] * weights).sum() + 0.1 * (out["entropy_BT"] * weights).sum()
        results.append((out, _grads(model, loss)))
    (padded, padded_grads), (packed, packed_grads) = results
    for key in ("logprobs_BT", "entropy_BT"):
        gap = ((padded[key] - packed[key]) * valid).abs().max()
        assert gap < 1e-5, (key, float(gap))
    assert (packed["logprobs_BT"] * (1 - valid)).abs().max() == 0
    assert padded_grads.keys() == packed_grads.keys() and padded_grads
    for name, grad in padded_grads.items():
        assert (grad - packed_grads[name]).abs().max() < 1e-5, name


@pytest.mark.parametrize("attn,lora", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_logprobs_and_grads_equal_padded(attn, lora):
    _packed_against_padded(attn, lora, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("attn,lora", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_logprobs_and_grads_equal_padded_on_cuda(attn, lora):
    """The same on CUDA kernels (fp32, TF32 off: PyTorch's default for matmuls)."""
    _packed_against_padded(attn, lora, "cuda")


@pytest.mark.gpu
def test_packed_equals_padded_with_flash_attention_2():
    """fa2 (``attn_implementation: fa2``) takes the packed row through its varlen kernel; it
    runs in bf16 only, so the bound is bf16's."""
    pytest.importorskip("flash_attn")
    model = _tiny_model("flash_attention_2").to("cuda", torch.bfloat16)
    ids, mask = (t.to("cuda") for t in _batch())
    valid = (mask[:, 1:] * mask[:, :-1]).float()
    with torch.no_grad():
        padded = forward_logprobs(model, ids, mask, packed=False)["logprobs_BT"].float()
        packed = forward_logprobs(model, ids, mask, packed=True)["logprobs_BT"].float()
    assert ((padded - packed) * valid).abs().max() < 5e-2


def test_packed_value_head_equals_padded():
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    from roll_ds.models.value_model import forward_values
    from tests.conftest import TINY_QWEN2

    torch.manual_seed(0)
    config = Qwen2Config(**TINY_QWEN2, num_labels=1, classifier_dropout=0.0)
    model = Qwen2ForTokenClassification(config).float()
    ids, mask = _batch()
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    padded = forward_values(model, ids, mask)
    rows = PackedRows.of(mask)
    packed = rows.unpack(packed_forward(model, ids, rows)[:, 0].float())
    assert (padded - packed)[valid].abs().max() < 1e-5


@pytest.mark.parametrize("packed", [False, True])
def test_token_batched_forward_returns_rows_in_order(packed):
    model = _tiny_model("sdpa").eval()
    ids, mask = _batch()
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    with torch.no_grad():
        whole = forward_logprobs(model, ids, mask)["logprobs_BT"]
        out = token_batched_forward(
            lambda i, m: forward_logprobs(model, i, m, packed=packed),
            ids,
            mask,
            max_tokens=20,
            packed=packed,
            device=torch.device("cpu"),
            lockstep=False,
            empty_keys=("logprobs_BT",),
        )["logprobs_BT"]
    assert out.shape == whole.shape
    assert (out - whole)[valid].abs().max() < 1e-5
    empty = token_batched_forward(
        None,
        ids[:0],
        mask[:0],
        max_tokens=20,
        packed=packed,
        device="cpu",
        lockstep=False,
        empty_keys=("logprobs_BT",),
    )
    assert empty["logprobs_BT"].shape == (0, ids.shape[1] - 1)
