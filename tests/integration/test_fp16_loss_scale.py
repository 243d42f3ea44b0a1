"""fp16 with dynamic loss scaling on 2 CPU ranks: an overflow step is skipped (weights unchanged),
counted in ``train/overflow_steps`` and halves ``train/loss_scale``; a checkpoint resumes with the
scaler's state (scale and count) and continues as the run that wrote it.

DeepSpeed's engine refuses fp16 where its accelerator's ``is_fp16_supported()`` is false, and on
CPU that asks oneDNN for native fp16 kernels (AVX512-FP16 / AMX-FP16), which most CPUs lack; torch
computes fp16 on any CPU. So each rank answers that query (and ``supported_dtypes``, which the
engine's reductions read) with yes: the boundary is faked, everything behind it (the fp16 model,
DeepSpeed's ZeRO optimizer, its loss scaler, the overflow check across ranks, the checkpoint) is
real. Without the fake the engine is refused with that reason (test_deepspeed_train checks it).
"""

from __future__ import annotations

import pytest
from _dist import run_distributed
from _train_helpers import make_strategy, nll_loss, rank_batch

pytestmark = pytest.mark.integration

# The tiny model's fp16 gradients (max 65504) overflow at a loss scale of 2**19 and fit at 2**18
# (measured): 2**20 makes two skipped steps before the first that trains.
POWER = 20
FP16 = {
    "enabled": "auto",
    "loss_scale": 0,  # dynamic
    "initial_scale_power": POWER,
    "loss_scale_window": 1000,
    "hysteresis": 1,  # halve at every overflow (the presets' 2 waits for a second one)
    "min_loss_scale": 1,
}
# a decaying LR shows whether a skipped step advanced the schedule
ARGS = dict(dtype="fp16", lr_scheduler_type="linear", max_steps=50)


def _fake_fp16_cpu() -> None:
    import torch
    from deepspeed.accelerator import get_accelerator

    cls = type(get_accelerator())
    cls.is_fp16_supported = lambda self: True
    cls.supported_dtypes = lambda self: [torch.float32, torch.bfloat16, torch.float16]


def _weights(s) -> list:
    """This rank's copy of every weight: its ZeRO-3 partition, or the whole tensor."""
    return [getattr(p, "ds_tensor", p).detach().clone() for p in s.module.parameters()]


def _unchanged(before, after) -> bool:
    import torch

    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _fp16_run(model_path: str, stage: int, ckpt: str) -> dict:
    _fake_fp16_cpu()
    s = make_strategy(model_path, stage, ds_extra={"fp16": FP16}, **ARGS)
    batch = rank_batch(s.rank)
    res: dict = {"dtype": str(next(s.module.parameters()).dtype), "steps": []}
    for _ in range(POWER):  # the scale halves once per skipped step until gradients fit fp16
        before = _weights(s)
        m = s.train_step(batch, nll_loss)
        res["steps"].append(
            {
                "scale": m["train/loss_scale"],
                "overflows": m["train/overflow_steps"],
                "unchanged": _unchanged(before, _weights(s)),
                "loss": m["loss"],
                "lr": m["lr"],
                "grad_norm": m.get("grad_norm"),
            }
        )
        if not res["steps"][-1]["unchanged"]:
            break
    s.save_checkpoint(ckpt, "fp16")
    res["next"] = s.train_step(batch, nll_loss)
    s.close()
    r = make_strategy(model_path, stage, ds_extra={"fp16": FP16}, seed=7, **ARGS)
    r.load_checkpoint(ckpt, "fp16")
    res["resumed"] = r.train_step(batch, nll_loss)
    r.close()
    return res


# ZeRO-3's optimizer checks overflow in its own code; it takes ~60 s on a shared 2-core box
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_overflow_skipped_counted_scale_halved_and_resumed(tiny_qwen2_dir, tmp_path, stage):
    results = run_distributed(
        _fp16_run, world_size=2, args=(tiny_qwen2_dir, stage, str(tmp_path)), timeout_s=300
    )
    for rank, res in enumerate(results):
        where = f"rank {rank}"
        assert res["dtype"] == "torch.float16", where
        steps = res["steps"]
        skipped, applied = steps[:-1], steps[-1]
        assert len(skipped) >= 1 and not applied["unchanged"], (where, steps)
        for k, step in enumerate(skipped, start=1):
            assert step["unchanged"], (where, k, step)  # an overflow step changes no weight
            assert step["overflows"] == k, (where, k, step)
            assert step["scale"] == 2.0 ** (POWER - k), (where, k, step)  # halved each time
            assert step["grad_norm"] is None  # a skipped step's inf norm is not averaged in
        # the first step that fits keeps the scale and the count, and trains
        assert applied["overflows"] == len(skipped)
        assert applied["scale"] == skipped[-1]["scale"]
        assert 0 < applied["grad_norm"] < 100, applied
        # no LR step for a skipped step: the schedule starts where it would have
        assert applied["lr"] == steps[0]["lr"]
        # resumed from the checkpoint: the same scale, count and loss as the run going on
        nxt, resumed = res["next"], res["resumed"]
        for key in ("train/loss_scale", "train/overflow_steps", "loss", "lr"):
            assert resumed[key] == nxt[key], (where, key, resumed[key], nxt[key])
        assert nxt["train/overflow_steps"] == len(skipped)
