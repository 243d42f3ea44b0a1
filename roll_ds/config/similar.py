"""The schema's field names that look like a misspelt one (validation and Hydra's hints both
suggest them; its own module so validation need not import the hints, which compose configs)."""

from __future__ import annotations

import dataclasses
import difflib


def close_keys(name: str, section: type) -> list[str]:
    """Up to three field names of the schema dataclass ``section`` that look like ``name``."""
    valid = [f.name for f in dataclasses.fields(section)]
    return difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
