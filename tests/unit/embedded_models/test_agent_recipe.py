"""The embedded agent model's recipe (examples/embedded_models/agent.py): the shipped copy loads
with its chat template, its demonstrations are laid out exactly as the episode runner lays out
episodes, and its recorded held-out success leaves RL something to learn. (That the shipped copy
is current: test_recipe_digests.py.)"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from examples.embedded_models.agent import (
    AGENT_CHAT_TEMPLATE,
    DEFAULT_RECIPE,
    ENV_NAMES,
    NAME,
    agent_tokenizer,
    demonstrations,
    encode_episode,
)
from examples.embedded_models.common import policy_model
from roll_ds.models.shipped import RECIPE_FILE, shipped_model

SHIPPED_DIR = shipped_model(NAME).path
SMALL = replace(DEFAULT_RECIPE, n_train=200)


@pytest.fixture(scope="module")
def fmt():
    from roll_ds.agentic.chat import ChatFormat

    return ChatFormat(agent_tokenizer(policy_model()[0]))


def test_shipped_model_loads_with_its_chat_template():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_ds.agentic.chat import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_DIR)
    assert tokenizer.chat_template == AGENT_CHAT_TEMPLATE
    with open(os.path.join(SHIPPED_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == AGENT_CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 258
    fmt = ChatFormat(tokenizer)
    first = fmt.prompt_ids([{"role": "user", "content": "6*7="}])
    assert first == [257, *b"6*7=", 258]
    assert fmt.observation_ids([{"role": "tool", "content": "42"}]) == [257, *b"=42", 258]
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR)
    assert model.config.max_position_embeddings == 256
    assert model.generation_config.eos_token_id == 258


def test_recorded_held_out_success_leaves_rl_something_to_learn():
    with open(os.path.join(SHIPPED_DIR, RECIPE_FILE), encoding="utf-8") as f:
        held_out = json.load(f)["held_out"]
    for name in ENV_NAMES:
        greedy, sampled = held_out[name]["greedy"], held_out[name]["sampled_t1"]
        assert 0.02 <= greedy["success"] <= 0.5, (name, greedy)
        assert 0.1 <= sampled["success"] <= 0.6, (name, sampled)
    assert held_out["calculator"]["sampled_t1"]["tool_calls_per_episode"] > 0.1


def test_demonstrations_are_laid_out_as_the_runner_does(fmt):
    from roll_ds.agentic.env import as_messages

    episodes = demonstrations(SMALL)
    tool_demo = next(e for e in episodes if e["env"] == "calculator" and len(e["turns"]) == 2)
    (call, tool_obs, _), (answer, _, done) = tool_demo["turns"]
    assert call.startswith('<tool_call>{"name":"calc"') and done and tool_demo["success"]
    ids, labels = encode_episode(fmt, tool_demo)
    prompt = fmt.prompt_ids(as_messages(tool_demo["first"]))
    turn1, turn2 = [*fmt.encode(call), fmt.eos_id], [*fmt.encode(answer), fmt.eos_id]
    observation = fmt.observation_ids(as_messages(tool_obs))
    assert ids == prompt + turn1 + observation + turn2
    masked = [-100] * len(prompt) + turn1 + [-100] * len(observation) + turn2
    assert labels == masked
    assert fmt.tokenizer.decode(ids) == (
        f"<|im_start|>{tool_demo['first']}<|im_end|>{call}<|im_end|>"
        f"<|im_start|>={tool_obs[0]['content']}<|im_end|>{answer}<|im_end|>"
    )
    lengths = [len(encode_episode(fmt, e)[0]) for e in episodes]
    assert max(lengths) <= 160


def test_demonstrations_are_of_mixed_quality():
    episodes = demonstrations(SMALL)
    for name in ENV_NAMES:
        own = [e for e in episodes if e["env"] == name]
        success = sum(e["success"] for e in own) / len(own)
        assert 0.2 < success < 0.7, (name, success)
    calc = [e for e in episodes if e["env"] == "calculator"]
    tool_share = sum(len(e["turns"]) == 2 for e in calc) / len(calc)
    assert abs(tool_share - SMALL.tool_fraction) < 0.1
    assert all(e["success"] == (len(e["turns"]) == 2) for e in calc)  # direct answers are wrong
    openings = [e["turns"][0][0] for e in episodes if e["env"] == "guess_number"]
    assert openings.count("1") > openings.count("16") > 0  # counting up is the commonest game


def test_digest_follows_the_recipe():
    policy = policy_model()[1]
    assert SMALL.digest(policy) == replace(SMALL).digest(policy)
    assert SMALL.digest(policy) != replace(SMALL, tool_fraction=0.5).digest(policy)
    assert SMALL.digest(policy) != SMALL.digest("another policy")


@pytest.fixture(scope="module")
def shipped_agent():
    import torch
    from transformers import AutoModelForCausalLM

    from roll_ds.agentic.chat import ChatFormat

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32).eval()
    return model, ChatFormat(agent_tokenizer(SHIPPED_DIR))


def test_local_engine_turns_end_at_their_eos_or_limit_and_ignore_padding(shipped_agent):
    from examples.embedded_models.agent import local_engine

    model, fmt = shipped_agent
    contexts = [fmt.prompt_ids([{"role": "user", "content": t}]) for t in ("6*7=", "Guess 1-32.")]
    generate = local_engine(model, fmt, sampled=False)
    both = generate(contexts, [80, 3], [0, 1], 0)["response_ids"]
    alone = [generate([c], [80], [0], 0)["response_ids"][0] for c in contexts]
    assert both[0] == alone[0] and both[1] == alone[1][:3]  # left padding changes nothing
    assert both[0][-1] == fmt.eos_id and fmt.eos_id not in both[0][:-1]
    sampled = local_engine(model, fmt, sampled=True)
    out = sampled(contexts, [80, 80], [0, 1], 5)
    assert out == sampled(contexts, [80, 80], [0, 1], 5)  # seeded by the runner's turn seed
    assert [len(x) for x in out["rollout_logprobs"]] == [len(x) for x in out["response_ids"]]


def test_held_out_measurement_plays_the_runner_deterministically(shipped_agent):
    from examples.embedded_models.agent import measure

    model, fmt = shipped_agent
    recipe = replace(DEFAULT_RECIPE, n_eval=6, eval_samples=2)
    held_out = measure(model, fmt, recipe)
    assert held_out == measure(model, fmt, recipe)
    for name in ENV_NAMES:
        assert held_out[name]["greedy"]["episodes"] == 6
        assert held_out[name]["sampled_t1"]["episodes"] == 12
        assert 1 <= held_out[name]["greedy"]["mean_turns"] <= recipe.max_turns
