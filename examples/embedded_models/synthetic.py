"""Synthetic verifiable tasks for the embedded default run (no dataset hub is reachable): the
generator of the files shipped in ``examples/qwen_rlvr/data/`` (``scripts/make_task_data.py``)
and of what the embedded models learn from. Runs read the files; nothing in roll_ds imports this.

Two domains, so the pipeline can mix them:

- ``math``: ``a+b=`` / ``a-b=``, one operand 0..99 and the other 0..9 (either order, so results
  may be negative); the ground truth is the integer as a string (math-verify compares it).
- ``reverse``: ``reverse abcd=``; the ground truth is the reversed letters (exact match).

A third, ``code`` (tiny stdin/stdout programs, ``synthetic_code.py``), is generated
and shipped beside them but is not in ``DOMAINS``: the embedded model is not warmed up on it and
the default run does not sample it.

Prompts are raw text (the tiny model has no chat template); the expected response is the answer
followed by eos. Generation is a pure function of ``TaskSpec``: the same spec always gives the
same rows, in the same order, and the train and eval splits of a domain never share a prompt.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from examples.embedded_models.synthetic_code import DOMAIN as CODE_DOMAIN
from examples.embedded_models.synthetic_code import CodeTaskSpec, generate_code

DOMAINS = ("math", "reverse")  # the embedded model's warm-up domains
ALL_DOMAINS = (*DOMAINS, CODE_DOMAIN)
SPLITS = ("train", "eval")


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    seed: int = 0
    n_train: int = 1500
    n_eval: int = 200
    max_operand: int = 99  # one operand is 0..max_operand, the other 0..max_small_operand
    max_small_operand: int = 9
    ops: str = "+-"
    min_letters: int = 3
    max_letters: int = 6
    letters: str = "abcdefghijklmnopqrstuvwxyz"

    def to_dict(self) -> dict:
        return asdict(self)


def _math_problems(rng: random.Random, spec: TaskSpec, count: int) -> list[tuple[str, str]]:
    """``count`` distinct problems drawn uniformly (without replacement) from the whole space,
    so every split, and any later slice, sees the same mix of easy and hard problems."""
    space = set()
    for big in range(spec.max_operand + 1):
        for small in range(spec.max_small_operand + 1):
            for a, b in ((big, small), (small, big)):
                for op in spec.ops:
                    space.add((f"{a}{op}{b}=", str(a + b if op == "+" else a - b)))
    problems = sorted(space)
    if len(problems) < count:
        raise ValueError(f"math: the problem space ({len(problems)}) is too small for {count}")
    rng.shuffle(problems)
    return problems[:count]


def _reverse_problems(rng: random.Random, spec: TaskSpec, count: int) -> list[tuple[str, str]]:
    """``count`` distinct words (the space, 26^3 and up, dwarfs any split we draw)."""
    seen: dict[str, str] = {}
    for _ in range(100 * count):
        if len(seen) == count:
            return list(seen.items())
        n = rng.randint(spec.min_letters, spec.max_letters)
        word = "".join(rng.choice(spec.letters) for _ in range(n))
        seen.setdefault(f"reverse {word}=", word[::-1])
    raise ValueError(f"reverse: the problem space is too small for {count} distinct words")


_PROBLEMS: dict[str, Callable[[random.Random, TaskSpec, int], list[tuple[str, str]]]] = {
    "math": _math_problems,
    "reverse": _reverse_problems,
}


def flawed_answer(domain: str, ground_truth: str) -> str:
    """The typical wrong answer of a careless demonstrator, used by the embedded model's warm-up.

    - ``math``: a sign slip (``82`` becomes ``-82``, ``-5`` becomes ``5``); zero has no sign to
      slip, so its demonstration stays right.
    - ``reverse``: the reversal stops one letter short (``kqml`` becomes ``kqm``).

    Both flaws reuse the whole computation of the right answer and differ from it in one
    decision (a leading ``-``, or stopping early), so a model that learned the task from mixed
    demonstrations can produce either answer, and a verifier's reward can teach it which.
    """
    if domain == "math":
        if ground_truth.lstrip("-") == "0":
            return ground_truth
        return ground_truth[1:] if ground_truth.startswith("-") else "-" + ground_truth
    if domain == "reverse":
        return ground_truth[:-1]
    raise ValueError(f"unknown synthetic domain {domain!r}; valid: {', '.join(DOMAINS)}")


def generate_domain(domain: str, spec: TaskSpec) -> dict[str, list[dict]]:
    """``{"train": rows, "eval": rows}`` for one domain; prompts are unique across both splits."""
    if domain == CODE_DOMAIN:
        return generate_code(CodeTaskSpec(seed=spec.seed))
    if domain not in _PROBLEMS:
        raise ValueError(f"unknown synthetic domain {domain!r}; valid: {', '.join(ALL_DOMAINS)}")
    rng = random.Random(spec.seed * 1000 + DOMAINS.index(domain))
    problems = _PROBLEMS[domain](rng, spec, spec.n_eval + spec.n_train)
    # eval first, and the draw is a prefix of a fixed order: growing n_train only appends rows.
    splits = {"eval": problems[: spec.n_eval], "train": problems[spec.n_eval :]}
    rows = {
        split: [
            {"id": f"{domain}-{split}-{i:04d}", "domain": domain, "prompt": p, "ground_truth": a}
            for i, (p, a) in enumerate(items)
        ]
        for split, items in splits.items()
    }
    train_prompts = {r["prompt"] for r in rows["train"]}
    assert not train_prompts.intersection(r["prompt"] for r in rows["eval"]), "split overlap"
    return rows


def generate_all(spec: TaskSpec) -> dict[tuple[str, str], list[dict]]:
    """``{(domain, split): rows}`` for every domain (``code`` included) and split."""
    out: dict[tuple[str, str], list[dict]] = {}
    for domain in ALL_DOMAINS:
        for split, rows in generate_domain(domain, spec).items():
            out[(domain, split)] = rows
    return out


def file_name(domain: str, split: str) -> str:
    return f"{domain}_{split}.jsonl"


def to_jsonl(rows: list[dict]) -> str:
    """Canonical bytes for a rows file: compact JSON, fixed key order, one row per line."""
    return "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=True) + "\n" for r in rows)
