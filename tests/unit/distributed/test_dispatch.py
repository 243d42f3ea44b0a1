"""Dispatch modes: which ranks get what, and how results come back (no Ray)."""

import pytest
import torch

from roll_ds.distributed.batch import Batch
from roll_ds.distributed.dispatch import (
    Dispatch,
    DispatchSpec,
    collect,
    dispatch_spec,
    register,
    split_call,
)
from roll_ds.distributed.worker import Worker


class Toy(Worker):
    @register(Dispatch.DP)
    def score(self, batch: Batch, scale: float = 1.0) -> Batch:
        return Batch({"score_B": batch["x_B"] * scale + self.rank * 1000})

    @register(Dispatch.RANK0)
    def save(self) -> str:
        return "saved"

    @register(Dispatch.DP, even=True)
    def train(self, batch: Batch) -> None:
        return None

    def plain(self) -> int:
        return self.rank


def run(method: str, world_size: int, *args, **kwargs):
    """What Cluster does, minus Ray: split, call each rank's worker, collect."""
    spec = dispatch_spec(Toy, method)
    results = []
    for rank, a, kw in split_call(spec, world_size, args, kwargs):
        results.append(getattr(_Ranked(rank), method)(*a, **kw))
    return collect(spec, results)


class _Ranked(Toy):
    def __init__(self, rank: int) -> None:
        self._r = rank

    @property
    def rank(self) -> int:
        return self._r


def test_register_records_mode_and_default_is_all():
    assert dispatch_spec(Toy, "score") == DispatchSpec(Dispatch.DP)
    assert dispatch_spec(Toy, "train") == DispatchSpec(Dispatch.DP, even=True)
    assert dispatch_spec(Toy, "plain") == DispatchSpec(Dispatch.ALL)
    assert dispatch_spec(Toy, "init_process_group").mode is Dispatch.ALL
    with pytest.raises(AttributeError, match="no method 'nope'"):
        dispatch_spec(Toy, "nope")
    with pytest.raises(TypeError, match="Dispatch mode"):
        register("dp")


def test_all_and_rank0():
    assert run("plain", 3) == [0, 1, 2]
    calls = split_call(DispatchSpec(Dispatch.RANK0), 4, (1,), {"k": 2})
    assert calls == [(0, (1,), {"k": 2})]
    assert run("save", 4) == "saved"


def test_dp_round_trip_across_two_ranks():
    batch = Batch({"x_B": torch.arange(6.0)}, {"id": list("abcdef")}, {"step": 1})
    out = run("score", 2, batch, scale=2.0)
    assert out["score_B"].tolist() == [0.0, 2.0, 4.0, 1006.0, 1008.0, 1010.0]


def test_dp_splits_positional_and_keyword_batches_and_broadcasts_the_rest():
    b = Batch({"x_B": torch.arange(5)})
    calls = split_call(DispatchSpec(Dispatch.DP), 2, (b, "tag"), {"other": b, "n": 3})
    assert [r for r, _, _ in calls] == [0, 1]
    assert [len(a[0]) for _, a, _ in calls] == [3, 2]  # uneven: first rank one row more
    assert all(a[1] == "tag" and kw["n"] == 3 for _, a, kw in calls)
    assert [kw["other"]["x_B"].tolist() for _, _, kw in calls] == [[0, 1, 2], [3, 4]]


def test_dp_rejections_are_clear():
    with pytest.raises(TypeError, match="needs at least one Batch"):
        split_call(DispatchSpec(Dispatch.DP), 2, (1,), {})
    with pytest.raises(ValueError, match="differ in length"):
        split_call(
            DispatchSpec(Dispatch.DP),
            2,
            (Batch({"x": torch.zeros(4)}), Batch({"x": torch.zeros(6)})),
            {},
        )
    with pytest.raises(ValueError, match="into 4 chunks"):
        run("score", 4, Batch({"x_B": torch.zeros(3)}))
    with pytest.raises(ValueError, match="does not split evenly into 2"):
        run("train", 2, Batch({"x_B": torch.zeros(3)}))


def test_collect_dp_results():
    spec = DispatchSpec(Dispatch.DP)
    assert collect(spec, [None, None]) is None
    assert collect(spec, [{"loss": 1}, {"loss": 2}]) == [{"loss": 1}, {"loss": 2}]
