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
``bytes`` (weights as one flat byte buffer per bucket, laid out like every transport's buckets:
``base.layout``), and the worker extension rebuilds the typed objects from it. The same
functions serve the in-process engine, so one path is tested on CPU either way.

Light: importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from roll_ds.weight_sync.base import TensorMeta, pack_bucket, unpack_bucket
from roll_ds.weight_sync.group import GroupSpec

if TYPE_CHECKING:
    from roll_ds.weight_sync.base import Bucket
    from roll_ds.weight_sync.endpoint import Seat


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


def tensors_to_wire(named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``(name, tensor)`` pairs (a whole model for one reload) as one bucket of plain data:
    ``{"metas": [{name, dtype, shape, offset, nbytes}, ...], "data": bytes}``. A tensor sent
    under two names (a tied head) is laid out once. Tensors are copied to host memory."""
    bucket: Bucket = list(named_tensors)
    buffer, metas = pack_bucket(bucket, device="cpu")
    return {
        "metas": [dataclasses.asdict(m) | {"shape": list(m.shape)} for m in metas],
        "data": buffer.numpy().tobytes(),
    }


def tensors_from_wire(payload: Mapping[str, Any]) -> Bucket:
    """The ``(name, tensor)`` pairs of ``tensors_to_wire``'s payload: views into one buffer over
    the received bytes (read-only; the loader only reads them)."""
    import torch

    metas = [
        TensorMeta(m["name"], m["dtype"], tuple(m["shape"]), m["offset"], m["nbytes"])
        for m in payload["metas"]
    ]
    data = payload["data"]
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(
            f"weight payload: 'data' arrived as {type(data).__name__}, not bytes (a tensor "
            "sent through vLLM's serializer arrives as an untyped list; send tensors_to_wire)"
        )
    if len(data) == 0:
        return unpack_bucket(torch.empty(0, dtype=torch.uint8), metas)
    with warnings.catch_warnings():  # msgpack's bytes are read-only
        warnings.filterwarnings("ignore", message=".*not writable.*")
        buffer = torch.frombuffer(data, dtype=torch.uint8)
    return unpack_bucket(buffer, metas)
