"""Relative paths: the shipped configs' data files resolve against the project
(``${roll_ds_root:}``), wherever a run is launched; a relative path the user writes stays
relative to the launch directory; the launch directory's modules import (``module:Class``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roll_ds.config.compose import load_config
from roll_ds.config.paths import PROJECT_ROOT, launch_dir_importable

SHIPPED_WITH_DATA = ("rlvr_lora_zero3", "rlvr_code_zero3", "rlvr_gsm8k_sample")


@pytest.mark.parametrize("name", SHIPPED_WITH_DATA)
def test_shipped_data_files_are_found_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(name)  # validation reads every data file
    files = [*cfg.actor_train.data_args.file_name, *cfg.validation.data_args.file_name]
    assert files
    for file in files:
        assert Path(file).is_absolute() and Path(file).is_file()
        assert Path(file).is_relative_to(PROJECT_ROOT / "examples" / "qwen_rlvr" / "data")


def test_a_relative_path_the_user_writes_is_the_launch_directory_s(tmp_path, monkeypatch):
    (tmp_path / "mine.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config("rlvr_lora_zero3", ["validation.data_args.file_name=[mine.jsonl]"])
    assert cfg.validation.data_args.file_name == ["mine.jsonl"]
    assert cfg.output_dir == "./output"  # the run's output lands where it was launched


def test_the_launch_directory_is_importable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    launch_dir_importable()
    assert str(tmp_path) == sys.path[-1]
