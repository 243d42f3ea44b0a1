"""The embedded tiny models, shipped with the package: ``embedded:<name>`` -> its directory.

No model hub is reachable at run time, so three tiny models ship as package data under
``roll_ds/models/``: ``embedded:tiny-qwen2`` (the default policy), ``embedded:tiny-rm`` (a reward
model) and ``embedded:tiny-agent`` (the policy warmed up on episodes). Their builds are long float
computations whose result differs between machines, so every machine runs the same files, and
the runtime never builds one: it finds the directory and checks it is complete.

The recipes that build them live outside the package (``examples/embedded_models/``);
``python scripts/make_embedded.py --model <recipe>`` rebuilds one, and a unit test fails while a
shipped directory was built from another recipe than the current one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from roll_ds.config.schema import EMBEDDED_AGENT, EMBEDDED_MODEL, EMBEDDED_RM

EMBEDDED_PREFIX = "embedded:"
RECIPE_FILE = "roll_ds_recipe.json"
"""Written by a build beside the model: the recipe, its digest and what the build measured."""
MODELS_DIR = os.path.dirname(os.path.abspath(__file__))
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
"""What loading a shipped model reads: its config, weights and tokenizer."""


@dataclass(frozen=True)
class ShippedModel:
    directory: str  # under roll_ds/models/
    recipe: str  # its recipe's name for scripts/make_embedded.py

    @property
    def path(self) -> str:
        return os.path.join(MODELS_DIR, self.directory)

    @property
    def rebuild_command(self) -> str:
        return f"python scripts/make_embedded.py --model {self.recipe}"


SHIPPED_MODELS = {
    EMBEDDED_MODEL: ShippedModel("embedded_tiny_qwen2", "policy"),
    EMBEDDED_RM: ShippedModel("embedded_tiny_rm", "rm"),
    EMBEDDED_AGENT: ShippedModel("embedded_tiny_agent", "agent"),
}


def shipped_model(name: str) -> ShippedModel:
    """The shipped model ``name`` (``embedded:<name>``); an unknown name fails listing them."""
    if name not in SHIPPED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; valid: {', '.join(SHIPPED_MODELS)}")
    return SHIPPED_MODELS[name]


def missing_files(path: str) -> list[str]:
    """The ``REQUIRED_FILES`` absent from the model directory ``path``."""
    return [f for f in REQUIRED_FILES if not os.path.isfile(os.path.join(path, f))]


def resolve_embedded(name: str) -> str:
    """The directory of the shipped model ``name``, checked complete; an incomplete one (a
    partial install, a deleted file) fails naming what is missing and how to restore it."""
    model = shipped_model(name)
    missing = missing_files(model.path)
    if missing:
        raise FileNotFoundError(
            f"{name}: the shipped model directory {model.path} is incomplete (missing "
            f"{', '.join(missing)}). Restore it from the repository (`git checkout -- "
            f"roll_ds/models/{model.directory}`, then `pip install -e .`), or rebuild it with "
            f"`{model.rebuild_command}`."
        )
    return model.path


def resolve_pretrain(pretrain: str) -> str:
    """A local model directory for the config's ``pretrain`` field: an embedded name gives its
    shipped directory, a local directory is returned unchanged, anything else fails (no model
    hub is reachable)."""
    if pretrain.startswith(EMBEDDED_PREFIX):
        return resolve_embedded(pretrain)
    if os.path.isdir(pretrain):
        return pretrain
    raise ValueError(
        f"pretrain={pretrain!r} is neither {EMBEDDED_MODEL!r} nor an existing local directory. "
        "No model hub is reachable from this environment: download the model elsewhere and set "
        f"`pretrain` to its local directory, or use pretrain={EMBEDDED_MODEL!r}."
    )
