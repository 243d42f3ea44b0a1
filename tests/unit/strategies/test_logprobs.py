"""The strategies' shared math: token log-probs / entropy from logits, position ids under left
padding, micro-batching, the LR schedule, and LoRA merging into HF names."""

from __future__ import annotations

import math

import pytest
import torch

from roll_ds.models.tensors import position_ids_from_mask
from strategies._common import (
    build_lr_scheduler,
    entropy_from_logits,
    logprobs_from_logits,
    lr_lambda,
    split_batch,
)


def test_logprobs_hand_computed():
    logits_BTV = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]]])
    labels_BT = torch.tensor([[2, 0]])
    # uniform over 4 -> log(1/4); [3,1,1,1]/6 at label 0 -> log(1/2)
    expected = torch.tensor([[math.log(0.25), math.log(0.5)]])
    torch.testing.assert_close(logprobs_from_logits(logits_BTV, labels_BT), expected)


def test_logprobs_fp32_from_bf16_and_large_logits():
    logits = torch.tensor([[[1000.0, 0.0]]], dtype=torch.bfloat16)
    out = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(-1000.0)


def test_entropy_uniform_and_peaked():
    uniform = entropy_from_logits(torch.zeros(2, 3, 8))
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(8.0)))
    peaked = entropy_from_logits(torch.tensor([[[50.0, 0.0, 0.0]]]))
    assert peaked.item() < 1e-10
    p = torch.tensor([0.5, 0.25, 0.25])
    by_hand = -(p * p.log()).sum()
    torch.testing.assert_close(entropy_from_logits(p.log()[None, None]), by_hand[None, None])


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 2, 2]])
    assert torch.equal(position_ids_from_mask(mask), expected)


def test_split_batch_cuts_batch_tensors_only():
    batch = {
        "input_ids": torch.arange(10).view(5, 2),
        "scale": torch.tensor(3.0),  # 0-d: shared
        "weights_T": torch.ones(2),  # first dim is not the batch: shared
        "tag": "x",
    }
    chunks = split_batch(batch, 2)
    assert [c["input_ids"].shape[0] for c in chunks] == [2, 2, 1]
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), batch["input_ids"])
    assert all(c["scale"] is batch["scale"] and c["tag"] == "x" for c in chunks)
    assert all(c["weights_T"] is batch["weights_T"] for c in chunks)
    with pytest.raises(ValueError):
        split_batch(batch, 0)


C45 = math.cos(math.pi / 4)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),
        ("cosine", [0.5, 1.0, 1.0, (1 + C45) / 2, 0.5, (1 - C45) / 2]),
    ],
)
def test_lr_schedule_warmup_then_decay(kind, expected):
    # Warmup 1/w..1 over w=2 steps, then decay over the remaining 4 steps, reaching 0 at step 6.
    got = [lr_lambda(step, warmup_steps=2, total_steps=6, kind=kind) for step in range(6)]
    assert got == pytest.approx(expected)
    final = 1.0 if kind == "constant" else 0.0
    assert lr_lambda(6, warmup_steps=2, total_steps=6, kind=kind) == pytest.approx(final)
    assert lr_lambda(10, warmup_steps=2, total_steps=6, kind=kind) == pytest.approx(final)


def test_lr_scheduler_drives_optimizer_and_rejects_unknown():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = build_lr_scheduler(opt, warmup_steps=0, total_steps=4, kind="linear")
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.075, 0.05, 0.025])
    state = sched.state_dict()  # checkpointable (no lambdas that cannot be saved)
    assert state["last_epoch"] == 4
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        build_lr_scheduler(opt, warmup_steps=0, total_steps=4, kind="poly")


class _Tiny(torch.nn.Module):
    """Embedding tied to the output head, two linears: the shapes LoRA merging cares about."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.proj = torch.nn.Linear(4, 4, bias=True)
        self.lm_head = torch.nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.proj(self.embed(x)))


def test_weight_units_merge_lora_and_emit_tied_head():
    peft = pytest.importorskip("peft")
    from roll_ds.models.lora import hf_param_name, weight_units

    torch.manual_seed(0)
    base = _Tiny()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["proj"])
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # peft initialises B to 0 (a no-op adapter)
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(x)
    weights = {n: t for unit in weight_units(model) for n, t in unit.produce()}
    assert set(weights) == {"embed.weight", "proj.weight", "proj.bias", "lm_head.weight"}
    assert weights["lm_head.weight"] is weights["embed.weight"]
    plain = _Tiny()
    plain.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected)
    # The training copy is untouched (merging happens on copies).
    lora_layer = model.base_model.model.proj
    assert not lora_layer.merged
    assert hf_param_name("a.proj.base_layer.weight") == "a.proj.weight"


def test_trainer_entropy_is_finite_with_masked_vocabulary():
    """-inf logits (a masked vocabulary) contribute 0 to the entropy and its gradient, in the
    path the trainer uses (one implementation, shared with roll_ds.algorithms)."""
    import math

    from roll_ds.algorithms.kl import entropy_from_logits as algorithms_entropy
    from strategies import _common

    assert _common.entropy_from_logits is algorithms_entropy
    logits = torch.tensor([[[0.0, 0.0, -math.inf, -math.inf]]], requires_grad=True)
    entropy = _common.entropy_from_logits(logits)
    assert torch.allclose(entropy, torch.tensor([[math.log(2.0)]]))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
