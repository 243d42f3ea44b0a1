"""Batch: columns stay aligned through chunk/split/concat/select/index; bad inputs say why."""

import numpy as np
import pytest
import torch

from roll_ds.distributed.batch import Batch


def make(n: int = 10) -> Batch:
    return Batch(
        {
            "ids_BT": torch.arange(n * 3).reshape(n, 3),
            "reward_B": torch.arange(n, dtype=torch.float32),
        },
        {"prompt": [f"p{i}" for i in range(n)], "tokens": [[i, i + 1] for i in range(n)]},
        {"step": 7},
    )


def test_len_keys_and_column_access():
    b = make()
    assert len(b) == 10
    assert b.keys() == ["ids_BT", "reward_B", "prompt", "tokens"]
    assert b["prompt"][3] == "p3"
    # list-valued rows stay one object per row, not broadcast into a 2-d array
    assert b["tokens"].shape == (10,) and b["tokens"][4] == [4, 5]
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]


def test_columns_must_agree_in_length():
    with pytest.raises(ValueError, match="differ in length"):
        Batch({"a": torch.zeros(3)}, {"b": [1, 2]})
    with pytest.raises(ValueError, match="batch dimension"):
        Batch({"a": torch.tensor(1.0)})


@pytest.mark.parametrize(
    ("n", "chunks", "sizes"), [(10, 2, [5, 5]), (10, 3, [4, 3, 3]), (7, 7, [1] * 7)]
)
def test_chunk_sizes_and_round_trip(n, chunks, sizes):
    b = make(n)
    parts = b.chunk(chunks)
    assert [len(p) for p in parts] == sizes
    assert all(p.meta == {"step": 7} for p in parts)
    assert Batch.concat(parts).equals(b)


def test_uneven_chunks_keep_row_order():
    parts = make(5).chunk(2)
    assert parts[0]["prompt"].tolist() == ["p0", "p1", "p2"]
    assert parts[1]["reward_B"].tolist() == [3.0, 4.0]


def test_chunk_rejects_empty_ranks_and_uneven_when_even_required():
    with pytest.raises(
        ValueError, match="cannot split a batch of 3 rows into 4 chunks: 1 would be empty"
    ):
        make(3).chunk(4)
    with pytest.raises(ValueError, match="does not split evenly into 3 chunks"):
        make(10).chunk(3, even=True)


def test_split_by_size_and_sizes():
    assert [len(p) for p in make(10).split(4)] == [4, 4, 2]
    assert [len(p) for p in make(10).split([1, 9])] == [1, 9]
    with pytest.raises(ValueError, match="do not add up"):
        make(10).split([3, 3])


def test_index_forms():
    b = make()
    assert b.index(2)["prompt"].tolist() == ["p2"]
    assert b[-1]["reward_B"].tolist() == [9.0]
    assert b[1:3]["prompt"].tolist() == ["p1", "p2"]
    picked = b.index([4, 0])
    assert picked["prompt"].tolist() == ["p4", "p0"]
    assert torch.equal(picked["ids_BT"], b["ids_BT"][[4, 0]])
    assert b.index(torch.tensor([1, 1]))["prompt"].tolist() == ["p1", "p1"]
    mask = np.arange(10) % 2 == 0
    assert b.index(mask)["prompt"].tolist() == ["p0", "p2", "p4", "p6", "p8"]
    with pytest.raises(IndexError):
        b.index(10)


def test_select_and_union():
    b = make()
    s = b.select("reward_B", "prompt")
    assert s.keys() == ["reward_B", "prompt"] and s.meta == {"step": 7}
    assert b.select("prompt", meta=False).meta == {}
    with pytest.raises(KeyError, match=r"no column\(s\) \['x'\]"):
        b.select("x")
    extra = Batch({"adv_B": torch.ones(10)}, meta={"kl": 0.1})
    u = b.union(extra)
    assert "adv_B" in u and u.meta == {"step": 7, "kl": 0.1}


def test_concat_checks_columns_and_merges_meta():
    a, b = make(2), make(3)
    b.meta["extra"] = 1
    out = Batch.concat([a, b])
    assert len(out) == 5 and out.meta == {"step": 7, "extra": 1}
    with pytest.raises(ValueError, match="batch 1 has columns"):
        Batch.concat([a, a.select("prompt")])
    with pytest.raises(ValueError, match="no batches"):
        Batch.concat([])


def test_pickles_for_ray():
    import pickle

    b = make()
    assert pickle.loads(pickle.dumps(b)).equals(b)


def test_pickled_tensors_travel_as_arrays_with_their_bits():
    """A rank's share pickles only its rows (as arrays, not torch.save of the whole storage);
    every dtype comes back with the same bits, writable; a tensor in autograd stays a tensor."""
    import pickle

    torch.manual_seed(0)
    n = 64
    b = Batch(
        {
            "f32": torch.randn(n, 5),
            "bf16": torch.randn(n, 3).bfloat16(),
            "f16": torch.randn(n, 2).half(),
            "i64": torch.randint(0, 99, (n, 4)),
            "flag": torch.rand(n) > 0.5,
            "grad": torch.randn(n, requires_grad=True),
        },
        {"prompt": [f"p{i}" for i in range(n)]},
        {"step": 3},
    )
    share = b.chunk(2)[1]
    data = pickle.dumps(share)
    assert len(data) < 0.75 * len(pickle.dumps(dict(share.tensors)))  # torch's: every storage
    back = pickle.loads(data)
    assert back.tensors.keys() == share.tensors.keys()
    for key, t in share.tensors.items():
        got = back.tensors[key]
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert torch.equal(got.detach(), t.detach()), key
    assert back["grad"].requires_grad
    assert list(back["prompt"]) == [f"p{i}" for i in range(32, 64)] and back.meta == {"step": 3}
    back.tensors["f32"] += 1  # the receiver owns its tensors
