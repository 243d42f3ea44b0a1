"""data_args formats: .jsonl / .json / .parquet files and directories, key mapping, answer
formats, chat messages, chat templates and system prompts, and each error they report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roll_ds.config import ConfigError, compose_config, load_config, to_schema
from roll_ds.config.compose import PROJECT_ROOT
from roll_ds.config.schema import DataArgs
from roll_ds.data.dataset import DatasetFormatError, load_jsonl_rows
from roll_ds.data.prompts import CHATML, chat_messages, prompt_token_ids
from roll_ds.data.rows import RowSpec, gsm8k_answer, lookup, to_row
from roll_ds.data.sources import data_files, data_problems, load_rows

DATA_DIR = PROJECT_ROOT / "examples" / "qwen_rlvr" / "data"
GSM8K = {"question": "Ana has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"}
GSM8K_ARGS = dict(prompt_key="question", answer_key="answer", answer_format="gsm8k")


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _parquet(path: Path, records: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(records).to_parquet(str(path))
    return path


def _json_array(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from roll_ds.models.shipped import resolve_pretrain

    return AutoTokenizer.from_pretrained(resolve_pretrain("embedded:tiny-qwen2"))


# --- rows ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3+4=7\n#### 7", "7"),
        ("#### 1,200", "1200"),
        ("a #### 2 then #### -3.5 ", "-3.5"),
        ("no marker", None),
        ("ends ####  ", None),
    ],
)
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


def test_dotted_key_reads_nested_fields_and_literal_keys_win():
    record = {"reward_model": {"ground_truth": "4"}, "a.b": 1, "a": {"b": 2}}
    assert lookup(record, "reward_model.ground_truth") == "4"
    assert lookup(record, "a.b") == 1


def test_the_default_spec_keeps_the_projects_rows_as_they_were():
    # Byte for byte: the shipped files load to the dicts (keys in order) they always did.
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            first = json.loads(f.readline())
        row = load_jsonl_rows(path)[0]
        assert list(row.items()) == list(first.items())


def test_messages_prompt_keeps_the_list_and_exposes_the_last_user_message():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2?"},
    ]
    row, problems = to_row({"messages": messages, "answer": "4"}, _spec("messages"), "f-0")
    assert problems == []
    assert row["messages"] == messages and row["prompt"] == "2+2?"
    assert (row["id"], row["domain"], row["ground_truth"]) == ("f-0", "math", "4")


def _spec(prompt_key="prompt", **kw) -> RowSpec:
    return RowSpec(prompt_key=prompt_key, answer_key=kw.pop("answer_key", "answer"), **kw)


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"messages": [], "answer": "1"}, "field 'messages' is an empty messages list"),
        (
            {"messages": [{"role": "user"}], "answer": "1"},
            "field 'messages': message 0 must be {'role': str, 'content': str}",
        ),
        (
            {"messages": [{"role": "system", "content": "x"}], "answer": "1"},
            "field 'messages': the messages have no 'user' message",
        ),
        ({"messages": 3, "answer": "1"}, "field 'messages' must be a string or a list"),
        ({"messages": "q", "answer": 7}, "field 'answer' must be a string, got int 7"),
    ],
)
def test_row_problems(record, problem):
    row, problems = to_row(record, _spec("messages"), "x")
    assert row is None and any(problem in p for p in problems), problems


def test_domain_key_and_fixed_domain():
    record = {"q": "x", "answer": "1", "category": "algebra", "domain": "other"}
    row, _ = to_row(record, _spec("q", domain_key="category"), "x")
    assert row["domain"] == "algebra"
    row, _ = to_row(record, _spec("q", domain_key=None, default_domain="gsm8k"), "x")
    assert row["domain"] == "gsm8k"
    _, problems = to_row({**record, "category": 3}, _spec("q", domain_key="category"), "x")
    assert problems == ["field 'category' must be a string, got int 3"]


# --- files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "writer", [_jsonl, _parquet, _json_array], ids=["jsonl", "parquet", "json"]
)
def test_each_format_loads_gsm8k_records(tmp_path, writer):
    suffix = {_jsonl: ".jsonl", _parquet: ".parquet", _json_array: ".json"}[writer]
    path = writer(tmp_path / f"gsm{suffix}", [GSM8K, {**GSM8K, "answer": "#### 1,024"}])
    rows = load_rows(DataArgs(file_name=[str(path)], default_domain="gsm8k", **GSM8K_ARGS))
    assert [r["ground_truth"] for r in rows] == ["5", "1024"]
    assert {r["domain"] for r in rows} == {"gsm8k"}
    assert rows[0]["prompt"] == GSM8K["question"] and rows[0]["answer"] == GSM8K["answer"]
    first_id = "gsm-1" if suffix == ".jsonl" else "gsm-0"  # jsonl: line; others: row index
    assert rows[0]["id"] == first_id


def test_json_lines_file_named_json_loads(tmp_path):
    path = _jsonl(tmp_path / "lines.json", [GSM8K])
    assert len(load_rows(DataArgs(file_name=[str(path)], **GSM8K_ARGS))) == 1


def test_parquet_messages_column(tmp_path):
    messages = [{"role": "user", "content": "2+2?"}]
    path = _parquet(tmp_path / "chat.parquet", [{"prompt": messages, "ground_truth": "4"}])
    (row,) = load_rows(DataArgs(file_name=[str(path)], template="chat"))
    assert row["messages"] == messages and row["prompt"] == "2+2?"


def test_messages_need_the_chat_template(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "q"}]}])
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}], "ground_truth": "1"}))
    with pytest.raises(DatasetFormatError, match=r"chat\.jsonl: 1 prompt\(s\) are chat messages"):
        load_rows(DataArgs(file_name=[str(path)]))


def test_directory_reads_every_task_file_in_order(tmp_path):
    _parquet(tmp_path / "b.parquet", [GSM8K])
    (tmp_path / "sub").mkdir()
    _jsonl(tmp_path / "sub" / "c.jsonl", [{**GSM8K, "question": "later"}])
    _jsonl(tmp_path / "a.jsonl", [{**GSM8K, "question": "first"}])
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / ".cache").mkdir()
    _jsonl(tmp_path / ".cache" / "x.jsonl", ["hidden entries are skipped"])
    assert [p.name for p in data_files(tmp_path)] == ["a.jsonl", "b.parquet", "c.jsonl"]
    rows = load_rows(DataArgs(file_name=[str(tmp_path)], **GSM8K_ARGS))
    assert [r["prompt"] for r in rows] == ["first", GSM8K["question"], "later"]


def test_parquet_row_problems_name_file_and_row(tmp_path):
    records = [GSM8K, {"question": "", "answer": "#### 1"}, {"question": "q", "answer": "none"}]
    path = _parquet(tmp_path / "bad.parquet", records)
    with pytest.raises(DatasetFormatError) as info:
        load_rows(DataArgs(file_name=[str(path)], **GSM8K_ARGS))
    message = str(info.value)
    assert "2 problem(s)" in message
    assert f"{path}: row 1: field 'question' is empty" in message
    assert f"{path}: row 2: field 'answer' has no answer in the 'gsm8k' format" in message


def test_parquet_null_cell_is_a_missing_field(tmp_path):
    path = _parquet(tmp_path / "null.parquet", [GSM8K, {"question": None, "answer": "#### 2"}])
    with pytest.raises(DatasetFormatError, match=r"row 1: missing field 'question'"):
        load_rows(DataArgs(file_name=[str(path)], **GSM8K_ARGS))


def test_missing_column_is_one_problem_naming_the_setting(tmp_path):
    path = _parquet(tmp_path / "math.parquet", [{"problem": "1+1", "solution": "2"}] * 30)
    with pytest.raises(DatasetFormatError) as info:
        load_rows(DataArgs(file_name=[str(path)], **GSM8K_ARGS))
    message = str(info.value)
    assert "2 problem(s)" in message
    assert "no column 'question' (data_args.prompt_key)" in message
    assert "['problem', 'solution']: set data_args.answer_key" in message


def test_unreadable_file_and_unknown_suffix(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DatasetFormatError, match=r"broken\.parquet: not readable as \.parquet"):
        load_rows(DataArgs(file_name=[str(bad)]))
    txt = tmp_path / "tasks.txt"
    txt.write_text("{}")
    with pytest.raises(DatasetFormatError, match=r"unknown file format '\.txt'"):
        load_rows(DataArgs(file_name=[str(txt)]))


def test_empty_parquet_has_no_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "ground_truth": []}), path)
    with pytest.raises(DatasetFormatError, match=r"empty\.parquet: no task rows"):
        load_rows(DataArgs(file_name=[str(path)]))


# --- prompts -------------------------------------------------------------------------------


def test_raw_template_is_the_text_as_is(tokenizer):
    row = {"prompt": "12+3="}
    ids = prompt_token_ids(tokenizer, row, DataArgs(), "actor_train")
    assert ids == tokenizer("12+3=", add_special_tokens=False)["input_ids"]


def test_chatml_renders_system_prompt_user_and_generation_prompt(tokenizer):
    args = DataArgs(template="chat", chat_template="chatml", system_prompt="Be brief.")
    ids = prompt_token_ids(tokenizer, {"prompt": "1+1?"}, args, "actor_train")
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token, one id


def test_system_prompt_does_not_replace_the_rows_own(tokenizer):
    row = {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]}
    assert chat_messages(row, "default") == row["messages"]
    assert chat_messages({"prompt": "q"}, None) == [{"role": "user", "content": "q"}]


def test_a_jinja_chat_template_string_is_used_as_is(tokenizer):
    args = DataArgs(template="chat", chat_template="{{ messages[-1]['content'] }}=>")
    assert tokenizer.decode(prompt_token_ids(tokenizer, {"prompt": "ab"}, args, "x")) == "ab=>"


def test_the_tokenizers_own_template_is_the_default(tokenizer):
    import copy

    own = copy.deepcopy(tokenizer)
    own.chat_template = CHATML
    ids = prompt_token_ids(own, {"prompt": "q"}, DataArgs(template="chat"), "x")
    assert own.decode(ids).endswith("<|im_start|>assistant\n")


def test_no_chat_template_is_an_error_naming_the_field_and_fix(tokenizer):
    assert not tokenizer.chat_template
    with pytest.raises(ValueError) as info:
        prompt_token_ids(tokenizer, {"prompt": "q"}, DataArgs(template="chat"), "validation")
    assert "validation.data_args.chat_template: the tokenizer of" in str(info.value)
    assert "set validation.data_args.chat_template=chatml" in str(info.value)


# --- config time ---------------------------------------------------------------------------


def test_config_problems_name_field_and_fix():
    overrides = [
        "actor_train.data_args.answer_format=boxed",
        "actor_train.data_args.system_prompt=hi",
        "validation.data_args.chat_template=llama",
        "actor_train.data_args.prompt_key=''",
        "actor_train.data_args.file_name=[/nope.parquet]",
    ]
    problems = data_problems(to_schema(compose_config("rlvr_lora_zero3", overrides)))
    assert problems == [
        "actor_train.data_args.answer_format: unknown answer_format 'boxed'; valid: gsm8k, raw",
        "actor_train.data_args.prompt_key: empty; name the record's key",
        "actor_train.data_args.system_prompt: a system prompt needs the chat template; set "
        "actor_train.data_args.template=chat",
        "actor_train.data_args.file_name[0]: file '/nope.parquet' not found",
        "validation.data_args.chat_template: 'llama' is neither a named template (chatml) nor a "
        "Jinja template; use one of those, or null for the tokenizer's own",
    ]


def test_config_time_file_checks(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "tasks.csv").write_text("a,b\n")
    overrides = [f"actor_train.data_args.file_name=[{tmp_path}/empty,{tmp_path}/tasks.csv]"]
    with pytest.raises(ConfigError) as info:
        load_config("rlvr_lora_zero3", overrides)
    text = str(info.value)
    assert "actor_train.data_args.file_name[0]:" in text and "holds no .jsonl" in text
    assert "actor_train.data_args.file_name[1]: unknown file format '.csv'" in text


def test_shipped_gsm8k_sample_matches_its_generator():
    script = PROJECT_ROOT / "scripts" / "make_gsm8k_sample.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_gsm8k_example_config_loads_its_sample():
    cfg = load_config("rlvr_gsm8k_sample")
    assert (
        list(cfg.rewards) == ["gsm8k"] and cfg.actor_train.data_args.domain_interleave_probs == {}
    )
    rows = load_rows(cfg.actor_train.data_args)
    held_out = load_rows(cfg.validation.data_args)
    assert (len(rows), len(held_out)) == (40, 12)
    assert {r["domain"] for r in rows + held_out} == {"gsm8k"}
    assert all(r["ground_truth"].lstrip("-").isdigit() for r in rows + held_out)
    assert not {r["prompt"] for r in rows} & {r["prompt"] for r in held_out}


def test_an_empty_ground_truth_names_the_file_and_the_row(tmp_path):
    """Was accepted: every sample of such a row scored wrong, a constant zero reward."""
    jsonl = _jsonl(
        tmp_path / "tasks.jsonl",
        [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": " "}],
    )
    empty = "field 'ground_truth' is empty: no response matches an empty answer"
    with pytest.raises(DatasetFormatError, match=rf"tasks\.jsonl:2: {empty}"):
        load_rows(DataArgs(file_name=[str(jsonl)]))
    path = _parquet(tmp_path / "math.parquet", [GSM8K, {"question": "q", "answer": ""}])
    with pytest.raises(DatasetFormatError) as info:
        load_rows(DataArgs(file_name=[str(path)], **{**GSM8K_ARGS, "answer_format": "raw"}))
    assert f"{path}: row 1: field 'answer' is empty" in str(info.value)
