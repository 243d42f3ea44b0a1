"""Register the schemas in Hydra's ConfigStore.

A pipeline YAML names the schema first in its defaults list (``- rlvr_config``), so Hydra merges
the YAML into the typed schema and rejects unknown keys and wrong types while composing.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from roll_ds.config.paths import register_resolvers
from roll_ds.config.schema import RLVRConfig

SCHEMA_NAME = "rlvr_config"


def register_schemas() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLVRConfig)


register_schemas()
register_resolvers()  # ${roll_ds_root:} (roll_ds/config/paths.py)
