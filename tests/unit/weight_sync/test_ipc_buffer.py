"""The cuda_ipc data plane's buffer lifetime, on CPU: the plane's GPU calls are its hooks, here
replaced by host-memory ones, and a real gloo group (threads) carries the protocol.

The send buffer grows to the sync's largest bucket; it must not outlive the sync, or the
trainer's offload / ``empty_cache`` could not return it before vLLM wakes its KV cache (a 7B
embedding alone is ~1 GB).
"""

from __future__ import annotations

from typing import Any

import pytest
from _members import run_members

torch = pytest.importorskip("torch")

from roll_ds.weight_sync.collective import ReceiveStream, receive_into, send_stream  # noqa: E402
from roll_ds.weight_sync.cuda_ipc import IpcPlane  # noqa: E402
from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store  # noqa: E402

SHARED: dict[tuple, torch.Tensor] = {}  # "IPC handle" -> the sender's buffer (one process)


class HostIpcPlane(IpcPlane):
    """IpcPlane with host memory in place of CUDA: a handle names a buffer in ``SHARED``."""

    collected = 0

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, tuple, str]:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        handle = ("host", id(buffer), nbytes)
        SHARED[handle] = buffer
        return buffer, handle, "GPU-host"

    def _synchronize(self, buffer: torch.Tensor) -> None:
        pass

    def _map(self, handle: tuple, uuid: str) -> torch.Tensor:
        return SHARED[handle]

    def _copy(self, mapped: torch.Tensor, nbytes: int) -> torch.Tensor:
        return mapped[:nbytes].clone()

    def _collect(self) -> None:
        HostIpcPlane.collected += 1


def sync_buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 16, generator=g)  # the largest bucket: 4 KB
    return [
        [("model.norm.weight", torch.randn(16, generator=g))],
        [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)],
        [("model.layers.0.mlp.up_proj.weight", torch.randn(8, 16, generator=g))],
    ]


def one_sync(planes: list[HostIpcPlane], receivers: int) -> dict[int, Any]:
    store, host, port = open_store(10.0)
    spec = GroupSpec(host, port, 1 + receivers, "gloo", 10.0, prefix="test/ipc")

    def sender():
        group = TransferGroup(spec, 0, device="cpu", store=store)
        try:
            stats = send_stream(group, iter(sync_buckets()), planes[0])
            return stats, planes[0].buffer
        finally:
            group.close()

    def receiver(rank: int):
        def run():
            group = TransferGroup(spec, rank, device="cpu")
            try:
                got = receive_into(
                    lambda named: [(n, t.clone()) for n, t in named],
                    ReceiveStream(group, planes[rank]),
                )
                return got, planes[rank]._mapped
            finally:
                group.close()

        return run

    return run_members({0: sender, **{r: receiver(r) for r in range(1, 1 + receivers)}})


def test_the_send_buffer_and_the_mappings_are_released_after_each_sync():
    planes = [HostIpcPlane() for _ in range(3)]
    for _ in range(2):  # a second sync exports a fresh buffer and releases it again
        results = one_sync(planes, receivers=2)
        errors = {r: v for r, v in results.items() if isinstance(v, BaseException)}
        assert not errors, errors
        (stats, held) = results[0]
        assert stats["buckets"] == 3
        assert held is None, f"the sender still holds a {held.numel()} B buffer after the sync"
        assert planes[0].handle is None
        want = [(n, t) for b in sync_buckets() for n, t in b]
        for rank in (1, 2):
            got, mapping = results[rank]
            assert mapping is None, "a receiver still maps the sender's buffer after the sync"
            assert [n for n, _ in got] == [n for n, _ in want]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
    assert planes[0].peak_bytes == 64 * 16 * 4  # the largest bucket (the alias laid out once)
