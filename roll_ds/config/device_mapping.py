"""Parse ``device_mapping`` values without ``eval``.

Accepted forms (whitespace is ignored):

    list(range(0,16))       list(range(a, b[, step]))   Python's range semantics
    [0,1,2]                 a bracketed list of ints (a YAML list gives the same)
    0-3                     an inclusive span
    0,2,4  or  0-3,8-11     comma-separated ints and spans

Anything else is rejected with a message that shows the accepted forms.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

FORMS = "list(range(a,b[,step])), [0,1,2], 0-3 or 0,2,4"

_RANGE = re.compile(r"^list\(range\((-?\d+)(?:,(-?\d+))?(?:,(-?\d+))?\)\)$")
_SPAN = re.compile(r"^(\d+)-(\d+)$")
_INT = re.compile(r"^\d+$")


class DeviceMappingError(ValueError):
    pass


def parse_device_mapping(value: object) -> list[int]:
    """Return the device ids of ``value``; ``None`` means no devices (CPU-only role)."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise DeviceMappingError(f"expected {FORMS}, got {value!r}")
    if isinstance(value, int):
        ids = [value]
    elif isinstance(value, Sequence) and not isinstance(value, str):
        ids = [_as_int(v, value) for v in value]
    elif isinstance(value, str):
        ids = _parse_text(value)
    else:
        raise DeviceMappingError(f"expected {FORMS}, got {type(value).__name__} {value!r}")
    if any(i < 0 for i in ids):
        raise DeviceMappingError(f"device ids must be >= 0, got {value!r}")
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise DeviceMappingError(f"device ids repeat ({duplicates}) in {value!r}")
    return ids


def _as_int(item: object, whole: object) -> int:
    if isinstance(item, bool) or not isinstance(item, int):
        raise DeviceMappingError(f"device ids must be integers, got {item!r} in {whole!r}")
    return item


def _parse_text(text: str) -> list[int]:
    compact = re.sub(r"\s+", "", text)
    if not compact:
        raise DeviceMappingError(f"empty device_mapping; expected {FORMS}")
    match = _RANGE.match(compact)
    if match:
        start, stop, step = (int(g) if g is not None else None for g in match.groups())
        if stop is None:
            start, stop = 0, start
        if step == 0:
            raise DeviceMappingError(f"range step must not be 0 in {text!r}")
        return list(range(start, stop, step or 1))
    if compact.startswith("[") and compact.endswith("]"):
        inner = compact[1:-1]
        if not inner:
            return []
        parts = inner.split(",")
        if not all(_INT.match(p) for p in parts):
            raise DeviceMappingError(f"expected a list of integers like [0,1,2], got {text!r}")
        return [int(p) for p in parts]
    ids: list[int] = []
    for part in compact.split(","):
        span = _SPAN.match(part)
        if span:
            lo, hi = int(span.group(1)), int(span.group(2))
            if hi < lo:
                raise DeviceMappingError(f"span {part!r} runs backwards in {text!r}")
            ids.extend(range(lo, hi + 1))
        elif _INT.match(part):
            ids.append(int(part))
        else:
            raise DeviceMappingError(f"cannot parse {text!r}; expected {FORMS}")
    return ids
