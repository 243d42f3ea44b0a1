"""The host a process runs on: CPU model, the instruction-set features that change what runs, cores
and memory.

The project's machines change CPU between days, and what a CPU offers changes behaviour, not only
speed: DeepSpeed's CPU accelerator trains fp16 only where oneDNN has fp16 kernels (AVX512-FP16 or
AMX-FP16), bf16 matmuls are fast only with AMX-bf16 / AVX512-BF16, and the same suite took 24 and
50 minutes on two hosts. So ``scripts/test.sh`` prints this record before the tests and every
benchmark JSON carries it (``with_host``): a figure says which host it came from. Stdlib only;
torch is imported only for the oneDNN verdicts, on request.

    python -m roll_ds.host      # one line: the model, the features, cores, memory, oneDNN's say
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# /proc/cpuinfo flags whose presence changes what runs or how fast (x86 names)
FEATURES = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
)


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and which of ``FEATURES`` it flags, from ``/proc/cpuinfo`` (or the
    given text); on a machine without it (macOS) the model is ``platform.processor()`` and no
    feature is known."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's block names them all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": model, "cpu_flags": [f for f in FEATURES if f in flags]}


def onednn_verdicts() -> dict[str, bool]:
    """What torch's oneDNN says it runs natively here: ``fp16`` is the query DeepSpeed's CPU
    accelerator answers ``is_fp16_supported()`` with (its engine refuses fp16 where it is
    false)."""
    import torch

    mkldnn = torch.ops.mkldnn
    return {
        "fp16": bool(mkldnn._is_mkldnn_fp16_supported()),
        "bf16": bool(mkldnn._is_mkldnn_bf16_supported()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def host_record(*, onednn: bool = False) -> dict[str, Any]:
    """This host as a JSON-able dict; ``onednn`` adds torch's verdicts (imports torch)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    record: dict[str, Any] = {
        **cpu_info(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "system": platform.platform(),
    }
    if onednn:
        record["onednn"] = onednn_verdicts()
    return record


def describe(record: dict[str, Any]) -> str:
    """One line for a log: ``host: AMD EPYC, avx2 avx512f avx512_bf16, 2 cpus, 23.4 GiB, ...``."""
    flags = " ".join(record["cpu_flags"]) or "none of " + "/".join(FEATURES)
    line = f"host: {record['cpu_model']}; features: {flags}; {record['cpus_usable']} cpus usable"
    line += f" of {record['cpus']}; {record['memory_gib']} GiB"
    if "onednn" in record:
        v = record["onednn"]
        line += f"; oneDNN fp16 {'yes' if v['fp16'] else 'no'}, bf16 {'yes' if v['bf16'] else 'no'}"
        line += f", torch CPU capability {v['cpu_capability']}"
    return line


def with_host(result: Any, record: dict[str, Any] | None = None) -> Any:
    """A benchmark result with the host recorded: a dict gains a ``host`` key, each dict of a list
    of rows gains one (readers that walk rows keep working); anything else is returned as is."""
    record = host_record() if record is None else record
    if isinstance(result, dict):
        return {**result, "host": record}
    if isinstance(result, list):
        return [{**r, "host": record} if isinstance(r, dict) else r for r in result]
    return result


if __name__ == "__main__":
    print(describe(host_record(onednn=True)))
