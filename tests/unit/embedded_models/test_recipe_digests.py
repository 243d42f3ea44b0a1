"""Each shipped embedded model was built from its current recipe: the digest recorded in its
directory's roll_ds_recipe.json equals the recipe's digest now. A recipe change (or a change to
what it hashes: the task generator, the environments, the chat template, the policy the others
start from) fails here until ``python scripts/make_embedded.py --model <name>`` rebuilds it."""

from __future__ import annotations

import importlib.util
import os

import pytest

from examples.embedded_models import RECIPES, recipe_module
from examples.embedded_models.common import shipped_digest
from roll_ds.models.shipped import SHIPPED_MODELS, shipped_model

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "..")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_shipped_model_is_built_from_the_current_recipe(name):
    recipe = recipe_module(name)
    model = shipped_model(recipe.NAME)
    shipped, current = shipped_digest(model.path), recipe.current_digest()
    assert shipped == current, (
        f"roll_ds/models/{model.directory} ({recipe.NAME}) was built from recipe {shipped}, but "
        f"the current recipe is {current}: rebuild it with `python scripts/make_embedded.py "
        f"--model {name}` and commit the directory."
    )
    size = sum(os.path.getsize(os.path.join(model.path, f)) for f in os.listdir(model.path))
    assert size < 2.2 * 2**20


def test_every_shipped_model_has_a_recipe():
    assert {m.recipe for m in SHIPPED_MODELS.values()} == set(RECIPES)
    for name in RECIPES:
        assert SHIPPED_MODELS[recipe_module(name).NAME].recipe == name
    with pytest.raises(ValueError, match="unknown embedded model recipe 'big'; valid: policy"):
        recipe_module("big")


def test_make_embedded_check_reports_up_to_date(capsys):
    spec = importlib.util.spec_from_file_location(
        "make_embedded", os.path.join(REPO, "scripts", "make_embedded.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model", "rm", "--check"]) == 0
    assert "up to date" in capsys.readouterr().out
