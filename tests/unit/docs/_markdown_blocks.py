"""The fenced blocks of the project's Markdown, for the tests that keep the docs true.

A block may be preceded by a marker line, ``<!-- test: run -->`` (a Python block the tests
execute), ``<!-- test: compose -->`` (an excerpt of a config: it composes, it is not validated
alone), ``<!-- test: hint -->`` (a ``$ python run.py ...`` transcript whose override Hydra
rejects, followed by the ``roll_ds hint:`` it prints) or ``<!-- test: skip (why) -->``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from roll_ds.config.compose import PROJECT_ROOT

# README.md, the site's pages, and cluster/README.md (the site includes it in docs/cluster.md).
DOC_FILES = sorted(
    [
        PROJECT_ROOT / "README.md",
        PROJECT_ROOT / "cluster" / "README.md",
        *(PROJECT_ROOT / "docs").rglob("*.md"),
    ]
)
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^<!-- test: (?P<what>\w+)(?P<why>.*?)-->$")
SHELLS = ("bash", "sh", "shell", "console")
HOME_DIR = "~/my_configs"  # where the docs put a user's configs (# ~/my_configs/<name>.yaml)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # run | hint | skip

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(PROJECT_ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, indent = opened["fence"], len(opened["indent"])
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = MARKER.match(before)
        body = "\n".join(ln[indent:] for ln in lines[i + 1 : end])
        out.append(Block(path, i + 1, opened["lang"], body, marker["what"] if marker else None))
        i = end + 1
    return out


def all_blocks(lang: str | tuple[str, ...]) -> list[Block]:
    langs = (lang,) if isinstance(lang, str) else lang
    return [b for path in DOC_FILES for b in blocks(path) if b.lang in langs]


@dataclass(frozen=True)
class Command:
    """A ``python run.py`` (or ``python -m roll_ds.evaluate``) command line of a doc."""

    block: Block
    text: str
    entry: str  # run.py | roll_ds.evaluate
    config_name: str
    config_dir: str | None
    overrides: tuple[str, ...]


def shell_lines(text: str) -> list[str]:
    """Logical lines of a shell block (backslash continuations joined, ``$ `` prompts dropped);
    in a transcript only the prompted lines are commands."""
    joined = text.replace("\\\n", " ").splitlines()
    prompted = [ln.strip()[2:] for ln in joined if ln.strip().startswith("$ ")]
    return prompted or [ln.strip() for ln in joined]


def parse_command(block: Block, line: str) -> Command | None:
    """The command ``line`` runs, or None when it runs neither entry point."""
    words = shlex.split(line, comments=True)
    if words and words[0] in ("pip", "bash", "docker", "kubectl", "ray"):
        return None
    script = next((i for i, w in enumerate(words) if w.endswith("run.py")), None)
    if script is not None:
        entry, rest = "run.py", words[script + 1 :]
    elif "roll_ds.evaluate" in words:
        entry, rest = "roll_ds.evaluate", words[words.index("roll_ds.evaluate") + 1 :]
    else:
        return None
    name = directory = None
    overrides: list[str] = []
    it = iter(rest)
    for word in it:
        if word in ("--config-name", "-cn"):
            name = next(it)
        elif word.startswith("--config-name="):
            name = word.partition("=")[2]
        elif word in ("--config-dir", "-cd"):
            directory = next(it)
        elif word == "--cfg":
            next(it)  # job | hydra | all: printing only
        elif word == "--resolve":
            pass
        elif word.startswith("-"):
            raise ValueError(f"{block.where}: option {word!r} the docs test does not know")
        else:
            overrides.append(word)
    if name is None:
        raise ValueError(f"{block.where}: {line!r} names no --config-name")
    return Command(block, line, entry, name, directory, tuple(overrides))


def all_commands() -> list[Command]:
    found = []
    for block in all_blocks(SHELLS) + [b for b in all_blocks("text") if b.marker == "hint"]:
        for line in shell_lines(block.text):
            for part in re.split(r"\s(?:&&|\|\||;)\s", line):  # `setup && run`: each command
                command = parse_command(block, part)
                if command is not None:
                    found.append(command)
    return found


def user_configs() -> dict[str, str]:
    """The YAML snippets that say where they live (``# ~/my_configs/<name>.yaml`` on their
    first line): file name -> text. The same file documented twice must read the same."""
    found: dict[str, str] = {}
    for block in all_blocks("yaml"):
        first = block.text.splitlines()[0] if block.text else ""
        match = re.fullmatch(rf"# {re.escape(HOME_DIR)}/(\S+\.yaml)", first.strip())
        if match:
            name = match[1]
            if found.setdefault(name, block.text) != block.text:
                raise ValueError(f"{block.where}: {name} differs from another copy in the docs")
    return found
