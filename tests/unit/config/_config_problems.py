"""What ``load_config`` refuses: the problem lines of a config with some overrides (shared by the
config tests)."""

import pytest

from roll_ds.config import ConfigError, load_config


def problems(*overrides: str, config: str = "rlvr_lora_zero3") -> list[str]:
    """Every problem ``load_config(config, overrides)`` reports (it must refuse)."""
    with pytest.raises(ConfigError) as info:
        load_config(config, list(overrides), check_files=False)
    return info.value.problems


def only(*overrides: str) -> str:
    """The one problem the default config with ``overrides`` has."""
    found = problems(*overrides)
    assert len(found) == 1, found
    return found[0]
