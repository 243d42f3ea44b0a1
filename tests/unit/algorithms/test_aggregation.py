import pytest
import torch

from roll_ds.algorithms.aggregation import AGG_MODES, aggregate_loss
from roll_ds.registry import Registry

# Row 0: tokens 1, 2, 3 (sum 6, mean 2); row 1: token 4 (sum 4, mean 4); padding holds garbage.
LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, float("nan")]])
MASK_BT = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),  # constant defaults to T = 3
    ],
)
def test_modes(mode, expected):
    assert aggregate_loss(LOSS_BT, MASK_BT, mode).item() == pytest.approx(expected)


def test_sum_norm_uses_constant():
    got = aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum-norm", norm_constant=4)
    assert got.item() == pytest.approx((6 / 4 + 4 / 4) / 2)


def test_empty_rows_do_not_dilute_sequence_means():
    loss_BT = torch.cat([LOSS_BT, torch.full((1, 3), 7.0)])
    mask_BT = torch.cat([MASK_BT, torch.zeros(1, 3, dtype=torch.long)])
    assert aggregate_loss(loss_BT, mask_BT, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate_loss(loss_BT, mask_BT, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate_loss(loss_BT, mask_BT, "token-mean").item() == pytest.approx(2.5)


def test_denominator_overrides_count():
    # Two micro-batches of one mini-batch: their losses with the global count sum to the whole.
    whole = aggregate_loss(LOSS_BT, MASK_BT, "token-mean")
    parts = [aggregate_loss(LOSS_BT[i : i + 1], MASK_BT[i : i + 1], denominator=4) for i in (0, 1)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())
    seq = aggregate_loss(LOSS_BT, MASK_BT, "seq-mean-token-sum", denominator=5)
    assert seq.item() == pytest.approx(10 / 5)


def test_all_masked_gives_zero_not_nan():
    for mode in AGG_MODES.names():
        got = aggregate_loss(LOSS_BT, torch.zeros_like(MASK_BT), mode)
        assert got.item() == 0.0, mode


def test_gradient_only_reaches_valid_tokens():
    loss_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    aggregate_loss(loss_BT, MASK_BT, "token-mean").backward()
    torch.testing.assert_close(loss_BT.grad, MASK_BT.float() / 4)


def test_unknown_mode_lists_valid():
    with pytest.raises(ValueError) as err:
        aggregate_loss(LOSS_BT, MASK_BT, "token-sum")
    assert str(err.value) == (
        "unknown loss aggregation mode 'token-sum'; valid: seq-mean-token-mean, "
        "seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"
    )


def test_shape_mismatch():
    with pytest.raises(ValueError, match="differ"):
        aggregate_loss(LOSS_BT, MASK_BT[:, :2])


def test_registry_generic_behaviour():
    reg: Registry[int] = Registry("widget")
    reg.register("b")(2)
    reg.add("a", 1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg and len(reg) == 2
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", 3)
    with pytest.raises(ValueError, match=r"^unknown widget 'c'; valid: a, b$"):
        reg.get("c")
    reg.register_lazy("sqrt", "math:sqrt")
    import math

    assert reg.get("sqrt") is math.sqrt
