"""Links and paths in the docs point at things that exist.

``mkdocs build --strict`` (run by scripts/test.sh) checks the links between the site's pages and
their anchors; the README is not a page of the site, so its relative links (and the anchors they
name in docs/) are checked here. Every repository path written in code spans of the README and
the pages (``roll_ds/pipeline/rlvr.py``, ``scripts/gpu/``) must exist too: a moved or renamed
file fails here until the docs follow it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _markdown_blocks import DOC_FILES
from markdown.extensions.toc import slugify

from roll_ds.config.compose import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
TOP_DIRS = ("roll_ds", "strategies", "scripts", "tests", "benchmarks", "examples", "cluster")
TOP_DIRS += ("docs", "hydra_plugins")
REPO_PATH = re.compile(rf"^(?:{'|'.join(TOP_DIRS)})/[\w./-]*$")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)(?:\s+\{#(?P<id>[\w-]+)\})?\s*$")


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings: explicit ``{#id}`` or the toc extension's slug."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else HEADING.match(line)
        if heading:
            found.add(heading["id"] or slugify(heading["title"].replace("`", ""), "-"))
    return found


def readme_links() -> list[str]:
    text = README.read_text(encoding="utf-8")
    return [m["target"] for m in LINK.finditer(text) if "://" not in m["target"]]


def test_the_readme_links_into_the_docs():
    assert sum(t.startswith("docs/") for t in readme_links()) >= 10


@pytest.mark.parametrize("target", readme_links())
def test_readme_link_resolves(target: str):
    path, _, anchor = target.partition("#")
    file = (README.parent / path) if path else README
    assert file.exists(), f"README.md links to {path}, which does not exist"
    if anchor and file.suffix == ".md":
        assert anchor in anchors(file), f"README.md links to {target}: no such heading"


def repo_paths(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    spans = (m.group(1).strip() for m in CODE_SPAN.finditer(text))
    return sorted({s for s in spans if REPO_PATH.match(s) and not re.search(r"[<>*{}]", s)})


@pytest.mark.parametrize("page", DOC_FILES, ids=lambda p: str(p.relative_to(PROJECT_ROOT)))
def test_paths_named_in_the_docs_exist(page: Path):
    missing = [p for p in repo_paths(page) if not (PROJECT_ROOT / p.rstrip("/")).exists()]
    assert not missing, f"{page.relative_to(PROJECT_ROOT)} names paths that do not exist: {missing}"
