"""repair_stage3_load on what DeepSpeed 0.19.8's stage-3 universal load leaves: a torch AdamW
whose sub-groups share one ``step`` tensor and all carry the first group's hyperparameters
(strategies/deepspeed/universal.py). The engine is a stand-in (only ``optimizer.optimizer`` is
read); the optimizer and the saved state file are real. The end-to-end check, 2 ranks -> 1
and back under ZeRO-3: tests/integration/test_universal_checkpoint.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from strategies.deepspeed.universal import repair_stage3_load

LR, B1, B2 = 1e-3, 0.9, 0.999


def _as_loaded(tmp_path, *, weight_decay: float = 0.1):
    """A 2-group AdamW after one step, then set up as DeepSpeed's stage-3 universal load sets
    it: one step tensor shared by both groups' states, group 0's hyperparameters everywhere;
    and the universal checkpoint's ``zero/optimizer_state.pt`` with both groups' own."""
    matrix, bias = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    groups = [
        {"params": [matrix], "weight_decay": weight_decay},
        {"params": [bias], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(B1, B2))
    for p in (matrix, bias):
        p.grad = torch.ones(4)
    optimizer.step()
    saved = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    zero = tmp_path / "engine_universal" / "zero"
    zero.mkdir(parents=True)
    torch.save({"param_groups": saved}, zero / "optimizer_state.pt")
    shared = optimizer.state[matrix]["step"]
    optimizer.state[bias]["step"] = shared
    optimizer.param_groups[1]["weight_decay"] = weight_decay
    engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))
    return engine, optimizer, (matrix, bias)


def test_shared_step_makes_the_second_group_step_short(tmp_path):
    """The defect itself: with one step tensor the second group steps with t + 1."""
    _, optimizer, (matrix, bias) = _as_loaded(tmp_path, weight_decay=0.0)
    for p in (matrix, bias):
        p.grad = -torch.ones(4)  # the sign flipped: the moments' bias corrections differ
    before = bias.detach().clone()
    optimizer.step()
    assert float(optimizer.state[bias]["step"]) == 3  # advanced by both groups
    short = float((bias.detach() - before).abs().max())
    # one-step moments after a +1 then -1 gradient, as Adam computes them at t = 2 and t = 3
    m, v = 0.9 * 0.1 - 0.1, 0.999 * 0.001 + 0.001

    def update(t: int) -> float:
        return LR * abs(m / (1 - B1**t)) / (math.sqrt(v / (1 - B2**t)) + 1e-8)

    assert short == pytest.approx(update(3), rel=1e-3)  # fp32 differences near 1.0
    assert short / update(2) == pytest.approx(0.8585, abs=1e-3)  # the "14% short"


def test_repair_gives_each_group_its_own_step_and_hyperparameters(tmp_path):
    engine, optimizer, (matrix, bias) = _as_loaded(tmp_path)
    repair_stage3_load(engine, str(tmp_path), "engine_universal")
    steps = [optimizer.state[p]["step"] for p in (matrix, bias)]
    assert steps[0] is not steps[1] and [float(s) for s in steps] == [1.0, 1.0]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(g["params"] for g in optimizer.param_groups)  # the params kept
    for p in (matrix, bias):
        p.grad = torch.ones(4)
    optimizer.step()
    assert [float(optimizer.state[p]["step"]) for p in (matrix, bias)] == [2.0, 2.0]


def test_repair_refuses_another_number_of_groups(tmp_path):
    engine, optimizer, _ = _as_loaded(tmp_path)
    optimizer.param_groups.pop()
    with pytest.raises(ValueError, match="2 optimizer parameter groups and this engine 1"):
        repair_stage3_load(engine, str(tmp_path), "engine_universal")


def test_a_failed_conversion_names_the_checkpoint_and_leaves_nothing(tmp_path):
    """The driver's conversion runs DeepSpeed's converter in a process of its own: on files that
    are no checkpoint it fails with a CheckpointError naming the source, and no output stays."""
    from roll_ds.checkpoint import CheckpointError
    from strategies.deepspeed.universal import convert_in_child

    source = tmp_path / "engine"
    source.mkdir()
    (source / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=f"converting {source} to a universal checkpoint"):
        convert_in_child(str(source), str(tmp_path / "engine_universal"), timeout_s=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]


def test_a_trainer_never_converts(tmp_path):
    """A rank's load reads the driver's conversion; missing, it says how to make it."""
    from strategies.deepspeed.universal import converted_tag

    with pytest.raises(FileNotFoundError, match=r"python -m strategies\.deepspeed\.universal"):
        converted_tag(str(tmp_path), "engine")
    (tmp_path / "engine_universal").mkdir()
    assert converted_tag(str(tmp_path), "engine") == "engine_universal"
