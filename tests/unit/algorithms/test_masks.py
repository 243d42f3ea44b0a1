import pytest
import torch

from roll_ds.algorithms.masks import (
    last_token_index,
    mask_truncated,
    masked_mean,
    masked_var,
    masked_whiten,
    overlong_soft_penalty,
    response_mask_from_eos,
    response_mask_from_lengths,
    sequence_lengths,
    truncated_sequences,
)

NAN = float("nan")
VALUES_BT = torch.tensor([[1.0, 2.0, NAN], [3.0, 99.0, 99.0], [5.0, 5.0, 5.0]])
MASK_BT = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_masked_mean():
    assert masked_mean(VALUES_BT, MASK_BT).item() == pytest.approx((1 + 2 + 3) / 3)
    # Per row: (1+2)/2, 3/1, and 0 for the empty row (not NaN).
    torch.testing.assert_close(
        masked_mean(VALUES_BT, MASK_BT, dim=-1), torch.tensor([1.5, 3.0, 0.0])
    )


def test_masked_var():
    # Valid values 1, 2, 3: mean 2, squared deviations 1, 0, 1.
    assert masked_var(VALUES_BT, MASK_BT).item() == pytest.approx(2 / 2)  # unbiased
    assert masked_var(VALUES_BT, MASK_BT, unbiased=False).item() == pytest.approx(2 / 3)
    one_BT = torch.tensor([[4.0, 0.0]])
    assert masked_var(one_BT, torch.tensor([[1, 0]])).item() == 0.0


def test_masked_whiten():
    got = masked_whiten(VALUES_BT, MASK_BT)
    # (v - 2) / sqrt(1 + 1e-8); masked entries 0.
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)
    scaled = masked_whiten(VALUES_BT, MASK_BT, shift_mean=False)
    torch.testing.assert_close(scaled, torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0] * 3]))


def test_mask_from_lengths():
    got = response_mask_from_lengths(torch.tensor([2, 0, 3]), 3)
    assert got.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert sequence_lengths(got).tolist() == [2, 0, 3]
    assert last_token_index(got).tolist() == [1, -1, 2]


def test_mask_from_eos_includes_first_eos():
    ids_BT = torch.tensor([[5, 2, 9, 2], [5, 5, 5, 5], [2, 0, 0, 0]])
    assert response_mask_from_eos(ids_BT, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    # Several EOS ids (e.g. <|im_end|> and <|endoftext|>).
    assert response_mask_from_eos(ids_BT, [9, 0]).tolist()[2] == [1, 1, 0, 0]


def test_truncated_sequences():
    ids_BT = torch.tensor([[5, 6, 2], [5, 6, 7], [5, 7, 0], [5, 6, 7]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    # Row 0 ends with EOS at the limit; row 1 hits the limit without EOS; row 2 is short (stop
    # string), row 3 too.
    assert truncated_sequences(ids_BT, mask_BT, eos_token_id=2).tolist() == [
        False,
        True,
        False,
        False,
    ]
    # With a lower configured limit row 2 (length 2, no EOS) counts as truncated too.
    got = truncated_sequences(ids_BT, mask_BT, eos_token_id=2, max_response_length=2)
    assert got.tolist() == [False, True, True, False]


def test_mask_truncated_zeroes_rows():
    mask_BT = torch.tensor([[1, 1], [1, 1], [1, 0]])
    got = mask_truncated(mask_BT, torch.tensor([False, True, False]))
    assert got.tolist() == [[1, 1], [0, 0], [1, 0]]


def test_overlong_soft_penalty():
    # max 10, buffer 4: no penalty up to 6 tokens, linear to -1 at 10, capped beyond.
    lengths_B = torch.tensor([3, 6, 7, 8, 10, 12])
    got = overlong_soft_penalty(lengths_B, max_response_length=10, buffer=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_soft_penalty(lengths_B, max_response_length=10, buffer=4, penalty_factor=0.5)
    assert half[3].item() == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_soft_penalty(lengths_B, max_response_length=10, buffer=0)
