"""Compose a pipeline config outside ``run.py`` (tests, notebooks, benchmarks).

``config_dir`` may be any directory: the example configs are on Hydra's search path wherever
the config lives (``hydra_plugins/roll_ds_searchpath``), and the config's ``replace:`` section
is applied after composing (``replace.py``), as run.py does.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import roll_ds.config.store  # noqa: F401  (registers the schema)
from roll_ds.config.null_sections import guard_overrides
from roll_ds.config.paths import PROJECT_ROOT
from roll_ds.config.replace import apply_replacements
from roll_ds.config.schema import RLVRConfig
from roll_ds.config.validate import to_schema, validate

DEFAULT_CONFIG_DIR = PROJECT_ROOT / "examples" / "qwen_rlvr"


def compose_config(
    config_name: str,
    overrides: list[str] | None = None,
    config_dir: str | Path | None = None,
    *,
    replace: bool = True,
) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` (default examples/qwen_rlvr) like run.py does
    (``replace=False``: its ``replace:`` section is left unapplied)."""
    directory = Path(config_dir or DEFAULT_CONFIG_DIR).resolve()
    overrides = list(overrides or [])
    guard_overrides()  # overrides of null sections, as run.py applies them
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides)
    return apply_replacements(cfg, overrides) if replace else cfg


def load_config(
    config_name: str,
    overrides: list[str] | None = None,
    config_dir: str | Path | None = None,
    *,
    check_files: bool = True,
) -> RLVRConfig:
    """Compose, convert to the typed schema and validate."""
    cfg = to_schema(compose_config(config_name, overrides, config_dir))
    validate(cfg, check_files=check_files)
    return cfg
