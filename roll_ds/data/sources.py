"""Read a role's ``data_args.file_name``: files and directories of .jsonl, .json and .parquet.

``.jsonl`` is read line by line by roll_ds (``dataset.load_jsonl_rows``): a bad line is reported
as ``file:line`` and does not hide the others. ``.json`` (JSON lines or one array of records) and
``.parquet`` are read by ``datasets`` from local files only (``data_files=``, offline), one file
at a time so that a problem names its file and row (``row N`` is the 0-based index). Every
record becomes a task row through the same ``RowSpec`` (``rows.py``).

``data_problems`` checks the data settings at config time, before any actor starts; reading
the rows happens when the pipeline is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from roll_ds.data.dataset import DatasetFormatError, load_jsonl_rows, raise_if_problems
from roll_ds.data.prompts import chat_template_problems
from roll_ds.data.rows import ANSWER_FORMATS, RowSpec, to_row

# File suffix -> how it is read ("jsonl": roll_ds's reader; others: the `datasets` builder).
FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


def data_files(path: str | os.PathLike) -> list[Path]:
    """``path`` itself, or the task files under a directory (recursively, sorted; hidden
    entries skipped). Raises ``FileNotFoundError`` / ``DatasetFormatError``."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in FORMATS:
            raise DatasetFormatError(f"{path}: {_unknown_format(path)}")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or directory")
    found = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix in FORMATS
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not found:
        raise DatasetFormatError(
            f"{path}: the directory holds no {', '.join(FORMATS)} files; point file_name at the "
            "task files"
        )
    return found


def _unknown_format(path: Path) -> str:
    return f"unknown file format {path.suffix!r}; use {', '.join(FORMATS)} files or a directory"


def load_rows(data_args: Any) -> list[dict]:
    """Task rows of every file of ``data_args.file_name`` in order, validated (one
    ``DatasetFormatError`` per file lists all of its problems)."""
    spec = RowSpec.from_data_args(data_args)
    rows: list[dict] = []
    for entry in data_args.file_name:
        for path in data_files(entry):
            if FORMATS[path.suffix] == "jsonl":
                file_rows = load_jsonl_rows(path, spec=spec)
            else:
                file_rows = load_with_datasets(path, spec)
            _check_template(file_rows, data_args.template, path)
            rows += file_rows
    return rows


def load_with_datasets(path: str | os.PathLike, spec: RowSpec) -> list[dict]:
    """Rows of one .json / .parquet file, read by ``datasets`` from the local file only."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before datasets is imported
    import datasets

    path = Path(path)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per small file is noise on the console
    try:
        table = datasets.load_dataset(FORMATS[path.suffix], data_files=[str(path)], split="train")
    except Exception as exc:  # datasets/pyarrow raise many types for a file they cannot parse
        if _is_empty_parquet(path):  # datasets 5.2 fails on a parquet file without rows
            raise DatasetFormatError(f"{path}: no task rows (the file is empty)") from None
        raise DatasetFormatError(f"{path}: not readable as {path.suffix} ({_cause(exc)})") from exc
    finally:
        if bars:
            datasets.enable_progress_bars()
    records = table.to_list()
    columns = set(table.column_names)
    missing = [
        f"{path}: no column {key.split('.')[0]!r} (data_args.{name}); its columns are "
        f"{sorted(columns)}: set data_args.{name}"
        for name, key in (("prompt_key", spec.prompt_key), ("answer_key", spec.answer_key))
        if key.split(".")[0] not in columns and key not in columns
    ]
    raise_if_problems(missing, str(path))
    rows, problems = [], []
    for i, record in enumerate(records):
        # A column datasets fills with null for this row counts as missing.
        record = {k: v for k, v in record.items() if v is not None}
        row, row_problems = to_row(record, spec, f"{path.stem}-{i}")
        problems.extend(f"{path}: row {i}: {p}" for p in row_problems)
        if row is not None:
            rows.append(row)
    raise_if_problems(problems, str(path))
    if not rows:
        raise DatasetFormatError(f"{path}: no task rows (the file is empty)")
    return rows


def _cause(exc: BaseException) -> str:
    """The first line of the innermost cause (datasets wraps the parser's error)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _is_empty_parquet(path: Path) -> bool:
    import pyarrow.parquet as pq

    try:
        return path.suffix == ".parquet" and pq.read_metadata(path).num_rows == 0
    except Exception:  # not parquet at all: the caller reports it
        return False


def _check_template(rows: list[dict], template: str, path: Path) -> None:
    chat_rows = sum("messages" in row for row in rows)
    if chat_rows and template != "chat":
        raise DatasetFormatError(
            f"{path}: {chat_rows} prompt(s) are chat messages lists; set data_args.template=chat "
            "to render them with the chat template"
        )


def data_problems(cfg: Any, *, check_files: bool = True) -> list[str]:
    """Config-time problems of the training and held-out data settings, each naming the field
    and the fix. ``check_files``: also that every file_name entry exists and is readable."""
    problems = []
    for where, data in (
        ("actor_train.data_args", cfg.actor_train.data_args),
        ("validation.data_args", cfg.validation.data_args),
    ):
        if data.answer_format not in ANSWER_FORMATS:
            problems.append(
                f"{where}.answer_format: {ANSWER_FORMATS.unknown_message(data.answer_format)}"
            )
        for name in ("prompt_key", "answer_key", "domain_key"):
            if getattr(data, name) == "":
                problems.append(f"{where}.{name}: empty; name the record's key")
        if data.system_prompt is not None and data.template != "chat":
            problems.append(
                f"{where}.system_prompt: a system prompt needs the chat template; set "
                f"{where}.template=chat"
            )
        problems += [f"{where}.chat_template: {p}" for p in chat_template_problems(data)]
        if check_files:
            problems += _file_problems(where, data.file_name)
    return problems


def _file_problems(where: str, entries: list[str]) -> list[str]:
    problems = []
    for i, entry in enumerate(entries):
        path = Path(entry)
        if path.is_file() and path.suffix not in FORMATS:
            problems.append(f"{where}.file_name[{i}]: {_unknown_format(path)}")
        elif not path.exists():
            problems.append(f"{where}.file_name[{i}]: file {entry!r} not found")
        elif path.is_dir():
            try:
                data_files(path)
            except DatasetFormatError as exc:
                problems.append(f"{where}.file_name[{i}]: {exc}")
    return problems


__all__ = ["FORMATS", "data_files", "data_problems", "load_rows", "load_with_datasets"]
