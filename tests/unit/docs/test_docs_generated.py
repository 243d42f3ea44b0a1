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


def test_speed_table_perf_cells_from_rlvr_steps_means():
    """The README speed table's train TFLOP/s (MFU) and generation cells come from the default
    run's ``mean_perf`` (benchmarks/rlvr_step.py), "—" in a result written before it."""
    from benchmarks.rlvr_step import mean_perf
    from scripts.docs_benchmarks import _perf

    rows = [
        {"perf/tflops": 0.002, "perf/mfu": 0.03, "perf/generate_tokens_per_s": 100.0},
        {"perf/tflops": 0.004, "perf/mfu": 0.05, "perf/generate_tokens_per_s": 300.0},
    ]
    perf = mean_perf(rows)
    assert perf == {"tflops": 0.003, "mfu": 0.04, "generate_tokens_per_s": 200.0}
    assert _perf({"mean_perf": perf}) == ("0.003 (4.0%)", "200")
    assert _perf({}) == ("—", "—")
    # a metric one step lacks (a step that trained nothing) is left out, not averaged short
    assert "mfu" not in mean_perf([rows[0], {"perf/generate_tokens_per_s": 1.0}])
