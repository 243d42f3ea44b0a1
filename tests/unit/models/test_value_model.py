"""The critic's value model: body from the causal-LM checkpoint, scalar head, LoRA keeps the head
trainable, values aligned with log-probs (left padding does not shift them)."""

import pytest
import torch

from roll_ds.models.value_model import apply_value_lora, forward_values, load_value_model


@pytest.fixture(scope="module")
def value_model(tiny_qwen2_dir):
    torch.manual_seed(0)
    return load_value_model(tiny_qwen2_dir)


def test_body_is_the_checkpoint_and_head_is_scalar(tiny_qwen2_dir, value_model):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert type(value_model).__name__ == "Qwen2ForTokenClassification"
    assert value_model.score.out_features == 1
    assert value_model.dropout.p == 0.0  # transformers' default would be 0.1
    body = dict(value_model.model.named_parameters())
    for name, param in lm.model.named_parameters():
        assert torch.equal(body[name], param), name


def test_values_are_the_head_on_each_prefix(value_model):
    ids = torch.tensor([[5, 9, 17, 3, 44, 2]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values_BT = forward_values(value_model, ids, mask)
        hidden = value_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = value_model.score(hidden)[:, :-1, 0]
    assert values_BT.shape == (1, 5) and values_BT.dtype == torch.float32
    torch.testing.assert_close(values_BT, expected)


def test_left_padding_does_not_shift_values(value_model):
    ids = torch.tensor([[0, 0, 5, 9, 17, 3], [5, 9, 17, 3, 44, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        values_BT = forward_values(value_model, ids, mask)
    # Row 0 is row 1's first 4 tokens, left-padded by 2: columns 2..4 score the same prefixes.
    torch.testing.assert_close(values_BT[0, 2:], values_BT[1, :3], rtol=1e-5, atol=1e-5)


def test_lora_critic_trains_adapters_and_the_whole_head(tiny_qwen2_dir):
    torch.manual_seed(0)
    model = apply_value_lora(load_value_model(tiny_qwen2_dir), rank=4, target="all-linear")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"base_model.model.score.weight", "base_model.model.score.bias"} <= trainable
    assert all("lora_" in n or ".score." in n for n in trainable), trainable
    assert not any("score.lora" in n for n in trainable)  # no adapter on the head itself
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    head_before = model.base_model.model.score.weight.detach().clone()

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.tensor([[5, 9, 17, 3, 44, 2]])
    values_BT = forward_values(model, ids, torch.ones_like(ids))
    ((values_BT - 1.0) ** 2).mean().backward()
    optimizer.step()

    assert not torch.equal(model.base_model.model.score.weight, head_before)
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name


def test_full_critic_trains_everything(value_model):
    assert all(p.requires_grad for p in value_model.parameters())


def test_value_head_strategy_refuses_policy_calls():
    from strategies.deepspeed.train import DeepSpeedTrainStrategy

    critic = DeepSpeedTrainStrategy(model_path="unused", strategy_config={}, head="value")
    with pytest.raises(ValueError, match="compute_logprobs needs head='lm'"):
        critic.compute_logprobs(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))
    with pytest.raises(ValueError, match="weight sync needs head='lm'"):
        critic.named_weights_for_sync(1024)
    with pytest.raises(ValueError, match="unknown head 'q'; valid: lm, value"):
        DeepSpeedTrainStrategy(model_path="unused", strategy_config={}, head="q")
