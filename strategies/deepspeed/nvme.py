"""ZeRO-Infinity's NVMe offload, checked before any actor starts.

A role whose DeepSpeed config offloads to NVMe (``${deepspeed_zero3_nvme}``) needs:

- libaio: DeepSpeed's async I/O op (``AsyncIOBuilder``) is built on first use against it; without
  it the first rank would fail deep inside ``deepspeed.initialize``. ``libaio_available`` asks
  the compiler what DeepSpeed's ``AsyncIOBuilder.is_compatible`` asks (link a program calling
  ``io_submit`` with ``-laio``, honouring ``CFLAGS``/``LDFLAGS``) without importing DeepSpeed,
  so validation stays light;
- an ``nvme_path`` per offloaded section (``"auto"``: the role's directory under the run's
  output, ``roll_ds.config.deepspeed.role_nvme_dir``) that exists or can be created, is
  writable, and has room for what is swapped (``swap_bytes``): the parameters in their dtype,
  and for the trained parameters fp32 master weights, Adam's two moments and the gradients (16
  bytes each).
  DeepSpeed writes them all when the engine starts, whatever ``max_in_cpu`` keeps in host
  memory as well. Each node holds its own ranks' partitions, and every rank of a node swaps onto
  the same disk: the room needed is the node's share (its ranks / the data-parallel size), not
  one rank's. The driver counts a node's ranks from ``device_mapping`` and
  ``num_gpus_per_node``; each rank counts the ranks whose ``nvme_path`` is on its own file
  system (host name and device number, gathered over the role's process group);
- a file system that takes ``O_DIRECT`` (DeepSpeed opens its swap files with it), and that is
  not memory: on tmpfs, ramfs or devtmpfs (``/dev``) "NVMe" is host memory, which the offload
  was meant to spare.
  That works (tmpfs takes ``O_DIRECT`` since Linux 6.6), so it is a warning. A directory
  whose mode bits allow writing may still refuse files (root on sysfs, an ACL, NFS): a probe
  file is created (and removed);
- swap buffers that can work (``buffer_problems``): ``offload_param.buffer_size`` holds the
  largest parameter's partition and the pinned buffers fit host memory; ``aio.block_size``
  within 4 KiB..1 GiB.

Light: no torch or DeepSpeed import (the sizes are read from the safetensors headers). The
config's checks run these on the machine that validates (``deepspeed_run_problems`` in
``config_checks.py``, the ``deepspeed`` component check); every rank runs ``check_rank_nvme``
for its own node before building its engine.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_ds.config.deepspeed import AUTO, nvme_paths, zero_stage

logger = logging.getLogger(__name__)

LIBAIO_PACKAGE = "libaio-dev"  # Debian/Ubuntu; libaio-devel on RHEL/Fedora, libaio on Arch
# memory, not disk: tmpfs and ramfs, and devtmpfs (what /dev is mounted as)
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# per trained parameter: fp32 master weight, Adam's exp_avg and exp_avg_sq, and the fp32 gradient
# (the optimizer swapper writes gradients to NVMe too: tests/integration/test_zero3_nvme.py)
OPTIMIZER_BYTES = 16
IO_SUBMIT_PROGRAM = "#include <libaio.h>\nint main(void) { io_submit(0, 0, 0); return 0; }\n"


NOT_ADAPTED = ("lm_head", "embed_tokens", "score")  # what peft's all-linear leaves out


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts read from a model directory's safetensors headers."""

    numel: int
    largest_numel: int  # the largest single tensor (NVMe swap buffers must hold its partition)
    matrices: tuple[tuple[str, int, int], ...] = ()  # (module name, out, in) of 2-D weights

    def adapter_numel(self, rank: int, target: str) -> int:
        """The parameters of a LoRA adapter of ``rank`` on ``target`` (``"all-linear"`` or a
        comma list of module names): ``rank x (in + out)`` per adapted weight."""
        names = None if target == "all-linear" else {t.strip() for t in target.split(",")}
        return sum(
            rank * (n_in + n_out)
            for module, n_out, n_in in self.matrices
            if (module in names if names is not None else module not in NOT_ADAPTED)
        )


def model_size(model_dir: str) -> ModelSize | None:
    """The parameter counts of the safetensors files in ``model_dir``; None without any."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    numel = largest = 0
    matrices = []
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            numel += count
            largest = max(largest, count)
            if name.endswith(".weight") and len(entry["shape"]) == 2:
                module = name.removesuffix(".weight").rsplit(".", 1)[-1]
                matrices.append((module, *entry["shape"]))
    return ModelSize(numel, largest, tuple(matrices))


def swap_bytes(
    sections: Iterable[str], *, numel: int, trained_numel: int, dtype: str, share: float = 1.0
) -> int:
    """Bytes DeepSpeed writes under the NVMe paths of ``sections`` (``offload_param``,
    ``offload_optimizer``) for a model of ``numel`` parameters, ``trained_numel`` of them
    trained; ``share``: the fraction of the data-parallel ranks on this node."""
    total = 0
    if "offload_param" in sections:
        total += numel * DTYPE_BYTES.get(dtype, 4)
    if "offload_optimizer" in sections:
        total += trained_numel * OPTIMIZER_BYTES
    return int(total * share)


def filesystem_type(path: str) -> str | None:
    """The type of the file system holding the existing ``path`` (``/proc/self/mounts``)."""
    from strategies.deepspeed.ops import filesystem_type as from_mounts

    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return None
    return from_mounts(os.path.realpath(path), mounts)


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(directory: Path) -> bool:
    """Whether this process may create files in ``directory`` (EROFS included)."""
    return os.access(directory, os.W_OK | os.X_OK)


def _creation_problem(directory: Path, path: str, field: str) -> str | None:
    """The problem when no file can be created in ``directory`` though its mode bits allow it
    (a read-only or immutable directory seen by root, sysfs, an ACL, a network file system that
    maps the user to nobody), found by creating one (removed); None when one can be."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".roll_ds_nvme_probe_")
    except OSError as exc:
        return (
            f"{field}: {path}: no file can be created in {directory} ({exc.strerror or exc}), "
            f"though it looks writable; choose a directory on a local NVMe drive this user can "
            f"write to for {field}"
        )
    os.close(fd)
    os.unlink(name)
    return None


def _direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` open with ``O_DIRECT``, as DeepSpeed's async I/O opens
    its swap files (tmpfs refuses it before Linux 6.6, and so do some FUSE and network file
    systems): a temporary file, removed."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return True  # not Linux: DeepSpeed's op does not build there anyway
    fd, name = tempfile.mkstemp(dir=directory, prefix=".roll_ds_direct_io_")
    os.close(fd)
    try:
        os.close(os.open(name, os.O_WRONLY | flag))
        return True
    except OSError as exc:
        return exc.errno != errno.EINVAL
    finally:
        os.unlink(name)


def path_problems(path: str, need_bytes: int, field: str) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of ``path`` as a swap directory for ``need_bytes``, without
    creating it: the nearest existing directory above it must be a writable directory with the
    room; memory file systems warn."""
    target = Path(path).absolute()
    base = _existing_ancestor(target)
    if not base.is_dir():
        return [
            f"{field}: {path} cannot be created: {base} is a file, not a directory; set "
            f"{field} to a directory"
        ], []
    if not _writable(base):
        what = "is not writable" if base == target else f"cannot be created ({base} is read-only)"
        return [
            f"{field}: {path} {what} for this user; choose a writable directory on a local NVMe "
            f"drive for {field}"
        ], []
    refused = _creation_problem(base, path, field)
    if refused:
        return [refused], []
    kind = filesystem_type(str(base))
    if not _direct_io(base):
        return [
            f"{field}: {path} is on a file system that refuses O_DIRECT ({kind}), which "
            f"DeepSpeed's async I/O opens its swap files with; choose a directory on a local "
            f"drive (ext4, xfs) for {field}"
        ], []
    warnings = []
    if kind in MEMORY_FILESYSTEMS:
        warnings.append(
            f"{field}: {path} is on {kind}, which is memory: what is offloaded there takes host "
            f"memory, not disk; point {field} at a local NVMe drive to spare memory"
        )
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        return [
            f"{field}: {path} has {_gib(free)} free, but ZeRO-Infinity swaps about "
            f"{_gib(need_bytes)} there on this node (parameters in their dtype, 16 bytes per "
            f"trained parameter for the optimizer); free space or choose a larger drive for {field}"
        ], warnings
    return [], warnings


def disk_id(path: str) -> tuple[str, int]:
    """Which disk ``path`` swaps onto, comparable across ranks: the host and the device number
    of its nearest existing directory."""
    import socket

    return socket.gethostname(), os.stat(_existing_ancestor(Path(path).absolute())).st_dev


def disk_peers(paths: list[str]) -> list[int]:
    """For each of ``paths`` (the same list on every rank): how many ranks of this process group
    swap onto the disk this rank's copy of it is on, itself included; 1 each without a process
    group."""
    mine = [disk_id(p) for p in paths]
    everyone = _gather_disk_ids(mine)
    return [sum(ids[i] == disk for ids in everyone) for i, disk in enumerate(mine)]


def _gather_disk_ids(mine: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """Every rank's ``disk_id`` list (the process group is the boundary tests fake)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [[tuple(d) for d in ids] for ids in gathered]


# aio.block_size, bytes per I/O request: DeepSpeed's default is 1 MiB (its ds_nvme_tune sweeps
# 128 KiB to 8 MiB). Below a 4 KiB page O_DIRECT requests lose their alignment; above 1 GiB one
# request nears Linux's cap on a single read or write (2 GiB less a page).
AIO_BLOCK_RANGE = (4096, 2**30)


def buffer_problems(
    ds_config: Mapping[str, Any],
    field: str,
    *,
    largest_numel: int | None,
    dp_size: int,
    dtype: str,
    ranks_on_node: int,
    host_bytes: int | None,
) -> list[str]:
    """An ``offload_param.buffer_size`` outside what can work, and an ``aio.block_size`` outside
    a sane range, each naming the key and the range. ``buffer_size`` elements per swap buffer:
    every parameter's partition must fit one (at least the largest parameter over ``dp_size``,
    ``largest_numel`` None: unknown), and each rank pins ``buffer_count`` of them in host memory
    (``host_bytes``, None: unknown), ``ranks_on_node`` ranks on the fullest node."""
    problems = []
    zero = ds_config.get("zero_optimization") or {}
    param = zero.get("offload_param") or {}
    size = param.get("buffer_size", AUTO) if param.get("device") == "nvme" else AUTO
    if _is_number(size):
        key = f"{field}.zero_optimization.offload_param.buffer_size"
        count = param.get("buffer_count", 5)
        count = count if _is_number(count) and count >= 1 else 1  # a bad one is reported
        per_element = DTYPE_BYTES.get(dtype, 4) * count * max(ranks_on_node, 1)
        low = -(-largest_numel // max(dp_size, 1)) if largest_numel else 1
        high = host_bytes // per_element if host_bytes else None
        if size < low or (high is not None and size > high):
            span = f"[{low:,}, {high:,}]" if high is not None else f">= {low:,}"
            problems.append(
                f"{key}: {size:,.0f} elements is outside what can work, {span}: each parameter's "
                f"partition must fit one buffer (the largest: {low:,} elements), and "
                f"{max(ranks_on_node, 1)} rank(s) x buffer_count {count} buffers x "
                f"{DTYPE_BYTES.get(dtype, 4)} bytes ({dtype}) are pinned in host memory"
                + (f" ({_gib(host_bytes)} here)" if host_bytes else "")
                + "; set it to auto (the largest partition) or a number in that range"
            )
    block = (ds_config.get("aio") or {}).get("block_size")
    low, high = AIO_BLOCK_RANGE
    if _is_number(block) and not low <= block <= high:
        problems.append(
            f"{field}.aio.block_size: {block:,.0f} bytes per I/O request is outside a sane range, "
            f"[{low:,}, {high:,}] (DeepSpeed's default 1,048,576; its ds_nvme_tune measures the "
            "best value for a drive)"
        )
    return problems


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def libaio_available() -> bool:
    """Whether a program calling ``io_submit`` compiles and links against libaio, as DeepSpeed's
    ``AsyncIOBuilder.is_compatible`` tests it (its build needs the header and ``-laio``)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "aio.c")
        Path(source).write_text(IO_SUBMIT_PROGRAM)
        cmd = [
            compiler,
            *os.environ.get("CFLAGS", "").split(),
            source,
            "-o",
            os.path.join(tmp, "aio"),
            *os.environ.get("LDFLAGS", "").split(),
            "-laio",
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def libaio_problem(field: str) -> str:
    return (
        f"{field}: NVMe offload needs libaio to build DeepSpeed's async I/O op, and no program "
        f"links with -laio here: install {LIBAIO_PACKAGE} (Debian/Ubuntu: apt-get install "
        f"{LIBAIO_PACKAGE}; scripts/setup.sh does it as root; libaio-devel on RHEL), or set "
        "CFLAGS/LDFLAGS to where libaio.h and libaio.so are, or offload to cpu instead "
        "(${deepspeed_zero3_cpuoffload})"
    )


def ds_nvme_problems(
    ds_config: Mapping[str, Any],
    field: str,
    *,
    nvme_dir: str,
    size: ModelSize | None,
    trained_numel: int | None,
    dtype: str,
    share: float = 1.0,
    path_shares: Mapping[str, float] | None = None,
) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of one role's NVMe offload (``field``: its strategy_config).
    ``size`` None: the room is not checked (a model whose weights are not readable here).
    ``share``: the fraction of the role's data-parallel ranks that swap onto each path's disk
    (``path_shares``: per path, where known)."""
    paths = nvme_paths(ds_config)
    if not paths or (zero_stage(ds_config) != 3 and "offload_param" in paths):
        return [], []  # no NVMe, or a stage error reported by check_deepspeed_config
    problems: list[str] = []
    warnings: list[str] = []
    if not libaio_available():
        problems.append(libaio_problem(field))
    by_dir: dict[str, list[str]] = {}
    for section, path in paths.items():
        by_dir.setdefault(nvme_dir if path == AUTO else str(path), []).append(section)
    for path, sections in by_dir.items():
        need = 0
        if size is not None:
            trained = size.numel if trained_numel is None else trained_numel
            on_disk = (path_shares or {}).get(path, share)
            need = swap_bytes(
                sections, numel=size.numel, trained_numel=trained, dtype=dtype, share=on_disk
            )
        key = f"{field}.zero_optimization.{sections[0]}.nvme_path"
        found, warned = path_problems(path, need, key)
        problems += found
        warnings += warned
    return problems, warnings


def check_rank_nvme(
    ds_config: Mapping[str, Any],
    *,
    size: ModelSize | None,
    trained_numel: int | None,
    dtype: str,
    dp_size: int,
) -> None:
    """A rank's check of its built config (``nvme_path`` resolved) before its engine starts:
    raises ``ValueError`` with every problem, logs the warnings. The rank's node may not be the
    machine that validated the config; each rank checks room for the partitions of every rank
    that swaps onto the same disk (``disk_peers``: a collective, so every rank of the role
    calls this)."""
    paths = nvme_paths(ds_config)
    if not paths:
        return
    directories = sorted({str(p) for p in paths.values()})
    peers = disk_peers(directories)
    shares = {d: min(1.0, n / max(1, dp_size)) for d, n in zip(directories, peers, strict=True)}
    problems, warnings = ds_nvme_problems(
        ds_config,
        "strategy_config",
        nvme_dir=next(iter(paths.values())),
        size=size,
        trained_numel=trained_numel,
        dtype=dtype,
        share=1.0 / dp_size,
        path_shares=shares,
    )
    for line in warnings:
        logger.warning("%s", line)
    if problems:
        raise ValueError("\n".join(problems))
