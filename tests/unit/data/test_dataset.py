"""Loading and validating task jsonl files, and the simple answer check."""

from __future__ import annotations

import json
import os

import pytest

from roll_ds.data.dataset import (
    MAX_LISTED_PROBLEMS,
    DatasetFormatError,
    answers_match,
    load_jsonl_rows,
)

DATA_DIR = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "examples", "qwen_rlvr", "data"
)
GOOD = {"id": "r1", "domain": "math", "prompt": "1+2=", "ground_truth": "3"}


def _write(tmp_path, lines, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _error(tmp_path, lines, **kwargs) -> str:
    path = _write(tmp_path, lines)
    with pytest.raises(DatasetFormatError) as info:
        load_jsonl_rows(path, **kwargs)
    message = str(info.value)
    assert "tasks.jsonl" in message
    return message


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(DATA_DIR) if n.endswith(".jsonl")))
def test_shipped_files_load(name):
    rows = load_jsonl_rows(os.path.join(DATA_DIR, name))
    assert rows and all(set(r) == {"id", "domain", "prompt", "ground_truth"} for r in rows)


def test_defaults_for_domain_and_id_and_blank_lines(tmp_path):
    path = _write(tmp_path, ['{"prompt": "ab", "ground_truth": "ba", "extra": 1}', "", "  "])
    rows = load_jsonl_rows(path, default_domain="reverse")
    assert rows == [
        {"id": "tasks-1", "domain": "reverse", "prompt": "ab", "ground_truth": "ba", "extra": 1}
    ]
    assert load_jsonl_rows(_write(tmp_path, [json.dumps(GOOD)], "b.jsonl")) == [GOOD]


def test_line_that_is_not_json(tmp_path):
    message = _error(tmp_path, [json.dumps(GOOD), '{"prompt": "1+1=", '])
    assert "tasks.jsonl:2: not valid JSON" in message


def test_line_that_is_not_an_object(tmp_path):
    assert "tasks.jsonl:1: expected a JSON object, got list" in _error(tmp_path, ["[1, 2]"])


@pytest.mark.parametrize("field", ["prompt", "ground_truth"])
def test_missing_required_field(tmp_path, field):
    row = {k: v for k, v in GOOD.items() if k != field}
    assert f"tasks.jsonl:1: missing field '{field}'" in _error(tmp_path, [json.dumps(row)])


def test_empty_prompt(tmp_path):
    row = {**GOOD, "prompt": "  "}
    assert "tasks.jsonl:1: field 'prompt' is empty" in _error(tmp_path, [json.dumps(row)])


@pytest.mark.parametrize(
    ("field", "value", "type_name"),
    [("ground_truth", 3, "int"), ("prompt", None, "NoneType"), ("domain", ["math"], "list")],
)
def test_wrong_types(tmp_path, field, value, type_name):
    row = {**GOOD, field: value}
    message = _error(tmp_path, [json.dumps(row)])
    assert f"tasks.jsonl:1: field '{field}' must be a string" in message
    assert f"got {type_name}" in message


def test_all_problems_reported_together(tmp_path):
    lines = [json.dumps(GOOD), "not json", json.dumps({"prompt": ""}), json.dumps(GOOD)]
    message = _error(tmp_path, lines)
    assert "3 problem(s)" in message
    assert "tasks.jsonl:2: not valid JSON" in message
    assert "tasks.jsonl:3: missing field 'ground_truth'" in message
    assert "tasks.jsonl:3: field 'prompt' is empty" in message


def test_listing_is_capped_with_a_count(tmp_path):
    message = _error(tmp_path, ["{"] * (MAX_LISTED_PROBLEMS + 5))
    assert f"{MAX_LISTED_PROBLEMS + 5} problem(s)" in message
    assert f"tasks.jsonl:{MAX_LISTED_PROBLEMS}:" in message
    assert f"tasks.jsonl:{MAX_LISTED_PROBLEMS + 1}:" not in message
    assert "... and 5 more" in message


def test_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    latin1 = json.dumps({**GOOD, "prompt": "café"}, ensure_ascii=False).encode("latin-1")
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + latin1 + b"\n" + b"not json\n")
    with pytest.raises(DatasetFormatError) as info:
        load_jsonl_rows(path)
    message = str(info.value)
    column = latin1.index(b"\xe9") + 1
    assert f"tasks.jsonl:2: not UTF-8 (byte 0xe9 at byte {column} of the line); re-save" in message
    assert "tasks.jsonl:3: not valid JSON" in message  # the other lines are still checked
    assert "2 problem(s)" in message


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n")
    assert load_jsonl_rows(path) == [GOOD]


def test_empty_file(tmp_path):
    assert "no task rows" in _error(tmp_path, [])


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl_rows(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    ("response", "truth", "domain", "expected"),
    [
        ("42", "42", "math", True),
        (" 42 ", "42", "math", True),
        ("42.0", "42", "math", True),
        ("-7", "-7", "math", True),
        ("41", "42", "math", False),
        ("4x", "42", "math", False),
        ("cba", "cba", "reverse", True),
        ("cb", "cba", "reverse", False),
        ("1.0", "1", "reverse", False),
    ],
)
def test_answers_match(response, truth, domain, expected):
    assert answers_match(response, truth, domain) is expected
