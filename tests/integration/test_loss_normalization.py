"""The policy loss is normalized over the whole optimizer-step mini-batch, whatever the split.

One mini-batch of 8 responses of very unequal lengths (1 to 30 tokens) is trained for one
optimizer step on real DeepSpeed engines, split as micro 1 x accumulation 8, 4 x 2 and 8 x 1 on
one rank, and 1 x 4, 2 x 2 and 4 x 1 on each of two ranks, under ZeRO 0 and 3. Every split must
give the update of a single-process reference that computes the loss (PPO clip + KL + entropy)
on the whole mini-batch at once. AdamW with a large epsilon makes the first update proportional
to the gradient (lr * g / (|g| + eps)), so a wrongly scaled gradient shows in the weights, and
the reported grad norm is compared too. A control run with per-micro-batch normalization (the
old behaviour) must miss the reference, so the test can tell the two apart.

Micro-batches cut by a token budget (``max_tokens_per_micro_batch``: a varying number per
optimizer step, matched across the ranks), with and without padding-free packing, must give the
same update; their log-prob passes (``compute_logprobs``) must match the row-count pass's.
"""

from __future__ import annotations

import os

import pytest
from _dist import run_distributed
from _train_helpers import make_strategy

pytestmark = pytest.mark.integration

RESPONSE_LENGTHS = [1, 30, 2, 28, 1, 3, 25, 2]  # micro-batches of 1, 2 and 4 rows all differ
PROMPT = 3
LR, EPS = 1.0, 1.0  # first AdamW update ~ lr * g / (|g| + eps): linear in g for small g
# fp32, one step: the splits differ from the reference only in summation order.
RTOL, ATOL = 1e-4, 2e-7
SPLITS = {1: [(1, 8), (4, 2), (8, 1)], 2: [(1, 4), (2, 2), (4, 1)]}
# Widths are 4-33 tokens: 40 makes 3-5 micro-batches per rank (counts differ between the ranks).
TOKEN_BUDGET = 40
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _policy_loss(agg_mode: str = "token-mean"):
    from roll_ds.pipeline.loss_fns import PolicyLoss

    return PolicyLoss(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
        ratio_level="token",
        agg_mode=agg_mode,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
        tis_cap=None,
        norm_constant=32.0,
    )


class _PerMicroBatch:
    """The old behaviour: the same loss, each micro batch normalized on its own."""

    needs_entropy = True

    def __init__(self, loss) -> None:
        self.loss = loss

    def __call__(self, logprobs_BT, batch, entropy_BT=None):
        return self.loss(logprobs_BT, batch, entropy_BT)


def _mini_batch(vocab: int = 128) -> dict:
    """8 rows: prompt of 3 tokens, responses of RESPONSE_LENGTHS, right padded; loss columns."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows, width = len(RESPONSE_LENGTHS), PROMPT + max(RESPONSE_LENGTHS)
    input_ids = torch.randint(0, vocab, (rows, width), generator=g)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros(rows, width - 1)
    for b, length in enumerate(RESPONSE_LENGTHS):
        attention_mask[b, : PROMPT + length] = 1
        response_mask[b, PROMPT - 1 : PROMPT - 1 + length] = 1.0
    input_ids = input_ids * attention_mask
    noise = lambda scale: scale * torch.randn(rows, width - 1, generator=g)  # noqa: E731
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "loss_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, width - 1).contiguous(),
        # Log-probs of the random tiny model are about -4.85; old / ref around that, with noise,
        # so that some ratios clip and the KL is not zero.
        "old_logprobs": -4.85 + noise(0.3),
        "ref_logprobs": -4.85 + noise(0.3),
        "rollout_logprobs": -4.85 + noise(0.3),
    }


def _rank_rows(batch: dict, rank: int, world_size: int) -> dict:
    per = len(RESPONSE_LENGTHS) // world_size
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def _train_once(model_path: str, stage: int, micro: int, accum: int, loss_fn, **token_args) -> dict:
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    s = make_strategy(
        model_path,
        stage,
        zero=zero,
        learning_rate=LR,
        adam_epsilon=EPS,
        max_grad_norm=1e6,  # never clips, but makes every stage report the grad norm
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        **token_args,
    )
    rows = _rank_rows(_mini_batch(), s.rank, s.world_size)
    logprobs = s.compute_logprobs(rows["input_ids"], rows["attention_mask"])["logprobs_BT"]
    metrics = s.train_step(rows, loss_fn, with_entropy=True)
    weights = {  # numpy: torch tensors would cross the process boundary as shared memory
        name: tensor.detach().clone().cpu().numpy()
        for bucket in s.named_weights_for_sync(bucket_bytes=2**30)
        for name, tensor in bucket
    }
    s.close()
    return {"metrics": metrics, "weights": weights, "logprobs": logprobs.cpu().numpy()}


def _splits_on_ranks(model_path: str) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for stage in (0, 3):
        for micro, accum in SPLITS[world]:
            out[f"zero{stage}_{micro}x{accum}"] = _train_once(
                model_path, stage, micro, accum, _policy_loss()
            )
        micro, accum = SPLITS[world][0]
        for packed in (False, True):
            out[f"zero{stage}_{'packed' if packed else 'tokens'}{TOKEN_BUDGET}"] = _train_once(
                model_path,
                stage,
                micro,
                accum,
                _policy_loss(),
                max_tokens_per_micro_batch=TOKEN_BUDGET,
                use_sequence_packing=packed,
            )
    micro, accum = SPLITS[world][0]
    for mode in AGG_MODES[1:]:
        out[f"{mode}_{micro}x{accum}"] = _train_once(
            model_path, 3, micro, accum, _policy_loss(mode)
        )
    out["per_micro_batch"] = _train_once(
        model_path, 0, micro, accum, _PerMicroBatch(_policy_loss())
    )
    return out


def _reference(model_path: str, agg_mode: str) -> dict:
    """One AdamW step on the loss of the whole mini-batch, in one process."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll_ds.algorithms.aggregation import MiniBatchNorm
    from strategies._common import forward_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    batch = _mini_batch()
    loss_fn = _policy_loss(agg_mode)
    tokens, sequences = loss_fn.mini_batch_counts(batch).tolist()
    out = forward_logprobs(
        model, batch["input_ids"], batch["attention_mask"], with_entropy=True, temperature=1.0
    )
    loss, _ = loss_fn(
        out["logprobs_BT"], batch, out["entropy_BT"], norm=MiniBatchNorm(tokens, sequences)
    )
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    optimizer.step()
    weights = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    return {"grad_norm": float(grad_norm), "weights": weights}


def _max_gap(weights: dict, reference: dict) -> float:
    return max(float(abs(weights[k] - reference[k]).max()) for k in weights)


def _check(name: str, got: dict, ref: dict) -> None:
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL), name
    for key, tensor in got["weights"].items():
        assert tensor.shape == ref["weights"][key].shape, (name, key)
        gap = float(abs(tensor - ref["weights"][key]).max())
        assert gap <= ATOL + RTOL * float(abs(ref["weights"][key]).max()), (name, key, gap)


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_split_matches_the_whole_mini_batch(tiny_qwen2_dir, world_size):
    refs = {mode: _reference(tiny_qwen2_dir, mode) for mode in AGG_MODES}
    results = run_distributed(
        _splits_on_ranks, world_size=world_size, args=(tiny_qwen2_dir,), timeout_s=600
    )
    for rank, res in enumerate(results):
        for name, got in res.items():
            if name == "per_micro_batch":
                continue
            prefix = name.rsplit("_", 1)[0]
            mode = prefix if prefix in AGG_MODES else "token-mean"
            _check(f"rank {rank} {name}", got, refs[mode])
        # Log-probs by tokens (and packed) equal the row-count pass's where they are defined.
        mask = _rank_rows(_mini_batch(), rank, world_size)["attention_mask"].numpy()
        valid = mask[:, 1:] * mask[:, :-1]
        for stage in (0, 3):
            rows = res[f"zero{stage}_{SPLITS[world_size][0][0]}x{SPLITS[world_size][0][1]}"]
            for kind in ("tokens", "packed"):
                got = res[f"zero{stage}_{kind}{TOKEN_BUDGET}"]["logprobs"]
                assert abs((got - rows["logprobs"]) * valid).max() < 1e-5, (rank, stage, kind)
        # The control: per-micro-batch normalization gives a different gradient.
        control = res["per_micro_batch"]
        assert control["metrics"]["grad_norm"] != pytest.approx(
            refs["token-mean"]["grad_norm"], rel=0.02
        )
        assert _max_gap(control["weights"], refs["token-mean"]["weights"]) > 100 * ATOL
