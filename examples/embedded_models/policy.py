"""The embedded default policy ``embedded:tiny-qwen2``: how the tiny Qwen2 that roll_ds ships in
``roll_ds/models/embedded_tiny_qwen2/`` (about 2 MB) was built.

It is shipped rather than built on each machine because the build is a long float computation
on the CPU: another machine's rounding takes it down another training path to another model, and
the default run's results with it. ``python scripts/make_embedded.py --model policy`` rebuilds
the shipped copy; a unit test fails while it was built from another recipe than this one.

The build is a seeded init (``tiny.py``) and then a short supervised warm-up on demonstrations
of mixed quality: most demonstrations carry the domain's typical flaw (``synthetic.flawed_answer``:
a sign slip in math, a reversal that stops one letter short). The model learns to do the task,
but prefers the flawed answer, so its greedy held-out accuracy starts low while its samples
often hold the right answer. That is the situation RL with verifiable rewards is for (imitation
data of mixed quality, a verifier that knows better), at a size that trains in minutes on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from examples.embedded_models.common import torch_threads, write_info
from examples.embedded_models.synthetic import (
    DOMAINS,
    TaskSpec,
    flawed_answer,
    generate_domain,
    to_jsonl,
)
from examples.embedded_models.tiny import TinyQwen2Spec
from roll_ds.config.schema import EMBEDDED_MODEL
from roll_ds.data.dataset import answers_match

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

NAME = EMBEDDED_MODEL
# Bump when the build code changes what a recipe produces (the task data is hashed separately).
RECIPE_VERSION = 3


@dataclass(frozen=True, kw_only=True)
class WarmupRecipe:
    """Everything that determines the built weights (hashed into the recipe digest).

    The warm-up trains on the synthetic train split, each demonstration flawed with probability
    ``flawed_fraction``. Every ``check_every`` steps it measures the greedy *skill* on a dev
    split (``n_dev`` fresh problems per domain, disjoint from both the train and the eval
    split): the share of prompts answered either right or with exactly the domain's flaw, i.e.
    how well the model does the task whichever answer it prefers. It stops at the first check
    where every domain's skill reaches ``target_skill`` (or at ``max_steps``) and keeps the
    weights of the most skilled check (by its weakest domain).

    Between checks each domain's share of a batch is its ``domain_weights`` entry scaled by how
    far its skill still is below the target (at least ``min_weight_scale``): in a model this
    small the domains compete for capacity, and without that the faster one races ahead.

    Stopping on measured skill rather than at a fixed step count keeps the result alike even
    where float rounding sends another machine's training down a different path.
    """

    seed: int = 7
    model: TinyQwen2Spec = field(default_factory=TinyQwen2Spec)
    data: TaskSpec = field(default_factory=TaskSpec)
    max_steps: int = 1500
    batch_size: int = 64
    lr: float = 1.5e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    domain_weights: dict[str, float] = field(
        default_factory=lambda: {"math": 0.85, "reverse": 0.15}
    )
    check_every: int = 25
    n_dev: int = 200
    # Most demonstrations are flawed, so the warmed-up model prefers the flaw (greedy accuracy
    # starts low) while its samples are right about 40 % of the times it knows the answer.
    flawed_fraction: float = 0.6
    target_skill: float = 0.45
    min_weight_scale: float = 0.05
    num_threads: int = 1

    def to_dict(self) -> dict:
        return {"version": RECIPE_VERSION, **asdict(self)}

    def digest(self) -> str:
        """The recipe plus the exact rows the warm-up learns from and is judged on, so a change
        to the task generator also calls for a new model."""
        blob = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode())
        for split in _splits(self):
            blob.update(to_jsonl(split).encode())
        return blob.hexdigest()[:12]


DEFAULT_RECIPE = WarmupRecipe()


def current_digest() -> str:
    return DEFAULT_RECIPE.digest()


def report(info: dict) -> str:
    return (
        f"{info['warmup']['steps']} warm-up steps, held-out greedy accuracy "
        f"{info['warmup_eval_accuracy']}"
    )


def build(out_dir: str, recipe: WarmupRecipe = DEFAULT_RECIPE) -> dict:
    """Init, warm up, measure and save the model, tokenizer and ``roll_ds_recipe.json``."""
    from examples.embedded_models.tiny import build_tokenizer, init_model, save_tokenizer

    start = time.perf_counter()
    with torch_threads(recipe.num_threads):
        tokenizer = build_tokenizer()
        model = init_model(tokenizer, recipe.model, recipe.seed)
        train_rows, dev_rows, eval_rows = _splits(recipe)
        history = warm_up(model, tokenizer, train_rows, dev_rows, recipe)
        accuracy, skill = greedy_accuracy_and_skill(model, tokenizer, eval_rows)
    info = {
        "recipe": recipe.to_dict(),
        "recipe_digest": recipe.digest(),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "warmup": history,
        "warmup_eval_accuracy": accuracy,
        "warmup_eval_skill": skill,
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    write_info(out_dir, info)
    return info


def _splits(recipe: WarmupRecipe) -> tuple[list[dict], list[dict], list[dict]]:
    """Train and eval rows (for the default ``TaskSpec``, exactly the shipped files) and dev rows
    for the stopping rule.

    Growing ``n_train`` only appends rows, so the rows past the shipped train split are fresh
    problems that appear in neither shipped split.
    """
    spec = recipe.data
    grown = replace(spec, n_train=spec.n_train + recipe.n_dev)
    train, dev, held_out = [], [], []
    for domain in DOMAINS:
        rows = generate_domain(domain, grown)
        train += rows["train"][: spec.n_train]
        dev += rows["train"][spec.n_train :]
        held_out += rows["eval"]
    assert not {r["prompt"] for r in dev} & {r["prompt"] for r in train + held_out}
    return train, dev, held_out


def greedy_accuracy_and_skill(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict]
) -> tuple[dict[str, float], dict[str, float]]:
    """Greedy accuracy on ``rows``, and skill: the share answered right or with exactly the
    domain's flaw (``synthetic.flawed_answer``). Both as ``{"overall": a, "<domain>": a}``."""
    texts = greedy_responses(model, tokenizer, rows)
    right, skilled = [], []
    for row, text in zip(rows, texts, strict=True):
        hit = answers_match(text, row["ground_truth"], row["domain"])
        right.append(hit)
        skilled.append(hit or text.strip() == flawed_answer(row["domain"], row["ground_truth"]))
    return accuracy_by_domain(rows, right), accuracy_by_domain(rows, skilled)


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_rows: list[dict],
    dev_rows: list[dict],
    recipe: WarmupRecipe,
) -> dict:
    """Supervised warm-up on ``prompt -> answer + eos`` (loss on the response only), where the
    answer is flawed with probability ``recipe.flawed_fraction``; stopped by the rule in
    ``WarmupRecipe``, the model ends with the weights of the chosen check. Returns the history
    of checks (mean loss, dev accuracy and skill) and the chosen step."""
    import copy

    import torch

    domains = sorted({r["domain"] for r in train_rows})
    encoded = {
        d: _encode_demos(tokenizer, [r for r in train_rows if r["domain"] == d]) for d in domains
    }
    base = torch.tensor([recipe.domain_weights.get(d, 0.0) for d in domains], dtype=torch.float64)
    if not base.sum() > 0:
        raise ValueError(f"domain_weights {recipe.domain_weights} give no weight to {domains}")
    weights = base.clone()
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / recipe.warmup_steps)
    )
    history: dict = {"steps": 0, "chosen_step": 0, "checks": []}
    best: tuple[float, dict] | None = None
    losses: list[float] = []
    model.train()
    for step in range(1, recipe.max_steps + 1):
        loss = _batch_loss(model, encoded, domains, weights, recipe, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        history["steps"] = step
        if step % recipe.check_every and step != recipe.max_steps:
            continue
        accuracy, skill = greedy_accuracy_and_skill(model, tokenizer, dev_rows)
        history["checks"].append(
            {
                "step": step,
                "loss": sum(losses) / len(losses),
                "dev_accuracy": accuracy,
                "dev_skill": skill,
            }
        )
        losses = []
        weakest = min(skill[d] for d in domains)
        if best is None or weakest > best[0]:
            best = (weakest, copy.deepcopy(model.state_dict()))
            history["chosen_step"] = step
        if weakest >= recipe.target_skill:
            break
        weights = _domain_shares(base, [skill[d] for d in domains], recipe)
    if best is not None:
        model.load_state_dict(best[1])
    model.eval()
    return history


def _domain_shares(base, skills: list[float], recipe: WarmupRecipe):
    """Batch shares for the next steps: the domains compete for the tiny model's capacity (one
    trained alone erases the other within ~50 steps), so each domain's base share shrinks as its
    dev skill nears the target (down to ``min_weight_scale``)."""
    import torch

    gaps = torch.tensor([1.0 - s / recipe.target_skill for s in skills], dtype=torch.float64)
    return base * gaps.clamp(min=recipe.min_weight_scale)


def _batch_loss(model, encoded: dict, domains: list[str], weights, recipe, generator):
    """Mean response-token loss of one batch that mixes the domains by ``weights``; each row is
    the flawed demonstration of its problem with probability ``recipe.flawed_fraction``.

    Each domain's rows go through the model as their own chunk (similar lengths, so little
    padding); the loss is the mean over all the batch's response tokens.
    """
    import torch
    import torch.nn.functional as F

    picks = torch.multinomial(weights, recipe.batch_size, replacement=True, generator=generator)
    loss_sum, n_tokens = 0.0, 0
    for i, domain in enumerate(domains):
        count = int((picks == i).sum())
        if not count:
            continue
        input_ids, labels, attention_mask = encoded[domain]
        n_problems = len(input_ids) // 2  # right demonstrations first, then the flawed ones
        idx = torch.randint(n_problems, (count,), generator=generator)
        flawed = torch.rand(count, generator=generator) < recipe.flawed_fraction
        idx = idx + n_problems * flawed.long()
        width = int(attention_mask[idx].sum(1).max())
        logits = model(
            input_ids=input_ids[idx, :width], attention_mask=attention_mask[idx, :width]
        ).logits
        targets = labels[idx, 1:width]
        loss_sum = loss_sum + F.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        n_tokens += int((targets != -100).sum())
    return loss_sum / n_tokens


def _encode_demos(tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> tuple:
    """``_encode`` of every row's right demonstration followed by its flawed one."""
    flawed = [{**r, "ground_truth": flawed_answer(r["domain"], r["ground_truth"])} for r in rows]
    return _encode(tokenizer, rows + flawed)


def _encode(tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> tuple:
    """Right-padded ``(input_ids, labels, attention_mask)`` for ``prompt + answer + eos``; the
    labels are -100 outside the answer and eos, so only the response is learned."""
    import torch

    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["ground_truth"], add_special_tokens=False)["input_ids"]
        examples.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    attention_mask = torch.zeros_like(input_ids)
    for i, (ids, n_prompt) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = input_ids[i, n_prompt : len(ids)]
        attention_mask[i, : len(ids)] = 1
    return input_ids, labels, attention_mask


# --- measuring (greedy, batched by prompt length) -----------------------------------------


def greedy_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> list[str]:
    """``model``'s greedy response text to each row's prompt, in the order of ``rows``.

    Prompts are batched by token length, so no batch needs padding and the result is the same
    as one-by-one decoding (and as vLLM's greedy decoding of the same weights).
    """
    import torch

    by_length: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    for i, row in enumerate(rows):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        by_length[len(ids)].append((i, ids))
    responses = [""] * len(rows)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for length in sorted(by_length):
                items = by_length[length]
                for start in range(0, len(items), batch_size):
                    chunk = items[start : start + batch_size]
                    input_ids = torch.tensor([ids for _, ids in chunk], dtype=torch.long)
                    out = model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                    texts = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
                    for (i, _), text in zip(chunk, texts, strict=True):
                        responses[i] = text
    finally:
        model.train(was_training)
    return responses


def accuracy_by_domain(rows: list[dict], hits: Iterable[bool]) -> dict[str, float]:
    """``{"overall": a, "<domain>": a, ...}`` from one hit flag per row."""
    by_domain: dict[str, list[bool]] = defaultdict(list)
    for row, hit in zip(rows, hits, strict=True):
        by_domain[row["domain"]].append(bool(hit))
    result = {d: sum(v) / len(v) for d, v in sorted(by_domain.items())}
    everything = [h for v in by_domain.values() for h in v]
    result["overall"] = sum(everything) / max(len(everything), 1)
    return result


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Iterable[dict],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> dict[str, float]:
    """Greedy accuracy of ``model`` on ``rows``: ``{"overall": a, "<domain>": a, ...}``."""
    rows = list(rows)
    texts = greedy_responses(
        model, tokenizer, rows, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    pairs = zip(rows, texts, strict=True)
    return accuracy_by_domain(
        rows, [answers_match(t, r["ground_truth"], r["domain"]) for r, t in pairs]
    )
