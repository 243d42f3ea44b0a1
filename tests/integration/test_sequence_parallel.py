"""Ulysses sequence parallelism (``sequence_parallel_size: 2``) on two gloo ranks equals the
unsplit computation: one SP group of both ranks, each holding half the mini-batch's rows (as
dispatch gives them) and computing half of every row's columns.

Against a single-process reference on the whole mini-batch (``test_loss_normalization``'s: the
policy loss normalized over the optimizer step, AdamW with a large epsilon so the first update is
linear in the gradient): each rank's log-probs and entropy of its own rows, the grad norm, and
the weights after one optimizer step. Rows are 33 columns wide (odd: the SP padding runs) and of
very unequal lengths. CI runs token-budget micro-batches with packing under ZeRO-3 (whose packed
row's sequences attend each on its own); the slow case adds row-count micro-batches (ZeRO 2 and
3), packing alone (ZeRO-0) and a budget alone (ZeRO-2). The reference role's strategy
(``deepspeed_infer``) is checked on the same rows.
"""

from __future__ import annotations

import os

import pytest
from _dist import run_distributed
from _train_helpers import make_strategy, quiet
from test_loss_normalization import EPS, LR, _mini_batch, _policy_loss, _rank_rows, _reference

pytestmark = pytest.mark.integration

LOGPROB_ATOL = 1e-5  # fp32; the brief's bound
RTOL, ATOL = 1e-4, 2e-7  # the weights after one step, as test_loss_normalization's splits
# (ZeRO stage, strategy keys); the CI case takes the most code: budget x SP, packed sequences
# attended apart, ZeRO-3's lockstep forwards
CI_CASES = [(3, {"max_tokens_per_micro_batch": 40, "use_sequence_packing": True})]
SLOW_CASES = [
    (2, {}),
    (0, {"use_sequence_packing": True}),
    (3, {}),
    (2, {"max_tokens_per_micro_batch": 40}),
]


def _sp_run(model_path: str, cases: list) -> dict:
    import torch

    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for stage, extra in cases:
        zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        s = make_strategy(
            model_path,
            stage,
            zero=zero,
            learning_rate=LR,
            adam_epsilon=EPS,
            max_grad_norm=1e6,  # never clips, but makes every stage report the grad norm
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            sequence_parallel_size=world,
            **extra,
        )
        rows = _rank_rows(_mini_batch(), s.rank, world)
        got = s.compute_logprobs(rows["input_ids"], rows["attention_mask"], with_entropy=True)
        metrics = s.train_step(rows, _policy_loss(), with_entropy=True)
        weights = {
            name: t.detach().clone().cpu().numpy()
            for bucket in s.named_weights_for_sync(bucket_bytes=2**30)
            for name, t in bucket
        }
        s.close()
        key = f"zero{stage}" + "".join(f"_{k}" for k in sorted(extra))
        out[key] = {
            "logprobs": got["logprobs_BT"].numpy(),
            "entropy": got["entropy_BT"].numpy(),
            "metrics": metrics,
            "weights": weights,
            "rows": (s.rank * 4, s.rank * 4 + 4),
        }
    # the reference role's strategy, on the same rows
    from _train_helpers import preset

    from roll_ds.config.schema import ModelArgs
    from strategies.deepspeed.infer import DeepSpeedInferStrategy

    quiet()
    ref = DeepSpeedInferStrategy(
        model_path=model_path,
        strategy_config=preset(3),
        model_args=ModelArgs(),
        infer_batch_size=2,
        sequence_parallel_size=world,
    )
    ref.initialize()
    rows = _rank_rows(_mini_batch(), ref.rank, world)
    out["reference"] = {
        "logprobs": ref.compute_logprobs(rows["input_ids"], rows["attention_mask"])[
            "logprobs_BT"
        ].numpy()
    }
    ref.close()
    torch.distributed.barrier()
    return out


def _unsplit(model_path: str) -> dict:
    """Log-probs and entropy of the whole mini-batch in one padded forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from strategies._common import forward_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = _mini_batch()
    with torch.no_grad():
        out = forward_logprobs(
            model, batch["input_ids"], batch["attention_mask"], with_entropy=True
        )
    mask = batch["attention_mask"][:, 1:].bool().numpy()  # columns whose next token is real
    return {
        "logprobs": out["logprobs_BT"].numpy(),
        "entropy": out["entropy_BT"].numpy(),
        "mask": mask,
    }


def _check(results: list, model_path: str) -> None:
    unsplit = _unsplit(model_path)
    ref = _reference(model_path, "token-mean")
    for rank, res in enumerate(results):
        for name, got in res.items():
            a, b = (rank * 4, rank * 4 + 4)
            mask = unsplit["mask"][a:b]
            keys = ("logprobs", "entropy") if "entropy" in got else ("logprobs",)
            for key in keys:
                gap = float(abs(got[key] - unsplit[key][a:b])[mask].max())
                assert gap <= LOGPROB_ATOL, (rank, name, key, gap)
            if "weights" not in got:
                continue
            norm = got["metrics"]["grad_norm"]
            assert norm == pytest.approx(ref["grad_norm"], rel=RTOL), (rank, name)
            for key, tensor in got["weights"].items():
                gap = float(abs(tensor - ref["weights"][key]).max())
                bound = ATOL + RTOL * float(abs(ref["weights"][key]).max())
                assert gap <= bound, (rank, name, key, gap)


def test_sequence_parallel_matches_unsplit(tiny_qwen2_dir):
    results = run_distributed(_sp_run, world_size=2, args=(tiny_qwen2_dir, CI_CASES))
    _check(results, tiny_qwen2_dir)


@pytest.mark.slow
def test_sequence_parallel_more_combinations(tiny_qwen2_dir):
    results = run_distributed(_sp_run, world_size=2, args=(tiny_qwen2_dir, SLOW_CASES))
    _check(results, tiny_qwen2_dir)
