"""Write the GSM8K-format sample: grade-school word problems the project generates itself.

    python scripts/make_gsm8k_sample.py          # (re)write data/gsm8k_sample_{train,test}.parquet
    python scripts/make_gsm8k_sample.py --check  # fail if the shipped files differ from the script

(``data/`` is examples/qwen_rlvr/data.)

Rows have GSM8K's schema: ``question`` (the problem) and ``answer`` (worked steps with
``<<a*b=c>>`` calculator notes, ending in ``#### <number>``), so a config reads them the way it
would read GSM8K itself: ``prompt_key: question``, ``answer_key: answer``, ``answer_format:
gsm8k``. Questions are short (at most ``MAX_QUESTION_CHARS``) so that, rendered with ChatML
and a system prompt, they fit the embedded model's 256 positions (one token per byte). No
GSM8K text is copied: templates and numbers come from this script (seed 0).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "examples" / "qwen_rlvr" / "data"
SPLITS = {"train": 40, "test": 12}
MAX_QUESTION_CHARS = 140
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "June", "Kai", "Lia"]


def _apples(r: random.Random, name: str) -> tuple[str, list[str], int]:
    a, b, c = r.randint(2, 20), r.randint(2, 6), r.randint(3, 9)
    q = f"{name} has {a} apples and buys {b} bags with {c} apples each. How many apples now?"
    steps = [f"The bags hold {b}*{c} = <<{b}*{c}={b * c}>>{b * c} apples."]
    steps.append(f"{name} has {a}+{b * c} = <<{a}+{b * c}={a + b * c}>>{a + b * c} apples.")
    return q, steps, a + b * c


def _pencils(r: random.Random, name: str) -> tuple[str, list[str], int]:
    a, b = r.randint(6, 12), r.randint(2, 5)
    c = r.randint(1, a * b - 1)
    q = f"A box holds {a} pencils. {name} buys {b} boxes and gives away {c}. How many are left?"
    steps = [f"{b} boxes hold {b}*{a} = <<{b}*{a}={a * b}>>{a * b} pencils."]
    steps.append(f"{a * b}-{c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} pencils are left.")
    return q, steps, a * b - c


def _pages(r: random.Random, name: str) -> tuple[str, list[str], int]:
    a, b, c = r.randint(5, 30), r.randint(2, 7), r.randint(1, 20)
    q = f"{name} reads {a} pages a day for {b} days, then {c} more pages. How many pages in all?"
    steps = [f"In {b} days: {a}*{b} = <<{a}*{b}={a * b}>>{a * b} pages."]
    steps.append(f"In all: {a * b}+{c} = <<{a * b}+{c}={a * b + c}>>{a * b + c} pages.")
    return q, steps, a * b + c


def _change(r: random.Random, name: str) -> tuple[str, list[str], int]:
    a, b = r.randint(2, 9), r.randint(2, 5)
    c = r.choice([n for n in (20, 50, 100) if n > a * b])
    q = f"Tickets cost ${a} each. {name} buys {b} tickets with a ${c} bill. How much change?"
    steps = [f"The tickets cost {a}*{b} = <<{a}*{b}={a * b}>>{a * b} dollars."]
    steps.append(f"The change is {c}-{a * b} = <<{c}-{a * b}={c - a * b}>>{c - a * b} dollars.")
    return q, steps, c - a * b


def _muffins(r: random.Random, name: str) -> tuple[str, list[str], int]:
    b, k = r.randint(2, 8), r.randint(3, 12)
    q = f"{name} bakes {b * k} muffins and packs them {b} to a box. How many boxes are filled?"
    steps = [f"{b * k}/{b} = <<{b * k}/{b}={k}>>{k} boxes are filled."]
    return q, steps, k


def _wages(r: random.Random, name: str) -> tuple[str, list[str], int]:
    a, b = r.randint(8, 20), r.randint(2, 8)
    c = r.randint(1, a * b - 1)
    q = f"{name} earns ${a} an hour, works {b} hours and spends ${c}. How many dollars are left?"
    steps = [f"{name} earns {a}*{b} = <<{a}*{b}={a * b}>>{a * b} dollars."]
    steps.append(f"Left: {a * b}-{c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} dollars.")
    return q, steps, a * b - c


def _farm(r: random.Random, name: str) -> tuple[str, list[str], int]:
    a = r.randint(3, 40)
    q = f"{name}'s farm has {a} cows and twice as many sheep. How many animals are there?"
    steps = [f"There are 2*{a} = <<2*{a}={2 * a}>>{2 * a} sheep."]
    steps.append(f"In all {a}+{2 * a} = <<{a}+{2 * a}={3 * a}>>{3 * a} animals.")
    return q, steps, 3 * a


TEMPLATES: list[Callable[[random.Random, str], tuple[str, list[str], int]]] = [
    _apples,
    _pencils,
    _pages,
    _change,
    _muffins,
    _wages,
    _farm,
]


def generate(seed: int = 0) -> dict[str, list[dict[str, str]]]:
    """``{split: [{"question", "answer"}, ...]}``; no question is in two splits."""
    r = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict[str, str]]] = {}
    for split, count in SPLITS.items():
        rows = []
        while len(rows) < count:
            template = TEMPLATES[len(seen) % len(TEMPLATES)]
            question, steps, result = template(r, r.choice(NAMES))
            if question in seen:
                continue
            assert len(question) <= MAX_QUESTION_CHARS, question
            seen.add(question)
            rows.append({"question": question, "answer": "\n".join([*steps, f"#### {result}"])})
        splits[split] = rows
    return splits


def path_of(split: str) -> Path:
    return OUT_DIR / f"gsm8k_sample_{split}.parquet"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    import datasets

    for split, rows in generate().items():
        path = path_of(split)
        if args.check:
            shipped = datasets.Dataset.from_parquet(str(path), keep_in_memory=True).to_list()
            if shipped != rows:
                print(f"{path} differs from the generator; rerun without --check", file=sys.stderr)
                return 1
            continue
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
