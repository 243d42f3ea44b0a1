"""The embedded reward model ``embedded:tiny-rm``: how the tiny Qwen2 sequence classifier that
roll_ds ships in ``roll_ds/models/embedded_tiny_rm/`` (no hub is reachable) was built.

It tells right answers to the synthetic tasks from wrong ones. Like a real reward model it starts
from the policy it will judge (the embedded policy's body, same tokenizer, a fresh scalar head)
and learns from labelled answers to the train prompts:

- the domain's typical flaws, written out: the sign slip and off-by-one / off-by-ten numbers,
  an extra or a missing digit (``math``); the reversal one letter short, the first letter
  missing, the word unreversed, two letters swapped (``reverse``); an empty answer;
- the embedded policy's own samples at temperature 1, the answers RL will have it judge.

Labels come from the rule (``data.dataset.answers_match``); the loss is pointwise logistic, so
``sigmoid(score)`` reads as the probability that the answer is right. Its held-out accuracy
(eval prompts, never trained on) is recorded in ``roll_ds_recipe.json``: the share of answers
classified right at score 0, and the pairwise accuracy (a right answer outscores a wrong answer
to the same prompt), over all candidates and over the policy's samples alone.

As with the policy, the build is a float computation whose result differs between machines, so
the built directory is shipped; ``python scripts/make_embedded.py --model rm`` rebuilds it
(about a minute); a unit test fails while the shipped copy is stale.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from examples.embedded_models.common import policy_model, torch_threads, write_info
from examples.embedded_models.synthetic import (
    DOMAINS,
    TaskSpec,
    flawed_answer,
    generate_domain,
    to_jsonl,
)
from roll_ds.config.schema import EMBEDDED_RM
from roll_ds.data.dataset import answers_match

NAME = EMBEDDED_RM
RECIPE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RewardModelRecipe:
    """Everything that determines the built weights (hashed, with the policy it starts from and
    the task rows, into the recipe digest)."""

    seed: int = 11
    data: TaskSpec = field(default_factory=TaskSpec)
    policy_samples: int = 4  # samples of the embedded policy per prompt, temperature 1
    max_new_tokens: int = 8  # as the default run's response_length
    steps: int = 800
    batch_size: int = 128
    lr: float = 1.0e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    num_threads: int = 1

    def to_dict(self) -> dict:
        return {"version": RECIPE_VERSION, **asdict(self)}

    def digest(self, policy_digest: str | None) -> str:
        blob = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode())
        blob.update(str(policy_digest).encode())
        for domain in DOMAINS:
            for rows in generate_domain(domain, self.data).values():
                blob.update(to_jsonl(rows).encode())
        return blob.hexdigest()[:12]


DEFAULT_RECIPE = RewardModelRecipe()


def current_digest() -> str:
    return DEFAULT_RECIPE.digest(policy_model()[1])


def report(info: dict) -> str:
    return "held-out accuracy:\n" + json.dumps(info["held_out"], indent=2)


# --- data ------------------------------------------------------------------------------------


def written_flaws(domain: str, ground_truth: str, prompt: str) -> list[str]:
    """The domain's typical wrong answers to one problem, written out (some may be right, e.g.
    the sign slip of 0: the rule labels every candidate)."""
    flaws = [flawed_answer(domain, ground_truth), ""]
    if domain == "math":
        value = int(ground_truth)
        flaws += [str(value + d) for d in (1, -1, 10, -10)]
        flaws += [ground_truth + str(abs(value) % 10), ground_truth[:-1]]
    else:
        word = prompt.removeprefix("reverse ").removesuffix("=")
        swapped = ground_truth[1] + ground_truth[0] + ground_truth[2:]
        flaws += [ground_truth[1:], word, swapped, ground_truth + ground_truth[-1]]
    return flaws


def candidates(rows: list[dict], samples: list[list[str]]) -> list[dict]:
    """Labelled answers per prompt: the right one, the written flaws and the policy's samples,
    deduplicated; ``{prompt, domain, response, label, sampled}``."""
    out = []
    for row, sampled in zip(rows, samples, strict=True):
        seen: set[str] = set()
        gt, domain = row["ground_truth"], row["domain"]
        written = [gt, *written_flaws(domain, gt, row["prompt"])]
        for text in [*written, *sampled]:
            if text in seen:
                continue
            seen.add(text)
            out.append(
                {
                    "prompt": row["prompt"],
                    "domain": domain,
                    "response": text,
                    "label": float(answers_match(text, gt, domain)),
                    "sampled": text in sampled,  # the policy produced it
                }
            )
    return out


def sample_responses(
    model: Any, tokenizer: Any, rows: list[dict], n: int, seed: int, max_new_tokens: int
) -> list[list[str]]:
    """``n`` temperature-1 samples of ``model`` per row (prompts batched by length, no padding)."""
    import torch

    by_length: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    for i, row in enumerate(rows):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        by_length[len(ids)].append((i, ids))
    out: list[list[str]] = [[] for _ in rows]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for length in sorted(by_length):
            items = by_length[length]
            for start in range(0, len(items), 256):
                chunk = items[start : start + 256]
                ids = torch.tensor([p for _, p in chunk], dtype=torch.long)
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    num_return_sequences=n,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                texts = tokenizer.batch_decode(gen[:, length:], skip_special_tokens=True)
                for j, (i, _) in enumerate(chunk):
                    out[i] = texts[j * n : (j + 1) * n]
    return out


# --- build -----------------------------------------------------------------------------------


def build(out_dir: str, recipe: RewardModelRecipe = DEFAULT_RECIPE) -> dict:
    """Start from the embedded policy, train on labelled answers, measure, save."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_ds.models.reward_model import load_reward_model

    start = time.perf_counter()
    with torch_threads(recipe.num_threads):
        policy_dir, policy_digest = policy_model()
        tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
        train_rows, eval_rows = [], []
        for domain in DOMAINS:
            splits = generate_domain(domain, recipe.data)
            train_rows += splits["train"]
            eval_rows += splits["eval"]
        n = recipe.policy_samples
        train = candidates(
            train_rows,
            sample_responses(policy, tokenizer, train_rows, n, recipe.seed, recipe.max_new_tokens),
        )
        held_out = candidates(
            eval_rows,
            sample_responses(
                policy, tokenizer, eval_rows, n, recipe.seed + 1, recipe.max_new_tokens
            ),
        )
        del policy
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)  # the fresh head's init
            model = load_reward_model(policy_dir, "sequence_classification")
        losses = train_classifier(model, tokenizer, train, recipe)
        accuracy = evaluate(model, tokenizer, held_out)
    info = {
        "recipe": recipe.to_dict(),
        "recipe_digest": recipe.digest(policy_digest),
        "policy_digest": policy_digest,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_train_answers": len(train),
        "train_positive_fraction": round(sum(c["label"] for c in train) / len(train), 4),
        "num_held_out_answers": len(held_out),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "held_out": accuracy,
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_info(out_dir, info)
    return info


def _encode(tokenizer: Any, items: list[dict]) -> tuple[Any, Any]:
    from roll_ds.models.reward_model import left_pad

    seqs = [
        tokenizer(c["prompt"] + c["response"], add_special_tokens=False)["input_ids"] for c in items
    ]
    return left_pad(seqs, tokenizer.pad_token_id)


def train_classifier(
    model: Any, tokenizer: Any, items: list[dict], recipe: RewardModelRecipe
) -> list[float]:
    """Logistic loss on ``score`` vs the rule's label, positives up-weighted to balance the
    classes; returns the mean loss of each 100 steps."""
    import torch
    import torch.nn.functional as F

    from roll_ds.models.reward_model import forward_scores

    ids_BT, mask_BT = _encode(tokenizer, items)
    labels_B = torch.tensor([c["label"] for c in items])
    positives = float(labels_B.sum())
    pos_weight = torch.tensor((len(items) - positives) / max(positives, 1.0))
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
        idx = torch.randint(len(items), (recipe.batch_size,), generator=generator)
        mask = mask_BT[idx]
        width = int(mask.sum(1).max())
        scores = forward_scores(
            model, "sequence_classification", ids_BT[idx, -width:], mask[:, -width:]
        )
        loss = F.binary_cross_entropy_with_logits(scores, labels_B[idx], pos_weight=pos_weight)
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


def score_items(
    model: Any, tokenizer: Any, items: list[dict], batch_size: int = 512
) -> list[float]:
    import torch

    from roll_ds.models.reward_model import forward_scores

    ids_BT, mask_BT = _encode(tokenizer, items)
    out = []
    with torch.no_grad():
        for start in range(0, len(items), batch_size):
            out += forward_scores(
                model,
                "sequence_classification",
                ids_BT[start : start + batch_size],
                mask_BT[start : start + batch_size],
            ).tolist()
    return out


def evaluate(model: Any, tokenizer: Any, items: list[dict]) -> dict[str, Any]:
    """Held-out accuracies, overall and per domain (see the module docstring)."""
    scores = score_items(model, tokenizer, items)
    result: dict[str, Any] = {}
    for domain in [None, *DOMAINS]:
        sel = [(c, s) for c, s in zip(items, scores, strict=True) if domain in (None, c["domain"])]
        result[domain or "overall"] = {
            "classification_accuracy": round(
                sum((s > 0) == bool(c["label"]) for c, s in sel) / len(sel), 4
            ),
            "pairwise_accuracy": _pairwise(sel, sampled_only=False),
            "policy_pairwise_accuracy": _pairwise(sel, sampled_only=True),
        }
    return result


def _pairwise(scored: list[tuple[dict, float]], sampled_only: bool) -> float | None:
    """Share of (right, wrong) answer pairs to the same prompt where the right one scores
    higher; ``sampled_only``: over the answers the policy sampled alone."""
    by_prompt: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c, s in scored:
        if c["sampled"] or not sampled_only:
            by_prompt[c["prompt"]].append((c["label"], s))
    wins = total = 0
    for answers in by_prompt.values():
        right = [s for label, s in answers if label]
        wrong = [s for label, s in answers if not label]
        for r in right:
            for w in wrong:
                wins += r > w
                total += 1
    return round(wins / total, 4) if total else None
