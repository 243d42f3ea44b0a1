"""The synthetic ``code`` domain: tiny stdin -> stdout programs, scored by the ``code`` reward.

A task is a template with one constant (``Read an integer n and print n + 7.``); its ground
truth is a JSON list of stdin/stdout tests (the shape :mod:`roll_ds.rewards.code_reward`
reads), its reference solution a two-line program. Not part of the embedded model's warm-up
(``synthetic.DOMAINS``) nor of the default run's data mix; ``rlvr_code_zero3`` adds it.
Generation is a pure function of :class:`CodeTaskSpec`, like the other synthetic domains.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

DOMAIN = "code"
PROMPT = "Write a Python program: {task}\n"


@dataclass(frozen=True, kw_only=True)
class CodeTaskSpec:
    seed: int = 0
    n_train: int = 150
    n_eval: int = 50
    tests_per_task: int = 3


def _int(rng: random.Random) -> str:
    return f"{rng.randint(0, 999)}\n"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8))) + "\n"


def _pair(rng: random.Random) -> str:
    return f"{rng.randint(-99, 99)} {rng.randint(-99, 99)}\n"


_INPUTS: dict[str, Callable[[random.Random], str]] = {"n": _int, "w": _word, "ab": _pair}
_READ = {
    "n": "n = int(input())\n",
    "w": "w = input().strip()\n",
    "ab": "a, b = map(int, input().split())\n",
}
_ONE = ("",)
#: (task, input kind, reference program's last line, constants k); both texts take ``{k}``
TEMPLATES: tuple[tuple[str, str, str, Sequence[Any]], ...] = (
    ("Read an integer n and print n + {k}.", "n", "print(n + {k})", range(1, 100)),
    ("Read an integer n and print n - {k}.", "n", "print(n - {k})", range(1, 100)),
    ("Read an integer n and print n * {k}.", "n", "print(n * {k})", range(2, 31)),
    ("Read an integer n and print n modulo {k}.", "n", "print(n % {k})", range(2, 31)),
    ("Read a word and print it {k} times on one line.", "w", "print(w * {k})", range(2, 6)),
    ("Read a word and print its first {k} letters.", "w", "print(w[:{k}])", range(1, 5)),
    (
        "Read a word and print how often the letter {k} occurs in it.",
        "w",
        "print(w.count('{k}'))",
        string.ascii_lowercase,
    ),
    ("Read a word and print it reversed.", "w", "print(w[::-1])", _ONE),
    ("Read a word and print it in upper case.", "w", "print(w.upper())", _ONE),
    ("Read a word and print its letters sorted.", "w", "print(''.join(sorted(w)))", _ONE),
    (
        "Read an integer n and print the sum of its digits.",
        "n",
        "print(sum(map(int, str(n))))",
        _ONE,
    ),
    ("Read two integers a b and print their sum.", "ab", "print(a + b)", _ONE),
    ("Read two integers a b and print the larger.", "ab", "print(max(a, b))", _ONE),
)


def run_reference(program: str, stdin: str) -> str:
    """Stdout of one of *our own* reference programs (trusted, run in-process): the expected
    output of a test. Responses are never run like this; they go to the sandbox."""
    lines = iter(stdin.splitlines())
    out: list[str] = []
    scope = {"input": lambda: next(lines), "print": lambda *a: out.append(" ".join(map(str, a)))}
    exec(program, scope)
    return "".join(line + "\n" for line in out)


def _problem(template: tuple, k: Any, rng: random.Random, n_tests: int) -> dict[str, str]:
    task, kind, last_line, _ = template
    program = _READ[kind] + last_line.format(k=k)
    tests = []
    for _ in range(n_tests):
        stdin = _INPUTS[kind](rng)
        tests.append({"input": stdin, "output": run_reference(program, stdin)})
    return {
        "prompt": PROMPT.format(task=task.format(k=k)),
        "ground_truth": json.dumps(tests, separators=(",", ":")),
        "solution": program,
    }


def code_problems(spec: CodeTaskSpec) -> list[dict[str, str]]:
    """Every (template, constant) task once, shuffled: ``eval`` takes the first ``n_eval``."""
    rng = random.Random(spec.seed * 1000 + 2)  # 0 and 1 are math and reverse
    space = [(t, k) for t in TEMPLATES for k in t[3]]
    if len(space) < spec.n_eval + spec.n_train:
        raise ValueError(
            f"code: {len(space)} distinct tasks, fewer than n_eval + n_train "
            f"({spec.n_eval} + {spec.n_train})"
        )
    rng.shuffle(space)
    return [_problem(t, k, rng, spec.tests_per_task) for t, k in space]


def generate_code(spec: CodeTaskSpec) -> dict[str, list[dict]]:
    """``{"train": rows, "eval": rows}``; each task (prompt) in one split only."""
    problems = code_problems(spec)
    splits = {
        "eval": problems[: spec.n_eval],
        "train": problems[spec.n_eval : spec.n_eval + spec.n_train],
    }
    return {
        split: [
            {
                "id": f"{DOMAIN}-{split}-{i:04d}",
                "domain": DOMAIN,
                "prompt": p["prompt"],
                "ground_truth": p["ground_truth"],
            }
            for i, p in enumerate(items)
        ]
        for split, items in splits.items()
    }


def reference_solutions(spec: CodeTaskSpec) -> dict[str, str]:
    """``{prompt: program}`` of the right programs (for tests of the data and the reward)."""
    return {p["prompt"]: p["solution"] for p in code_problems(spec)}
