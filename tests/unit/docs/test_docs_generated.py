"""The measured tables of docs/benchmarks.md and README.md are rendered from the benchmarks'
JSON (scripts/docs_benchmarks.py): none differs from its JSON, and a number edited by hand is
caught."""

from __future__ import annotations

from scripts.docs_benchmarks import PAGES, ROOT, render_page, stale_pages


def test_generated_tables_are_fresh():
    assert stale_pages() == [], "run python scripts/docs_benchmarks.py"


def test_a_number_edited_by_hand_is_rendered_back():
    text = (ROOT / "README.md").read_text()
    edited = text.replace("| 42 | 0.12 / 0.325 /", "| 42 | 0.12 / 0.335 /", 1)
    assert edited != text
    assert render_page("README.md", edited) == text


def test_every_page_has_its_blocks():
    for page in PAGES:
        render_page(page, (ROOT / page).read_text())  # raises naming a missing block
