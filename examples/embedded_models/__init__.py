"""The recipes that build the embedded tiny models roll_ds ships (``roll_ds/models/embedded_*/``).

Not part of the framework: a run only loads the shipped directories (``roll_ds/models/shipped.py``)
and never imports this package. Here live how they were made, beside the task data they learn
from:

    policy.py         embedded:tiny-qwen2, the default policy: a seeded init (tiny.py) warmed up
                      on the synthetic tasks (synthetic.py, synthetic_code.py: also what
                      scripts/make_task_data.py writes to examples/qwen_rlvr/data/)
    reward_model.py   embedded:tiny-rm, a sequence classifier started from the policy
    agent.py          embedded:tiny-agent, the policy warmed up on episodes of the shipped
                      environments
    common.py         what the three share: the digest recorded beside a shipped model, the
                      atomic replacement of its directory

Each recipe module has the same face: ``NAME`` (the ``embedded:`` name it ships as),
``DEFAULT_RECIPE``, ``current_digest()``, ``build(out_dir, recipe)`` and ``report(info)``.
``python scripts/make_embedded.py --model {policy,rm,agent} [--check]`` rebuilds (or checks) one;
a unit test fails while a shipped directory was built from another recipe than the current one.
"""

from __future__ import annotations

import importlib
from types import ModuleType

RECIPES = {"policy": "policy", "rm": "reward_model", "agent": "agent"}
"""``scripts/make_embedded.py --model`` name -> the recipe module here."""


def recipe_module(name: str) -> ModuleType:
    if name not in RECIPES:
        raise ValueError(f"unknown embedded model recipe {name!r}; valid: {', '.join(RECIPES)}")
    return importlib.import_module(f"{__name__}.{RECIPES[name]}")
