"""Task rows from jsonl files: loading and validation.

A row is ``{"id": str, "domain": str, "prompt": str, "ground_truth": str}``; ``prompt`` and
``ground_truth`` are required, ``domain`` falls back to the configured default and ``id`` to
``<file stem>-<line>``. Other keys are kept. Validation collects every problem in the file and
raises one ``DatasetFormatError`` naming the file and line of each. Records of another schema
(``question`` / ``answer``, chat ``messages``) map onto rows by a ``RowSpec`` (``rows.py``);
``sources.py`` reads .json / .parquet files and directories with ``datasets``.

Importing this module does not import torch.
"""

from __future__ import annotations

import codecs
import json
import os

from roll_ds.data.rows import RowSpec, to_row

MAX_LISTED_PROBLEMS = 20


class DatasetFormatError(ValueError):
    """A task file has malformed rows; the message lists them (file:line: problem)."""


def raise_if_problems(problems: list[str], path: str) -> None:
    """One ``DatasetFormatError`` listing ``problems`` of the file ``path`` (none: nothing)."""
    if not problems:
        return
    listed = problems[:MAX_LISTED_PROBLEMS]
    more = len(problems) - len(listed)
    tail = f"\n  ... and {more} more" if more else ""
    raise DatasetFormatError(
        f"{path}: {len(problems)} problem(s) in task rows:\n  " + "\n  ".join(listed) + tail
    )


def load_jsonl_rows(
    path: str | os.PathLike, default_domain: str = "math", spec: RowSpec | None = None
) -> list[dict]:
    """Rows of a jsonl task file, validated; blank lines are skipped. ``spec`` maps records of
    another schema (its ``default_domain`` then applies).

    Raises ``FileNotFoundError`` for a missing file and ``DatasetFormatError`` listing every
    malformed line, lines that are not UTF-8 included (first ``MAX_LISTED_PROBLEMS`` shown, then
    a count).
    """
    path = os.fspath(path)
    spec = spec or RowSpec(default_domain=default_domain)
    stem = os.path.splitext(os.path.basename(path))[0]
    rows: list[dict] = []
    problems: list[str] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problems.append(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                    "of the line); re-save the file as UTF-8"
                )
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})")
                continue
            row, row_problems = to_row(obj, spec, f"{stem}-{lineno}")
            problems.extend(f"{path}:{lineno}: {p}" for p in row_problems)
            if row is not None:
                rows.append(row)
    raise_if_problems(problems, path)
    if not rows:
        raise DatasetFormatError(f"{path}: no task rows (the file is empty)")
    return rows


def answers_match(response: str, ground_truth: str, domain: str) -> bool:
    """A deliberately simple check: exact match after stripping, numeric for ``math``.

    The reward workers use math-verify; this is for warm-up calibration and tests.
    """
    response, ground_truth = response.strip(), ground_truth.strip()
    if response == ground_truth:
        return True
    if domain == "math":
        try:
            return float(response) == float(ground_truth)
        except ValueError:
            return False
    return False
