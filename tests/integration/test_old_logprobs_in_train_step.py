"""Old log-probs filled by the train step (``train_step_with_old_logprobs``) on 2 CPU ranks:
they equal the separate log-prob pass's, and the step trains exactly as ``train_step`` does on a
batch that already has them. The first optimizer step's rows take their train forward's own
log-probs; with dropout in the model every row gets the no-grad forward instead. With a token
budget (and packing) the micro batches hold other rows, cut to their own width, and the filled
log-probs still land on their rows."""

from __future__ import annotations

import pytest
from _dist import run_distributed
from _train_helpers import make_strategy, rank_batch

pytestmark = pytest.mark.integration

ATOL = 1e-5  # fp32: the same weights through train-mode micro batches vs eval-mode chunks


def ppo_like_loss(logprobs_BT, micro_batch, entropy_BT=None):
    """A clipped-ratio surrogate that reads ``old_logprobs``, as the policy loss does."""
    import torch

    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    ratio = torch.exp(logprobs_BT - micro_batch["old_logprobs"])
    advantages = micro_batch["advantages"]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    loss = -(surrogate * mask).sum() / mask.sum()
    return loss, {"ratio_max": float((ratio * mask).max())}


def _compare(model_path: str, stage: int, lora_dropout: float, budget: int | None = None) -> dict:
    import torch

    from roll_ds.models.weights import iter_weight_buckets

    batch = rank_batch(0, rows=8, seed=3)  # 8 rows: 2 optimizer steps of 2 x 2 rows
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8 * 11).reshape(8, 11)
    if budget is not None:  # right-padded rows of mixed lengths, so micro batches get cut
        lengths = torch.tensor([12, 5, 9, 7, 12, 4, 10, 6])
        batch["attention_mask"] = (torch.arange(12) < lengths[:, None]).long()

    def strategy():
        return make_strategy(
            model_path,
            stage,
            lora_rank=4,
            lora_alpha=8,
            lora_dropout=lora_dropout,
            seed=0,
            max_tokens_per_micro_batch=budget,
            use_sequence_packing=budget is not None,
        )

    def weights(s):
        return {n: t.clone() for b in iter_weight_buckets(s.module, 10**8) for n, t in b}

    separate = strategy()
    separate.engine.eval()  # dropout off for the reference numbers, as the log-prob pass does
    old = separate.compute_logprobs(batch["input_ids"], batch["attention_mask"])["logprobs_BT"]
    torch.manual_seed(1)
    want = separate.train_step({**batch, "old_logprobs": old}, ppo_like_loss)
    want_weights = weights(separate)
    separate.close()

    fused = strategy()
    no_grad_rows = []  # rows of each no-grad forward the fused step runs
    own_pass = fused.compute_logprobs

    def counted(ids, mask, **kw):
        no_grad_rows.append(ids.shape[0])
        return own_pass(ids, mask, **kw)

    fused.compute_logprobs = counted
    torch.manual_seed(1)
    got, filled = fused.train_step_with_old_logprobs(batch, ppo_like_loss)
    got_weights = weights(fused)
    fused.close()
    real = batch["attention_mask"][:, 1:].bool()  # columns past a row's end are padding
    diff = torch.where(real, filled - old, 0.0).abs()
    return {
        "no_grad_rows": no_grad_rows,
        "old_diff_first_step": diff[:4].max().item(),
        "old_diff_later_steps": diff[4:].max().item(),
        "loss": (want["loss"], got["loss"]),
        "ratio_max": (want["ratio_max"], got["ratio_max"]),
        "weights_diff": max(
            (want_weights[n] - got_weights[n]).abs().max().item() for n in want_weights
        ),
    }


# (ZeRO stage, LoRA dropout, token budget) of each case. All run in one 2-rank process group
# (the ``compared`` fixture), one after another as test_zero_parity.py's stages do: a group of
# its own per case started 2 ranks, each importing torch and DeepSpeed, 4 times (~15 s a case).
CASES = {
    "zero2": (2, 0.0, None),
    "zero3": (3, 0.0, None),
    "zero3-token-budget-packed": (3, 0.0, 24),
    "zero2-dropout": (2, 0.5, None),
}


def _compare_cases(model_path: str, cases: dict) -> dict:
    out = {}
    for name, (stage, lora_dropout, budget) in cases.items():
        try:
            out[name] = _compare(model_path, stage, lora_dropout, budget)
        except Exception as err:
            raise RuntimeError(f"case {name}") from err  # the traceback names the case
    return out


@pytest.fixture(scope="module")
def compared(tiny_qwen2_dir) -> dict[str, list[dict]]:
    """Each case's results, one per rank."""
    ranks = run_distributed(
        _compare_cases, world_size=2, args=(tiny_qwen2_dir, CASES), timeout_s=600
    )
    return {name: [rank[name] for rank in ranks] for name in CASES}


@pytest.mark.parametrize("case", ["zero2", "zero3", "zero3-token-budget-packed"])
def test_train_step_fills_old_logprobs_as_the_separate_pass(compared, case):
    for res in compared[case]:
        assert res["no_grad_rows"] == [4], res  # only the second optimizer step's rows
        assert res["old_diff_first_step"] <= ATOL, res
        assert res["old_diff_later_steps"] <= ATOL, res
        assert res["loss"][0] == pytest.approx(res["loss"][1], abs=ATOL), res
        assert res["ratio_max"][0] == pytest.approx(res["ratio_max"][1], abs=ATOL), res
        assert res["weights_diff"] <= ATOL, res


def test_with_dropout_every_row_gets_the_no_grad_forward(compared):
    """A train forward with dropout is not the old policy's: the first step's rows must not
    take it (they would differ from the eval-mode pass by the dropped units)."""
    [res, _] = compared["zero2-dropout"]
    assert res["no_grad_rows"] == [8], res
    assert res["old_diff_first_step"] <= ATOL, res
    assert res["old_diff_later_steps"] <= ATOL, res
