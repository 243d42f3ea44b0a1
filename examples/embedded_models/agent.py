"""The embedded agent model ``embedded:tiny-agent``: the embedded policy warmed up on episodes
(how the model roll_ds ships in ``roll_ds/models/embedded_tiny_agent/`` was built).

It starts from the embedded policy (``embedded:tiny-qwen2``) and learns, supervised, from
demonstration episodes of the two shipped environments (``roll_ds/agentic/envs/``), laid out
token for token as the episode runner lays them out (``roll_ds.agentic.chat.ChatFormat`` with
``AGENT_CHAT_TEMPLATE``: first prompt, then each policy turn ending with ``<|im_end|>``, then
each observation's tokens); the loss is on the policy's turns only.

As with the policy's own warm-up, the demonstrations are of mixed quality, so that RL has
something to learn:

- ``calculator`` ("37*89="): a share ``tool_fraction`` calls the ``calc`` tool in the hermes
  form and copies its result; the rest answers at once with a plausible wrong number (within
  about 10 % of the product).
- ``guess_number`` ("Guess a number 1-32."): a share ``search_fraction`` plays binary search on
  the "higher" / "lower" replies, a share ``careless_fraction`` binary search with half of its
  guesses at random; the rest (the most common game) counts up from 1 whatever the replies say.

The model learns all of these, and prefers the flawed ones: greedy, it mostly answers the
product at once and counts up from 1, while its samples call the tool or search often enough
that a GRPO group of 8 holds both successes and failures. Its held-out greedy and sampled
(temperature 1) success per environment, played by the framework's episode runner over HF
``generate`` (``measure``), is recorded in ``roll_ds_recipe.json``
(``held_out``). A compact ``calc`` call is 67 tokens: the runner's per-turn token limit must
allow it (the measurement uses ``max_new_tokens``).

As with the other embedded models the build is a float computation whose result differs
between machines, so the built directory is shipped; ``python scripts/make_embedded.py --model
agent`` rebuilds it; a unit test fails while the shipped copy is stale.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from examples.embedded_models.common import policy_model, torch_threads, write_info
from roll_ds.config.schema import EMBEDDED_AGENT

NAME = EMBEDDED_AGENT
RECIPE_VERSION = 1

AGENT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_start|>={{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_start|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""Minimal, for 256 positions: a user or system message is ``<|im_start|>text<|im_end|>``, a
tool result ``<|im_start|>=text<|im_end|>``, an assistant turn its text and ``<|im_end|>``; no
generation prompt (the policy speaks right after the last ``<|im_end|>``); ``tools`` unused."""

ENV_NAMES = ("calculator", "guess_number")
MAX_CONTEXT = 256  # the tiny Qwen2's max_position_embeddings


@dataclass(frozen=True, kw_only=True)
class AgentRecipe:
    """Everything that determines the built weights (hashed, with the policy it starts from,
    the chat template and the demonstration episodes, into the recipe digest).

    ``guess_low``/``guess_high``, ``calc_digits`` and ``max_turns`` are the environments'
    ``env_config`` and the runner's ``max_actions_per_traj`` the model is warmed up (and
    measured) for. Demonstrations use seeds ``0..n_train-1`` per environment; the held-out
    measurement ``n_eval`` seeds from ``eval_seed_start`` (greedy once each, sampled
    ``eval_samples`` times each at temperature 1).
    """

    seed: int = 17
    guess_low: int = 1
    guess_high: int = 32
    calc_digits: int = 2
    max_turns: int = 6
    n_train: int = 3000
    tool_fraction: float = 0.4
    search_fraction: float = 0.35
    careless_fraction: float = 0.1
    calculator_weight: float = 0.65  # share of the calculator's episodes in a batch
    steps: int = 900
    batch_size: int = 32
    lr: float = 1.5e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_new_tokens: int = 80  # a compact calc call is 67 tokens, its <|im_end|> one more
    n_eval: int = 200
    eval_seed_start: int = 1_000_000
    eval_samples: int = 2
    num_threads: int = 1

    def to_dict(self) -> dict:
        return {"version": RECIPE_VERSION, **asdict(self)}

    def env_config(self, name: str) -> dict[str, Any]:
        if name == "guess_number":
            return {"low": self.guess_low, "high": self.guess_high}
        return {"digits": self.calc_digits}

    def digest(self, policy_digest: str | None) -> str:
        return _digest(self, policy_digest)


@functools.lru_cache(maxsize=8)
def _digest(recipe: AgentRecipe, policy_digest: str | None) -> str:
    """Cached: playing the demonstrations takes about a second."""
    blob = hashlib.sha256(json.dumps(recipe.to_dict(), sort_keys=True).encode())
    blob.update(str(policy_digest).encode())
    blob.update(AGENT_CHAT_TEMPLATE.encode())
    for episode in demonstrations(recipe):  # the environments' texts and the players
        blob.update(json.dumps(episode, sort_keys=True).encode())
    return blob.hexdigest()[:12]


DEFAULT_RECIPE = AgentRecipe()


def current_digest() -> str:
    return DEFAULT_RECIPE.digest(policy_model()[1])


def report(info: dict) -> str:
    return "held-out success:\n" + json.dumps(info["held_out"], indent=2)


# --- demonstrations --------------------------------------------------------------------------


def make_env(name: str, recipe: AgentRecipe) -> Any:
    from roll_ds.agentic.registry import ENVS

    return ENVS.get(name)(**recipe.env_config(name))


def calculator_actions(task: str, rng: random.Random, tool_fraction: float) -> list[str]:
    """The player's turns before seeing replies: a ``calc`` call (then the result is copied,
    see ``play``) or a direct answer within about 10 % of the product, never the product."""
    a, b = (int(x) for x in task.removesuffix("=").split("*"))
    if rng.random() < tool_fraction:
        call = {"name": "calc", "arguments": {"expr": f"{a}*{b}"}}
        return [f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"]
    delta = rng.randint(1, max(1, a * b // 10))
    return [str(a * b + rng.choice((-1, 1)) * delta)]


def guess_player(low: int, high: int, rng: random.Random, recipe: AgentRecipe) -> Callable:
    """A guessing strategy ``(history of (guess, hint)) -> next guess``: binary search with
    probability ``search_fraction``; "careless" binary search (half of the guesses after the
    first drawn at random) with probability ``careless_fraction``; else "linear": ``low``,
    ``low + 1``, ... whatever the replies say. Linear is the most common and opens differently
    (with ``low``, the others with the middle), so a model that imitates the demonstrations
    prefers it greedily while its samples open with binary search about as often as the
    demonstrations do."""
    u = rng.random()
    if u < recipe.search_fraction:
        style = "search"
    elif u < recipe.search_fraction + recipe.careless_fraction:
        style = "careless"
    else:
        style = "linear"

    def next_guess(history: list[tuple[int, str]]) -> int:
        if style == "linear":
            return history[-1][0] + 1 if history else low
        lo, hi = low, high
        for guess, hint in history:
            if hint == "higher":
                lo = max(lo, guess + 1)
            else:
                hi = min(hi, guess - 1)
        if style == "careless" and history and rng.random() < 0.5:
            return rng.randint(low, high)
        return (lo + hi) // 2 if lo <= hi else (low + high) // 2

    return next_guess


def play(name: str, seed: int, recipe: AgentRecipe) -> dict:
    """One demonstration episode, played against the real environment:
    ``{"env", "seed", "first": first observation, "turns": [[action, observation, done]]}``."""
    rng = random.Random(recipe.seed * 1_000_003 + seed * 2 + (name == "guess_number"))
    env = make_env(name, recipe)
    first = env.reset(seed)
    turns: list[list] = []
    success = False
    if name == "calculator":
        actions = calculator_actions(first, rng, recipe.tool_fraction)
        for action in actions:
            result = env.step(action)
            turns.append([action, result.observation, result.done])
        if not turns[-1][2]:  # a tool call: answer with its result
            answer = turns[-1][1][0]["content"]
            result = env.step(answer)
            turns.append([answer, result.observation, result.done])
        success = bool(result.info.get("success"))
    else:
        player = guess_player(recipe.guess_low, recipe.guess_high, rng, recipe)
        history: list[tuple[int, str]] = []
        for _ in range(recipe.max_turns):
            guess = player(history)
            result = env.step(str(guess))
            turns.append([str(guess), result.observation, result.done])
            success = bool(result.info.get("success"))
            if result.done:
                break
            history.append((guess, result.observation))
    return {"env": name, "seed": seed, "first": first, "turns": turns, "success": success}


def demonstrations(recipe: AgentRecipe) -> list[dict]:
    return [play(name, seed, recipe) for name in ENV_NAMES for seed in range(recipe.n_train)]


def encode_episode(fmt: Any, episode: dict) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of a demonstration in the runner's layout; labels are -100 outside
    the policy's turns (their ``<|im_end|>`` included)."""
    from roll_ds.agentic.env import as_messages

    ids = fmt.prompt_ids(as_messages(episode["first"]))
    labels = [-100] * len(ids)
    for action, observation, done in episode["turns"]:
        turn = [*fmt.encode(action), fmt.eos_id]
        ids += turn
        labels += turn
        if not done:
            obs = fmt.observation_ids(as_messages(observation))
            ids += obs
            labels += [-100] * len(obs)
    return ids, labels


# --- build -----------------------------------------------------------------------------------


def agent_tokenizer(policy_dir: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    return tokenizer


def save_agent_tokenizer(tokenizer: Any, out_dir: str) -> None:
    """``save_pretrained`` (transformers 5 writes the template to ``chat_template.jinja``) with
    the chat template also in ``tokenizer_config.json``, where older readers look for it."""
    from examples.embedded_models.tiny import save_tokenizer

    save_tokenizer(tokenizer, out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = AGENT_CHAT_TEMPLATE
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def build(out_dir: str, recipe: AgentRecipe = DEFAULT_RECIPE) -> dict:
    """Start from the embedded policy, warm up on the demonstrations, measure, save."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll_ds.agentic.chat import ChatFormat

    start = time.perf_counter()
    with torch_threads(recipe.num_threads):
        policy_dir, policy_digest = policy_model()
        tokenizer = agent_tokenizer(policy_dir)
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        fmt = ChatFormat(tokenizer)
        episodes = demonstrations(recipe)
        encoded = {
            name: [encode_episode(fmt, e) for e in episodes if e["env"] == name]
            for name in ENV_NAMES
        }
        losses = warm_up(model, encoded, recipe)
        held_out = measure(model, fmt, recipe)
    lengths = [len(ids) for name in ENV_NAMES for ids, _ in encoded[name]]
    info = {
        "recipe": recipe.to_dict(),
        "recipe_digest": recipe.digest(policy_digest),
        "policy_digest": policy_digest,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "demonstrations": demo_stats(episodes, lengths),
        "loss_per_100_steps": [round(x, 4) for x in losses],
        "held_out": held_out,
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    model.save_pretrained(out_dir, safe_serialization=True)
    save_agent_tokenizer(tokenizer, out_dir)
    write_info(out_dir, info)
    return info


def demo_stats(episodes: list[dict], lengths: list[int]) -> dict:
    out = {}
    for name in ENV_NAMES:
        sel = [(e, n) for e, n in zip(episodes, lengths, strict=True) if e["env"] == name]
        out[name] = {
            "episodes": len(sel),
            "success": round(sum(e["success"] for e, _ in sel) / len(sel), 4),
            "mean_turns": round(sum(len(e["turns"]) for e, _ in sel) / len(sel), 3),
            "max_tokens": max(n for _, n in sel),
        }
    return out


def warm_up(model: Any, encoded: dict[str, list[tuple[list[int], list[int]]]], recipe) -> list:
    """Supervised steps on random batches of demonstrations, a share ``calculator_weight`` of
    each from the calculator; the loss is the mean over the policy's tokens. A batch goes
    through the model in two chunks by length (calculator answers are short, episodes long).
    Returns the mean loss of each 100 steps."""
    import torch
    import torch.nn.functional as F

    rows = [row for name in ENV_NAMES for row in encoded[name]]
    width = max(len(ids) for ids, _ in rows)
    ids_BT = torch.zeros((len(rows), width), dtype=torch.long)
    labels_BT = torch.full_like(ids_BT, -100)
    lengths_B = torch.tensor([len(ids) for ids, _ in rows])
    for i, (ids, labels) in enumerate(rows):
        ids_BT[i, : len(ids)] = torch.tensor(ids)
        labels_BT[i, : len(ids)] = torch.tensor(labels)
    mask_BT = (torch.arange(width)[None] < lengths_B[:, None]).long()
    share = {"calculator": recipe.calculator_weight, "guess_number": 1 - recipe.calculator_weight}
    weights = torch.cat(
        [torch.full((len(encoded[n]),), share[n] / len(encoded[n])) for n in ENV_NAMES]
    )
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / recipe.warmup_steps)
    )
    model.train()
    history, window = [], []
    for step in range(recipe.steps):
        idx = torch.multinomial(weights, recipe.batch_size, replacement=True, generator=generator)
        idx = idx[lengths_B[idx].argsort(stable=True)]
        loss_sum, n_tokens = 0.0, 0
        for chunk in idx.chunk(2):
            w = int(lengths_B[chunk].max())
            logits = model(input_ids=ids_BT[chunk, :w], attention_mask=mask_BT[chunk, :w]).logits
            targets = labels_BT[chunk, 1:w]
            loss_sum = loss_sum + F.cross_entropy(
                logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            n_tokens += int((targets != -100).sum())
        loss = loss_sum / n_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == recipe.steps:
            history.append(sum(window) / len(window))
            window = []
    model.eval()
    return history


# --- measuring -------------------------------------------------------------------------------


def measure(model: Any, fmt: Any, recipe: AgentRecipe) -> dict:
    """Held-out success per environment, played by the framework's own episode runner
    (``roll_ds.agentic.runner.EpisodeRunner``) with ``model`` as a local engine: greedy (one
    episode per seed) and sampled at temperature 1 (``eval_samples`` per seed)."""
    from roll_ds.agentic.env_pool import EnvTypeSpec, LocalEnvPool
    from roll_ds.agentic.runner import EpisodeRunner, EpisodeSpec, TurnLimits, one_sample_each

    seeds = list(range(recipe.eval_seed_start, recipe.eval_seed_start + recipe.n_eval))
    out = {}
    for k, name in enumerate(ENV_NAMES):
        results = {}
        for label, n, sampled in (("greedy", 1, False), ("sampled_t1", recipe.eval_samples, True)):
            runner = EpisodeRunner(
                tokenizer=fmt.tokenizer,
                pool=LocalEnvPool({name: EnvTypeSpec(name, recipe.env_config(name))}, 30.0),
                generate=one_sample_each(local_engine(model, fmt, sampled)),
                limits={name: TurnLimits(recipe.max_turns, recipe.max_new_tokens)},
                max_context_tokens=MAX_CONTEXT,
            )
            specs = [EpisodeSpec(i, i, name, seed) for i, seed in enumerate(seeds * n)]
            results[label] = summarize(runner.run(specs, seed=recipe.seed + k)[0])
        out[name] = results
    return out


def summarize(episodes: list[Any]) -> dict:
    n = len(episodes)
    return {
        "episodes": n,
        "success": round(sum(e.success for e in episodes) / n, 4),
        "mean_turns": round(sum(e.num_turns for e in episodes) / n, 3),
        "tool_calls_per_episode": round(sum(e.tool_calls for e in episodes) / n, 3),
        "format_errors_per_episode": round(sum(e.format_errors for e in episodes) / n, 3),
        "tool_errors_per_episode": round(sum(e.tool_errors for e in episodes) / n, 3),
    }


def local_engine(model: Any, fmt: Any, sampled: bool) -> Callable:
    """The runner's ``generate`` (token ids in, ids out) over HF ``generate`` on ``model``:
    left-padded contexts, each turn cut at its ``<|im_end|>`` or its token limit; greedy, or
    temperature 1 seeded by the runner's per-turn seed. Log-probs are not needed here (zeros)."""
    import torch

    pad, eos = fmt.tokenizer.pad_token_id, fmt.eos_id
    sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}

    def generate(contexts, max_new_tokens, rows, seed):
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(max_new_tokens),
                eos_token_id=eos,
                pad_token_id=pad,
                **(sampling if sampled else {"do_sample": False}),
            )
        turns = []
        for row, limit in enumerate(max_new_tokens):
            turn = out[row, width:].tolist()[:limit]
            turns.append(turn[: turn.index(eos) + 1] if eos in turn else turn)
        return {"response_ids": turns, "rollout_logprobs": [[0.0] * len(t) for t in turns]}

    return generate
