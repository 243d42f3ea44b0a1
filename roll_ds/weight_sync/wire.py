"""Plain data for vLLM's process boundary: what crosses ``collective_rpc`` into the engine
workers, and how the worker side rebuilds it.

On GPU (and on CPU with ``ROLL_DS_VLLM_MULTIPROC=1``) vLLM's engine core is a separate process:
``collective_rpc`` arguments go through vLLM's ``MsgpackEncoder`` and are decoded *untyped* by
the engine core (``EngineCore._convert_msgspec_args`` restores only ``msgspec.Struct``). What
arrives is therefore msgpack's own types, whatever was sent:

    a dataclass (``GroupSpec``)   a dict of its fields
    a tuple                       a list
    a torch tensor                ``[dtype, shape, data]``: ``data`` the bytes when small, else
                                  the *index* of a side frame the untyped decode drops

So everything roll_ds sends is converted here to dicts, lists, str, int, float, bool, None and
byte strings, and the worker extension rebuilds the typed objects from it. The same functions
serve the in-process engine, so one path is tested on CPU either way.

Weights cross as byte chunks of at most ``WIRE_CHUNK_BYTES``: msgspec refuses a byte string of
2**32 bytes or more inside a message (``Can't encode bytes-like objects longer than 2**32 - 1``),
and a whole bf16 model of ~2.1B parameters or more is that long. A chunk is a zero-copy view of
one tensor's host bytes (a tensor longer than the limit is split over several chunks), so the
sending side copies the model once, into vLLM's message frame, and the receiving side once more,
out of it (``bytes`` per chunk); the tensors it rebuilds view those bytes, except a tensor split
over several chunks, which is joined (a copy of that tensor alone).

Light: importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import _flat_bytes
from roll_ds.weight_sync.group import GroupSpec

if TYPE_CHECKING:
    import torch

    from roll_ds.weight_sync.base import Bucket
    from roll_ds.weight_sync.endpoint import Seat

# msgspec's limit on one byte string inside a message (msgpack's bin 32)
MSGPACK_BIN_MAX = 2**32 - 1
# The largest chunk of weight bytes one byte string carries across vLLM's serializer: well under
# MSGPACK_BIN_MAX, and under 2**31 for any reader that takes lengths as signed 32-bit.
WIRE_CHUNK_BYTES = 1 << 30


def seats_to_wire(seats: Sequence[Seat]) -> list[dict[str, Any]]:
    """``(GroupSpec, rank)`` seats as ``{"spec": {...}, "rank": int}``."""
    return [{"spec": dataclasses.asdict(spec), "rank": int(rank)} for spec, rank in seats]


def seat_from_wire(seat: Mapping[str, Any]) -> Seat:
    """One seat as the worker extension received it, typed again."""
    spec = dict(seat["spec"])
    fields = {f.name for f in dataclasses.fields(GroupSpec)}
    if set(spec) != fields:
        raise ValueError(
            f"weight-sync seat: group spec fields {sorted(spec)} are not GroupSpec's "
            f"{sorted(fields)} (the trainer and the vLLM workers run different roll_ds code?)"
        )
    return GroupSpec(**spec), int(seat["rank"])


def adapter_to_wire(directory: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Where worker 0 writes a synced adapter and its ``adapter_config.json`` content."""
    return {"directory": str(directory), "config": dict(config)}


def tensors_to_wire(
    named_tensors: Iterable[tuple[str, Any]], chunk_bytes: int | None = None
) -> dict[str, Any]:
    """``(name, tensor)`` pairs (a whole model for one reload) as plain data::

        {"tensors": [{"dtype", "shape", "chunks": [first, stop]}, ...],  # distinct tensors
         "names": [[name, tensor index], ...],
         "chunks": [byte string, ...]}                    # each <= chunk_bytes

    ``chunk_bytes`` defaults to ``WIRE_CHUNK_BYTES``. A tensor sent under two names (a tied head)
    crosses once. A chunk views the tensor's bytes where they are already contiguous in host
    memory (a ``memoryview``, no copy; the caller's tensors must stay unchanged until the
    payload is sent); other tensors (on a GPU, non-contiguous) are copied to host memory first,
    one at a time."""
    limit = WIRE_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
    if not 0 < limit <= MSGPACK_BIN_MAX:
        raise ValueError(f"chunk_bytes must be in 1..{MSGPACK_BIN_MAX}, got {limit}")
    tensors: list[dict[str, Any]] = []
    names: list[list[Any]] = []
    chunks: list[memoryview] = []
    index: dict[int, int] = {}  # id(tensor) -> its entry in `tensors`
    seen: list[Any] = []  # every tensor met stays alive, so that no id is reused meanwhile
    for name, tensor in named_tensors:
        if id(tensor) not in index:
            index[id(tensor)] = len(tensors)
            seen.append(tensor)
            first = len(chunks)
            chunks.extend(_host_chunks(tensor, limit))
            dtype = str(tensor.dtype).removeprefix("torch.")
            tensors.append(
                {"dtype": dtype, "shape": list(tensor.shape), "chunks": [first, len(chunks)]}
            )
        names.append([name, index[id(tensor)]])
    return {"tensors": tensors, "names": names, "chunks": chunks}


def wire_nbytes(payload: Mapping[str, Any]) -> int:
    """The weight bytes a ``tensors_to_wire`` payload carries."""
    return sum(len(memoryview(c)) for c in payload["chunks"])


def _host_chunks(tensor: Any, limit: int) -> list[memoryview]:
    """``tensor``'s bytes in host memory as views of at most ``limit`` bytes each."""
    flat = _flat_bytes(tensor)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    data = memoryview(flat.numpy())
    return [data[i : i + limit] for i in range(0, len(data), limit)]


def tensors_from_wire(payload: Mapping[str, Any]) -> Bucket:
    """The ``(name, tensor)`` pairs of ``tensors_to_wire``'s payload: views of the received
    chunks (read-only; the loader only reads them), a tensor split over several chunks joined
    into one buffer of its own. Names of one tensor share the tensor object."""
    chunks = payload["chunks"]
    for chunk in chunks:
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise TypeError(
                f"weight payload: a chunk arrived as {type(chunk).__name__}, not bytes (a "
                "tensor sent through vLLM's serializer arrives as an untyped list; send "
                "tensors_to_wire)"
            )
    built = [_from_chunks(t, chunks[slice(*t["chunks"])]) for t in payload["tensors"]]
    return [(name, built[i]) for name, i in payload["names"]]


def _from_chunks(entry: Mapping[str, Any], chunks: Sequence[Any]) -> torch.Tensor:
    import torch

    dtype, shape = getattr(torch, entry["dtype"]), tuple(entry["shape"])
    if not chunks:  # no elements
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # msgpack's bytes are read-only; the loader only reads
        warnings.filterwarnings("ignore", message=".*not writable.*")
        pieces = [torch.frombuffer(c, dtype=torch.uint8) for c in chunks]
    raw = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return raw.view(dtype).view(shape)
