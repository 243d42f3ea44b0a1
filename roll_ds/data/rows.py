"""One source record -> one task row, whatever schema the source file has.

A task row is ``{"id", "domain", "prompt", "ground_truth", ...}`` (the record's other keys are
kept). A ``RowSpec`` says where the record keeps the prompt, the answer and the domain, and how
the answer is read (``ANSWER_FORMATS``), so GSM8K-, MATH- or DAPO-style files map onto rows
without converting them first. With the default spec a record of the project's own jsonl becomes
exactly the row it always did.

A prompt is a string or a chat ``messages`` list of ``{"role", "content"}``; a list is kept
under ``row["messages"]`` (rendered with the chat template when tokenized, see ``prompts.py``)
and ``row["prompt"]`` holds its last user message, the text reward functions and judges read.

Pure Python: no torch, no datasets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from roll_ds.registry import Registry

ANSWER_FORMATS: Registry[Callable[[str], str | None]] = Registry("answer_format")
_MISSING = object()


@ANSWER_FORMATS.register("raw")
def raw_answer(text: str) -> str | None:
    """The answer as stored."""
    return text


@ANSWER_FORMATS.register("gsm8k")
def gsm8k_answer(text: str) -> str | None:
    """GSM8K's final answer: the text after the last ``####``, thousands separators removed
    (``"... #### 1,200"`` -> ``"1200"``); None when there is no ``####`` or nothing after it."""
    _, sep, tail = text.rpartition("####")
    answer = re.sub(r"(?<=\d),(?=\d{3})", "", tail.strip())
    return answer if sep and answer else None


@dataclass(frozen=True)
class RowSpec:
    """Where a record keeps what a task row needs (the data_args keys)."""

    prompt_key: str = "prompt"
    answer_key: str = "ground_truth"
    domain_key: str | None = "domain"
    default_domain: str = "math"
    answer_format: str = "raw"

    @classmethod
    def from_data_args(cls, data_args: Any) -> RowSpec:
        return cls(
            prompt_key=data_args.prompt_key,
            answer_key=data_args.answer_key,
            domain_key=data_args.domain_key,
            default_domain=data_args.default_domain,
            answer_format=data_args.answer_format,
        )


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``; a dotted key that is not a key itself reads nested mappings
    (``reward_model.ground_truth``). ``_MISSING`` when absent."""
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _brief(value: Any) -> str:
    return json.dumps(value, default=str)[:40]


def _type_problem(key: str, value: Any) -> str:
    return f"field {key!r} must be a string, got {type(value).__name__} {_brief(value)}"


def _message_problems(key: str, messages: list) -> list[str]:
    if not messages:
        return [f"field {key!r} is an empty messages list"]
    problems = []
    for i, message in enumerate(messages):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            problems.append(
                f"field {key!r}: message {i} must be {{'role': str, 'content': str}}, got "
                f"{_brief(message)}"
            )
    if not problems and not any(m["role"] == "user" for m in messages):
        problems.append(f"field {key!r}: the messages have no 'user' message")
    return problems


def _prompt_problems(key: str, prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [] if prompt.strip() else [f"field {key!r} is empty"]
    if isinstance(prompt, list):
        return _message_problems(key, prompt)
    return [
        f"field {key!r} must be a string or a list of {{role, content}} messages, got "
        f"{type(prompt).__name__} {_brief(prompt)}"
    ]


def to_row(record: Any, spec: RowSpec, default_id: str) -> tuple[dict | None, list[str]]:
    """The task row of ``record`` and no problems, or None and every problem found."""
    if not isinstance(record, Mapping):
        return None, [f"expected a JSON object, got {type(record).__name__}"]
    prompt = lookup(record, spec.prompt_key)
    answer = lookup(record, spec.answer_key)
    problems = [
        f"missing field {key!r}"
        for key, value in ((spec.prompt_key, prompt), (spec.answer_key, answer))
        if value is _MISSING
    ]
    # The project's own jsonl also requires these to be strings when present.
    for key in ("id", spec.domain_key):
        value = lookup(record, key) if key else _MISSING
        if value is not _MISSING and not isinstance(value, str):
            problems.append(_type_problem(key, value))
    if prompt is not _MISSING:
        problems += _prompt_problems(spec.prompt_key, prompt)
    if answer is not _MISSING and not isinstance(answer, str):
        problems.append(_type_problem(spec.answer_key, answer))
    elif isinstance(answer, str):
        ground_truth = ANSWER_FORMATS.get(spec.answer_format)(answer)
        if ground_truth is None:
            problems.append(
                f"field {spec.answer_key!r} has no answer in the {spec.answer_format!r} format "
                f"({_brief(answer)})"
            )
        elif not ground_truth.strip():
            problems.append(
                f"field {spec.answer_key!r} is empty: no response matches an empty answer, so "
                "every sample of the row would be scored wrong; give its answer or drop the row"
            )
    if problems:
        return None, problems
    domain = lookup(record, spec.domain_key) if spec.domain_key else _MISSING
    row = {"id": default_id, "domain": spec.default_domain, **record}
    row["domain"] = spec.default_domain if domain is _MISSING else domain
    if isinstance(prompt, list):
        row["messages"] = [{"role": m["role"], "content": m["content"]} for m in prompt]
        prompt = [m for m in prompt if m["role"] == "user"][-1]["content"]
    row["prompt"] = prompt
    row["ground_truth"] = ground_truth
    return row, []
