"""Write the configuration reference, docs/reference/config.md, from the schema.

    python scripts/config_reference.py           # rewrite the page
    python scripts/config_reference.py --check   # exit 1 if the checked-in page is stale

Every key of ``roll_ds/config/schema.py``, ``agentic.py`` and ``fault_tolerance.py`` gets its
type and default (from the dataclasses), its allowed values (the tables of
``roll_ds/config/ranges.py`` and the name lists of ``config_reference_tables.py``) and what it
does: the comment beside the field, or the comment lines right above it, read from the source
with ``tokenize``. A key without such a comment is an error, as is a section or top-level key
without a reader in ``config_reference_tables.py`` (``tests/unit/docs/test_config_reference.py``
runs both checks and compares the page).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from omegaconf import MISSING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: scripts/ is a namespace package of the root

from roll_ds.config import agentic, fault_tolerance, ranges, schema  # noqa: E402
from scripts.config_reference_tables import (  # noqa: E402
    PLACEHOLDERS,
    PRIMARY,
    RANGES,
    READERS,
    TOP_LEVEL_GROUPS,
)

PAGE = ROOT / "docs" / "reference" / "config.md"
SOURCES = (Path(schema.__file__), Path(agentic.__file__), Path(fault_tolerance.__file__))


@dataclasses.dataclass
class Key:
    name: str
    type: str
    default: str
    allowed: str
    doc: str
    link: str | None = None  # the anchor of the section this key holds


@dataclasses.dataclass
class Section:
    path: str
    cls: type
    intro: str
    readers: str
    keys: list[Key]
    same_as: str | None = None  # path of the section documenting the same class


# --- what the source says ---------------------------------------------------------------------


def source_docs(source: str) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """``{(class, field): comment}`` for every annotated field of every class in ``source``
    (the comment lines right above the field, then the comment on its own lines), and
    ``{class: docstring}``."""
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whole line)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            whole = not tok.line[: tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), whole)
    fields: dict[tuple[str, str], str] = {}
    docstrings: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        docstrings[node.name] = ast.get_docstring(node) or ""
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line in comments and comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            own = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            beside = [comments[n][0] for n in own if n in comments and not comments[n][1]]
            fields[(node.name, stmt.target.id)] = " ".join(above + beside).strip()
    return fields, docstrings


def _load_docs() -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    fields: dict[tuple[str, str], str] = {}
    docstrings: dict[str, str] = {}
    for path in SOURCES:
        f, d = source_docs(path.read_text())
        fields.update(f)
        docstrings.update(d)
    return fields, docstrings


# --- walking the schema -----------------------------------------------------------------------


def _unwrap(tp: Any) -> tuple[str, type | None]:
    """``("section" | "dict" | "list" | "value", the dataclass)`` of a field's type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = options[0] if len(options) == 1 else tp
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return "section", tp
    origin = typing.get_origin(tp)
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return "dict", args[1]
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return "list", args[0]
    return "value", None


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING


def anchor(path: str) -> str:
    return (
        "".join(c if c.isalnum() or c == "_" else "-" for c in path.lower())
        .strip("-")
        .replace("--", "-")
    )


def walk() -> tuple[list[Section], list[str]]:
    """Every section of the schema, and the problems: keys without a description, sections
    or top-level keys without a reader."""
    docs, docstrings = _load_docs()
    problems: list[str] = []
    sections: list[Section] = []
    seen: dict[type, str] = {}

    def keys_of(cls: type, path: str, instance: Any, only: set[str] | None) -> list[Key]:
        hints = typing.get_type_hints(cls)
        out = []
        for field in dataclasses.fields(cls):
            if only is not None and field.name not in only:
                continue
            kind, child = _unwrap(hints[field.name])
            doc = docs.get((cls.__name__, field.name)) or docs.get(_declaring(cls, field.name))
            if not doc:
                key = f"{path}.{field.name}" if path else field.name
                problems.append(f"{key} ({cls.__name__}): no comment in the schema to describe it")
            value = getattr(instance, field.name) if instance is not None else _default(field)
            link = None
            if kind != "value":
                child_path = _child_path(path, field.name, kind, child)
                link = anchor(child_path)
                visit(child, child_path, value if kind == "section" else None)
            rule = RANGES.get(cls, {}).get(field.name)
            out.append(
                Key(field.name, str(field.type), _show(value), _allowed(rule), doc or "", link)
            )
        return out

    def visit(cls: type, path: str, instance: Any) -> None:
        if any(s.path == path for s in sections):
            return
        if path not in READERS:
            problems.append(f"{path}: no reader in scripts/config_reference_tables.py READERS")
        intro = _markdown(docstrings.get(cls.__name__, ""))
        section = Section(path, cls, intro, READERS.get(path, ""), [])
        sections.append(section)
        primary = PRIMARY.get(cls, seen.get(cls, path))
        if primary != path:
            section.same_as = primary
            base = cls()
            differ = {
                f.name
                for f in dataclasses.fields(cls)
                if instance is not None and getattr(instance, f.name) != getattr(base, f.name)
            }
            section.keys = keys_of(cls, path, instance, differ)
            return
        seen[cls] = path
        own = None
        if cls is schema.RewardConfig:  # its own keys; the rest are <role>'s
            own = set(inspect.get_annotations(cls))
        section.keys = keys_of(cls, path, instance, own)

    def _child_path(path: str, name: str, kind: str, child: type) -> str:
        if child is schema.WorkerConfig and path == "":
            return "<role>"
        base = f"{path}.{name}" if path else name
        if kind == "dict":
            return f"{base}.{PLACEHOLDERS.get(name, '<key>')}"
        return f"{base}[]" if kind == "list" else base

    top = Section("", schema.RLVRConfig, "", "", [])
    sections.append(top)
    grouped = {k for keys, _ in TOP_LEVEL_GROUPS.values() for k in keys}
    top.keys = keys_of(schema.RLVRConfig, "", None, None)
    for key in top.keys:
        if key.link is None and key.name not in grouped:
            problems.append(
                f"{key.name}: no group in scripts/config_reference_tables.py TOP_LEVEL_GROUPS"
            )
    return sections, problems


def _declaring(cls: type, name: str) -> tuple[str, str]:
    """(class, field) of the class that declares ``name`` (a subclass inherits the comment)."""
    for base in cls.__mro__:
        if name in inspect.get_annotations(base):
            return base.__name__, name
    return cls.__name__, name


# --- rendering --------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A default as YAML writes it."""
    if isinstance(value, str) and value == MISSING:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if 1e-3 <= abs(value) < 1e6 or value == 0 else f"{value:.1e}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return _yaml({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return str(value)


def _allowed(rule: Any) -> str:
    if isinstance(rule, ranges.OneOf):
        return "one of " + ", ".join(f"`{_yaml(c)}`" for c in rule.choices)
    if isinstance(rule, ranges.Range):
        return _escape(rule.describe())
    return ""


def _escape(text: str) -> str:
    """Markdown table text: ``|``, ``<`` and ``>`` escaped outside code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _markdown(docstring: str) -> str:
    """A class docstring as one Markdown paragraph (reST ``code`` becomes `code`)."""
    return _escape(" ".join(docstring.split()).replace("``", "`"))


def _title(path: str) -> str:
    return f"## `{path}` {{#{anchor(path)}}}"


def _table(keys: list[Key], prefix: str) -> list[str]:
    lines = ["| key | type | default | allowed | what it does |", "|---|---|---|---|---|"]
    for key in keys:
        name = f"`{prefix}{key.name}`"
        if key.link:
            name = f"[{name}](#{key.link})"
        cells = [name, f"`{key.type}`", key.default, key.allowed, _escape(key.doc)]
        lines.append("| " + " | ".join(c.replace("`|`", "`\\|`") for c in cells) + " |")
    return lines


HEADER = """\
# Configuration reference

<!-- Generated by `python scripts/config_reference.py` from roll_ds/config/schema.py,
agentic.py and fault_tolerance.py: edit the comments there, then rerun it. A unit test fails
while this page is stale or a key has no comment. -->

Every key of a pipeline config: its type, its default (the schema's; the shipped configs set
many of them, see [Configuration](../configuration.md)), the values validation allows, what it
does, and who reads it. Set any of them in YAML or on the command line with its dotted path:

```bash
python run.py --config-name rlvr_lora_zero3 actor_train.training_args.learning_rate=1e-3
```

`<role>` stands for `actor_train`, `actor_infer`, `reference` and `critic`; `rewards.<name>`
for each reward role, `custom_envs.<tag>` for each environment. `required` marks a key without
a default (`???`). Allowed values not listed are checked by the component that reads the key,
when the config is validated.
"""


def render() -> str:
    sections, problems = walk()
    if problems:
        raise ValueError("config reference:\n" + "\n".join(f"  - {p}" for p in problems))
    top, rest = sections[0], sections[1:]
    lines = [HEADER]
    for group, (names, readers) in TOP_LEVEL_GROUPS.items():
        lines += [f"## {group} {{#{anchor(group)}}}", "", f"Read by {readers}.", ""]
        lines += [*_table([k for k in top.keys if k.name in names], ""), ""]
    lines += ["## Sections {#sections}", ""]
    lines += [*_table([k for k in top.keys if k.link], ""), ""]
    for section in rest:
        lines += [_title(section.path), ""]
        if section.intro:
            lines += [section.intro, ""]
        lines += [f"Read by {section.readers}.", ""]
        if section.same_as is not None:
            same = f"The keys of [`{section.same_as}`](#{anchor(section.same_as)})"
            if not section.keys:
                lines += [same + ", with the same defaults.", ""]
                continue
            lines += [same + "; these defaults differ:", ""]
        elif section.cls is schema.RewardConfig:
            lines += ["Every key of [`<role>`](#role), and these:", ""]
        lines += [*_table(section.keys, ""), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/config_reference.py")
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
