"""The configuration reference (docs/reference/config.md) is generated from the schema: it is
fresh, and every key of the schema has a description and a reader."""

from __future__ import annotations

import dataclasses

from roll_ds.config.schema import RLVRConfig
from scripts.config_reference import PAGE, render, source_docs, walk


def test_the_checked_in_reference_is_fresh():
    assert PAGE.read_text() == render(), (
        "docs/reference/config.md is stale: run python scripts/config_reference.py"
    )


def test_every_key_has_a_description_and_every_section_a_reader():
    _, problems = walk()
    assert problems == []


def test_every_top_level_key_is_on_the_page():
    text = PAGE.read_text()
    for field in dataclasses.fields(RLVRConfig):
        assert f"`{field.name}`" in text


def test_a_key_without_a_comment_has_no_description():
    source = (
        "class Section:\n"
        "    # what a does,\n"
        "    # over two lines\n"
        "    a: int = 1\n"
        "    b: int = 2  # what b does\n"
        "\n"
        "    c: int = 3\n"
    )
    docs, _ = source_docs(source)
    assert docs == {
        ("Section", "a"): "what a does, over two lines",
        ("Section", "b"): "what b does",
        ("Section", "c"): "",
    }
