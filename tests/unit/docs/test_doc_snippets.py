"""Every config snippet and command line in README.md and docs/ composes against the schema, and
every Python snippet runs: renaming a documented key, or a shipped config, fails here.

- a YAML block with a ``defaults:`` list composes as a config of its own (from a directory
  outside the examples, as a user's would); any other YAML block is a fragment, composed over
  ``rlvr_lora_zero3``; both are converted to the typed schema and validated (files aside);
- ``python run.py ...`` and ``python -m roll_ds.evaluate ...`` lines compose with their
  overrides, as ``--cfg job`` would, and validate (files aside); ``--config-dir ~/my_configs``
  is the directory of the YAML snippets headed ``# ~/my_configs/<name>.yaml``;
- a ``python`` block runs in a fresh interpreter when marked ``<!-- test: run -->``; every
  Python block is marked (``run`` or ``skip (why)``), so none is left untested by accident;
- a transcript marked ``<!-- test: hint -->`` shows an override Hydra rejects: it must still be
  rejected, with the ``roll_ds hint:`` the doc prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _markdown_blocks import HOME_DIR, all_blocks, all_commands, user_configs

from roll_ds.config import compose_config, to_schema, validate
from roll_ds.config.compose import PROJECT_ROOT
from roll_ds.config.hints import hint_for_exception

YAML = all_blocks("yaml")
COMMANDS = [c for c in all_commands() if c.block.marker != "hint"]
HINTS = [c for c in all_commands() if c.block.marker == "hint"]
PYTHON = all_blocks("python")
FRAGMENT_BASE = "rlvr_lora_zero3"


def _ids(items) -> list[str]:
    return [getattr(i, "where", None) or i.block.where for i in items]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's config directory the docs call ~/my_configs, outside the repository."""
    directory = tmp_path_factory.mktemp("home") / "my_configs"
    directory.mkdir()
    for name, text in user_configs().items():
        (directory / name).write_text(text)
    return directory


def _check(cfg) -> None:
    validate(to_schema(cfg), check_files=False)


def test_the_docs_have_snippets_of_every_kind():
    assert len(YAML) >= 10 and len(COMMANDS) >= 20 and len(PYTHON) >= 3 and len(HINTS) == 2


@pytest.mark.parametrize("block", YAML, ids=_ids(YAML))
def test_yaml_snippet_composes(block, tmp_path: Path):
    text = block.text
    if not any(line.startswith("defaults:") for line in text.splitlines()):
        text = f"defaults:\n  - {FRAGMENT_BASE}\n  - _self_\n{text}\n"
    (tmp_path / "snippet.yaml").write_text(text)
    cfg = compose_config("snippet", config_dir=tmp_path)  # keys and types against the schema
    if block.marker != "compose":  # an excerpt composes; it need not be complete
        _check(cfg)


@pytest.mark.parametrize("command", COMMANDS, ids=_ids(COMMANDS))
def test_command_line_composes(command, home: Path):
    overrides = list(command.overrides)
    if command.entry == "roll_ds.evaluate":
        from roll_ds.evaluate import split_checkpoint_arg

        _, overrides = split_checkpoint_arg(overrides)
    directory = None
    if command.config_dir is not None:
        assert command.config_dir == HOME_DIR, f"{command.block.where}: {command.config_dir}"
        directory = home
    _check(compose_config(command.config_name, overrides, config_dir=directory))


@pytest.mark.parametrize("command", HINTS, ids=_ids(HINTS))
def test_documented_hint_is_what_roll_ds_says(command):
    with pytest.raises(Exception) as info:
        compose_config(command.config_name, list(command.overrides))
    hint = hint_for_exception(info.value)
    assert hint is not None, f"{command.block.where}: no roll_ds hint for {info.value}"
    shown = command.block.text.split("roll_ds hint: ", 1)[1].splitlines()
    actual = hint.splitlines()
    assert shown[0] == actual[0], command.block.where
    for line in shown[1:]:
        assert line in actual, f"{command.block.where}: {line!r} not in the hint:\n{hint}"


@pytest.mark.parametrize("block", PYTHON, ids=_ids(PYTHON))
def test_python_snippet_runs(block, tmp_path: Path):
    assert block.marker in ("run", "skip"), (
        f"{block.where}: mark the block <!-- test: run --> or <!-- test: skip (why) -->"
    )
    if block.marker == "skip":
        pytest.skip(f"{block.where} is marked skip")
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", block.text],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{block.where} failed:\n{done.stderr[-3000:]}"
