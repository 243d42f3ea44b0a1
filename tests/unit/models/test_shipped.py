"""The shipped embedded models: every ``embedded:`` name resolves to a complete directory, an
incomplete one fails naming what is missing and how to restore it, and every other ``pretrain``
is resolved as before (local directories pass, anything else fails: no hub)."""

from __future__ import annotations

import os
import shutil

import pytest

from roll_ds.config.checks.pipeline import EMBEDDED_NAMES
from roll_ds.config.schema import EMBEDDED_AGENT, EMBEDDED_MODEL, EMBEDDED_RM
from roll_ds.models import shipped
from roll_ds.models.loading import resolve_model_path
from roll_ds.models.shipped import (
    REQUIRED_FILES,
    SHIPPED_MODELS,
    missing_files,
    resolve_embedded,
    resolve_pretrain,
)


def test_every_embedded_name_validation_accepts_is_shipped():
    names = {EMBEDDED_MODEL, EMBEDDED_RM, EMBEDDED_AGENT}
    assert set(SHIPPED_MODELS) == set(EMBEDDED_NAMES) == names


@pytest.mark.parametrize("name", sorted(SHIPPED_MODELS))
def test_embedded_names_resolve_to_their_complete_shipped_directory(name):
    path = os.path.join(shipped.MODELS_DIR, SHIPPED_MODELS[name].directory)
    assert resolve_pretrain(name) == resolve_model_path(name) == resolve_embedded(name) == path
    assert missing_files(path) == []
    assert os.path.isfile(os.path.join(path, shipped.RECIPE_FILE))


def test_an_incomplete_shipped_directory_fails_naming_the_fix(tmp_path, monkeypatch):
    model = SHIPPED_MODELS[EMBEDDED_RM]
    shutil.copytree(model.path, tmp_path / model.directory)
    os.remove(tmp_path / model.directory / "model.safetensors")
    monkeypatch.setattr(shipped, "MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        resolve_pretrain(EMBEDDED_RM)
    message = str(err.value)
    assert "embedded:tiny-rm" in message and "missing model.safetensors" in message
    assert "git checkout -- roll_ds/models/embedded_tiny_rm" in message
    assert "python scripts/make_embedded.py --model rm" in message
    os.remove(tmp_path / model.directory / "tokenizer.json")
    assert missing_files(str(tmp_path / model.directory)) == ["model.safetensors", "tokenizer.json"]
    assert set(REQUIRED_FILES) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_unknown_embedded_names_fail_listing_the_shipped_ones():
    with pytest.raises(ValueError, match=r"embedded model 'embedded:big'; valid: embedded:tiny"):
        resolve_pretrain("embedded:big")
    with pytest.raises(ValueError, match="unknown embedded model"):
        resolve_model_path("embedded:big")


def test_local_paths_pass_through_and_unknown_names_fail(tmp_path):
    assert resolve_pretrain(str(tmp_path)) == str(tmp_path)
    with pytest.raises(
        ValueError, match=r"pretrain='Qwen/Qwen2.5-0.5B'.*No model hub is reachable"
    ):
        resolve_pretrain("Qwen/Qwen2.5-0.5B")
    # a role's model_name_or_path: hub ids go to transformers as they are
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_every_shipped_directory_is_installed_with_the_package():
    tomllib = pytest.importorskip("tomllib")
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["roll_ds.models"]
    assert sorted(data) == sorted(f"{m.directory}/*" for m in SHIPPED_MODELS.values())
