"""Weight-sync pieces without Ray, DeepSpeed or vLLM: the registry, the bucket wire format, the
rollout-dtype cast, the auto choice, the parity comparison, and the collective stream over a
real gloo group whose members are threads of this process (timeouts included)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from _members import run_members

torch = pytest.importorskip("torch")

from roll_ds.weight_sync import TRANSPORTS, check_transport_name  # noqa: E402
from roll_ds.weight_sync.base import (  # noqa: E402
    ALIGN,
    TransferError,
    bucket_nbytes,
    cast_buckets,
    layout,
    pack_bucket,
    transfer_dtype,
    unpack_bucket,
)
from roll_ds.weight_sync.collective import (  # noqa: E402
    BroadcastPlane,
    ReceiveStream,
    receive_into,
    send_stream,
)
from roll_ds.weight_sync.cuda_ipc import pair_by_gpu  # noqa: E402
from roll_ds.weight_sync.group import GroupSpec, TransferGroup, open_store  # noqa: E402
from roll_ds.weight_sync.object_store import decode_bucket  # noqa: E402
from roll_ds.weight_sync.parity import (  # noqa: E402
    WeightSyncParityError,
    compare,
    probe_batch,
    scored_mask,
)
from roll_ds.weight_sync.select import Endpoint, choose_transport  # noqa: E402


def sample_bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(5, 3, generator=g)
    return [
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: the same tensor under a second name
        ("model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(7, generator=g).half()),
        ("step", torch.tensor(41, dtype=torch.int64)),
    ]


# --- registry ---------------------------------------------------------------------------------


def test_registry_lists_the_transports_and_rejects_unknown_names():
    assert TRANSPORTS.names() == ["collective", "cuda_ipc", "object_store"]
    check_transport_name("auto")
    with pytest.raises(ValueError, match="valid: auto, collective, cuda_ipc, object_store"):
        check_transport_name("nccl")
    with pytest.raises(ValueError, match=r"unknown weight_sync\.transport 'rdma'"):
        TRANSPORTS.get("rdma")


def test_package_and_auto_choice_import_nothing_heavy():
    code = (
        "import sys, roll_ds.weight_sync, roll_ds.weight_sync.select\n"
        "print([m for m in ('torch', 'ray', 'deepspeed', 'vllm') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_transport_arguments_are_checked():
    cls = TRANSPORTS.get("object_store")
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        cls(bucket_bytes=0, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        cls(bucket_bytes=1, timeout_s=0)


# --- wire format ------------------------------------------------------------------------------


def test_layout_stores_an_alias_once_and_aligns_every_tensor():
    bucket = sample_bucket()
    metas, unique, size = layout(bucket)
    assert [m.name for m in metas] == [n for n, _ in bucket]
    assert metas[0].offset == metas[1].offset == 0  # the tied head is not sent twice
    assert len(unique) == 4
    assert all(m.offset % ALIGN == 0 for m in metas)
    assert [m.offset for m in metas] == [0, 0, 64, 80, 96]  # 60 B -> 64, 6 B -> 16, 14 B -> 16
    assert size == 112
    assert bucket_nbytes(bucket) == 60 + 6 + 14 + 8


def test_pack_then_unpack_round_trips_values_dtypes_shapes_and_aliases():
    bucket = sample_bucket()
    buffer, metas = pack_bucket(bucket)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 112
    out = unpack_bucket(buffer, metas)
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, got), (_, want) in zip(out, bucket, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    assert out[0][1] is out[1][1]  # the alias arrives as one tensor
    assert out[2][1].data_ptr() == buffer.data_ptr() + 64  # views, not copies


def test_pack_reuses_a_large_enough_output_buffer():
    out = torch.zeros(1024, dtype=torch.uint8)
    buffer, _ = pack_bucket(sample_bucket(), out=out)
    assert buffer.data_ptr() == out.data_ptr() and buffer.numel() == 112


def test_object_store_decoding_views_the_arrays():
    bucket = sample_bucket()
    metas, unique, _ = layout(bucket)
    arrays = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in unique]
    out = decode_bucket(metas, arrays)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(out, bucket, strict=True))
    assert out[0][1] is out[1][1]


# --- rollout dtype ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "rollout", "expected"),
    [
        (torch.float32, "bf16", torch.bfloat16),  # narrower: cast before sending
        (torch.float32, "fp16", torch.float16),
        (torch.bfloat16, "fp32", torch.bfloat16),  # wider: the receiver upcasts exactly
        (torch.float16, "bf16", torch.bfloat16),  # same width: cast to the engine's dtype
        (torch.float32, None, torch.float32),
        (torch.int64, "bf16", torch.int64),  # not floating: untouched
    ],
)
def test_transfer_dtype(dtype, rollout, expected):
    assert transfer_dtype(dtype, rollout) == expected


def test_cast_buckets_keeps_aliases_and_rejects_unknown_dtypes():
    (cast,) = cast_buckets([sample_bucket()], "bf16")
    assert cast[0][1].dtype == torch.bfloat16 and cast[0][1] is cast[1][1]
    assert cast[4][1].dtype == torch.int64
    with pytest.raises(ValueError, match="valid: fp32, bf16, fp16"):
        list(cast_buckets([sample_bucket()], "fp8"))


# --- transport choice -------------------------------------------------------------------------
# Endpoint fixtures: Ray GPU ids are per node (every node has a GPU "0"), UUIDs are global.


def gpu(g: int) -> str:
    return f"gpu-uuid-{g:02d}"


def train_ranks(gpus: range, per_node: int = 8) -> list[Endpoint]:
    """One actor_train rank per global GPU id."""
    return [Endpoint(f"node-{g // per_node}", (str(g % per_node),), (gpu(g),)) for g in gpus]


def engines(gpus: range, tp: int, per_node: int = 8) -> list[Endpoint]:
    """One rollout worker per ``tp`` consecutive GPUs; Ray reports only its first bundle's id,
    its processes see all ``tp`` (TP worker i on the i-th)."""
    out = []
    for first in list(gpus)[::tp]:
        node = f"node-{first // per_node}"
        out.append(
            Endpoint(node, (str(first % per_node),), tuple(gpu(first + i) for i in range(tp)))
        )
    return out


def choose(requested, senders, receivers, is_cuda=True):
    return choose_transport(requested, is_cuda=is_cuda, senders=senders, receivers=receivers)


def test_16_gpu_colocated_layout_reads_from_the_train_rank_on_each_gpu():
    """The shipped two-node example: actor_train and actor_infer on GPUs 0-15, TP=2 engines."""
    train, infer = train_ranks(range(16)), engines(range(16), tp=2)
    assert choose("auto", train, infer)[0] == "cuda_ipc"
    assert choose("cuda_ipc", train, infer)[0] == "cuda_ipc"
    with pytest.raises(ValueError, match=r"weight_sync\.transport=collective") as err:
        choose("collective", train, infer)  # engine 0's worker 0 sits on train rank 0's GPU
    assert "Duplicate GPU detected" in str(err.value) and "cuda_ipc" in str(err.value)
    # each vLLM worker is paired with the train rank on its own GPU: rank g -> engine g//2, TP g%2
    plan = pair_by_gpu(train, [list(e.uuids) for e in infer])
    assert plan == {g: [(g // 2, g % 2)] for g in range(16)}


def test_separate_gpus_use_nccl_and_refuse_cuda_ipc():
    train, infer = train_ranks(range(8)), engines(range(8, 16), tp=2)
    assert choose("auto", train, infer)[0] == "collective"
    with pytest.raises(ValueError, match=r"cuda_ipc: actor_infer rank 0 .*hold.* no actor_train"):
        choose("cuda_ipc", train, infer)
    with pytest.raises(ValueError, match=r"actor_infer rank 0 worker 0 \(GPU gpu-uuid-08\)"):
        pair_by_gpu(train, [list(e.uuids) for e in infer])


def test_partial_overlap_is_refused_by_auto_naming_both_sides():
    train, infer = train_ranks(range(8)), engines(range(4, 12), tp=2)  # engines 0-1 shared
    with pytest.raises(ValueError, match="transport=auto") as err:
        choose("auto", train, infer)
    text = str(err.value)
    assert "rank(s) [0, 1] share GPUs" in text and "actor_infer rank 2 (GPU gpu-uuid-08" in text
    assert "object_store" in text
    # rank 0's GPU (0) holds no receiver: an NCCL group from rank 0 is legal, if named
    assert choose("collective", train, infer)[0] == "collective"
    assert choose("object_store", train, infer)[0] == "object_store"
    with pytest.raises(ValueError, match="cuda_ipc"):
        choose("cuda_ipc", train, infer)


def test_collective_is_refused_only_where_a_receiver_shares_the_senders_gpu():
    train, infer = train_ranks(range(4)), engines(range(8), tp=2)
    with pytest.raises(
        ValueError, match=r"actor_infer rank\(s\) \[0\] use the GPU of actor_train rank 0"
    ):
        choose("collective", train, infer)


def test_same_ray_gpu_id_on_another_node_is_another_gpu():
    train = [Endpoint("node-a", ("0",), (gpu(0),))]
    infer = [Endpoint("node-b", ("0",), (gpu(8),))]
    assert choose("auto", train, infer)[0] == "collective"


def test_cpu_choice_and_cuda_ipc_needs_cuda():
    a, b = Endpoint("node-a"), Endpoint("node-b")
    assert choose("auto", [a], [a], is_cuda=False)[0] == "object_store"
    assert choose("auto", [a], [a, b], is_cuda=False)[0] == "collective"
    assert choose("collective", [a], [a], is_cuda=False)[0] == "collective"  # gloo shares CPUs
    with pytest.raises(ValueError, match="cuda_ipc needs CUDA"):
        choose("cuda_ipc", [a], [a], is_cuda=False)
    with pytest.raises(ValueError, match="valid: auto"):
        choose("ipc", [a], [a])


def test_config_validation_refuses_nccl_on_shared_gpus_before_any_actor_starts():
    from roll_ds.config import ConfigError, load_config

    example = "rlvr_qwen2.5_7b_lora_zero3_16gpu"
    load_config(example, ["device=cuda"], check_files=False)  # auto: cuda_ipc, no problem
    with pytest.raises(ConfigError, match=r"weight_sync\.transport=collective: actor_infer"):
        load_config(example, ["device=cuda", "weight_sync.transport=collective"], check_files=False)
    train_0_7 = ["device=cuda", "actor_train.device_mapping=0-7"]
    load_config(example, [*train_0_7, "actor_infer.device_mapping=8-15"], check_files=False)
    partial = [*train_0_7, "actor_infer.device_mapping=4-11"]
    with pytest.raises(ConfigError, match=r"transport=auto: actor_infer rank\(s\) \[0, 1\] share"):
        load_config(example, partial, check_files=False)
    # device auto: the ids may be CPU slots; build_transport checks by GPU UUID once placed
    load_config(example, ["weight_sync.transport=collective"], check_files=False)


def test_endpoint_from_cluster_info():
    info = {"node_id": "n1", "accelerator_ids": {"GPU": [3]}, "gpu_uuids": ["GPU-AB12", "cd34"]}
    endpoint = Endpoint.of(info)
    assert endpoint == Endpoint("n1", ("3",), ("ab12", "cd34"))
    assert endpoint.devices == ("ab12", "cd34")  # NVML's and torch's spellings agree
    assert Endpoint.of({"node_id": "n1", "accelerator_ids": {}}) == Endpoint("n1", ())
    # without UUIDs (a worker that could not read them): node-qualified Ray ids
    assert Endpoint("n1", ("3",)).devices == ("n1/gpu3",)


# --- parity -----------------------------------------------------------------------------------


def test_probe_batch_left_pads_and_masks_the_unscored_positions():
    probe = probe_batch([[5, 6, 7], [8, 9]], pad_id=0)
    assert probe["input_ids"].tolist() == [[5, 6, 7], [0, 8, 9]]
    assert probe["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert scored_mask(probe["attention_mask"]).tolist() == [[True, True], [False, True]]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        probe_batch([[1, 2], [3]], pad_id=0)


def test_compare_reports_max_and_mean_over_scored_positions_only():
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    trainer = torch.tensor([[-1.0, -2.0], [0.0, -3.0]])
    rollout = torch.tensor([[-1.0, -2.5], [9.0, -3.1]])  # 9.0 sits on a padded position
    metrics = compare(trainer, [rollout], mask, max_abs_diff=None)
    assert metrics["sync/parity_max_abs_diff"] == pytest.approx(0.5)
    assert metrics["sync/parity_mean_abs_diff"] == pytest.approx((0 + 0.5 + 0.1) / 3)
    assert metrics["sync/parity_tokens"] == 3


def test_compare_raises_above_the_threshold_naming_the_worst_worker():
    mask = torch.ones(1, 3, dtype=torch.long)
    trainer = torch.zeros(1, 2)
    same = torch.zeros(1, 2)
    stale = torch.tensor([[0.0, -0.2]])
    assert compare(trainer, [same, same], mask, max_abs_diff=0.0)["sync/parity_max_abs_diff"] == 0
    with pytest.raises(WeightSyncParityError, match=r"actor_infer rank 1's .* max \|delta\| 0.2"):
        compare(trainer, [same, stale], mask, max_abs_diff=1e-3)
    with pytest.raises(WeightSyncParityError):  # NaN never passes
        compare(trainer, [torch.full((1, 2), float("nan"))], mask, max_abs_diff=1.0)


def test_parity_error_names_the_sync_and_the_fix():
    mask = torch.ones(1, 3, dtype=torch.long)
    stale = torch.tensor([[0.0, -0.35]])
    with pytest.raises(
        WeightSyncParityError, match=r"26 tensors, trainer fp32.*parity_check=false"
    ):
        compare(
            torch.zeros(1, 2), [stale], mask, max_abs_diff=1e-3, what="26 tensors, trainer fp32"
        )


def test_a_deferred_parity_check_scores_the_trainer_now_and_compares_later():
    from types import SimpleNamespace

    from roll_ds.weight_sync.parity import defer_parity

    calls = []

    def submit(method, batch, **kwargs):
        calls.append((method, kwargs))
        return SimpleNamespace(get=lambda: {"logprobs": torch.zeros(1, 2)})

    trainer, infer = SimpleNamespace(submit=submit), SimpleNamespace(name="actor_infer")
    probe = {"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3)}
    pending = defer_parity(trainer, infer, probe, max_abs_diff=1e-3, what="2 tensors")
    assert calls == [("compute_logprobs", {"key": "logprobs", "temperature": 1.0})]
    metrics = pending.finish([torch.tensor([[0.0, 1e-4]])])
    assert metrics["sync/parity_max_abs_diff"] == pytest.approx(1e-4)
    with pytest.raises(WeightSyncParityError, match=r"actor_infer rank 0.*2 tensors"):
        pending.finish([torch.tensor([[0.0, -0.35]])])


def test_default_parity_bound_follows_the_coarsest_dtype():
    from roll_ds.weight_sync.parity import default_max_abs_diff

    assert default_max_abs_diff("fp32", "fp32") == 1e-3
    assert default_max_abs_diff("fp32", "bf16") == default_max_abs_diff("bf16") == 1.0
    assert default_max_abs_diff("fp16", "fp32") == 0.5
    # A failed fp32 sync measured here (tied lm_head left out) was off by 0.35.
    assert default_max_abs_diff("fp32") < 0.35
    with pytest.raises(ValueError, match="int8"):
        default_max_abs_diff("int8")


# --- the collective stream over a real gloo group (members are threads) -----------------------


def make_group(world: int, timeout_s: float = 10.0) -> dict[int, TransferGroup]:
    store, host, port = open_store(timeout_s)
    spec = GroupSpec(host, port, world, "gloo", timeout_s, prefix=f"test/{time.monotonic_ns()}")
    joined = run_members(
        {
            r: (lambda r=r: TransferGroup(spec, r, device="cpu", store=store if r == 0 else None))
            for r in range(world)
        }
    )
    assert all(isinstance(g, TransferGroup) for g in joined.values()), joined
    return joined


def test_stream_delivers_every_bucket_to_every_receiver():
    groups = make_group(3)
    buckets = [sample_bucket(), [("model.norm.bias", torch.arange(6.0))]]

    def receive(rank):
        stream = ReceiveStream(groups[rank], BroadcastPlane())
        got = receive_into(list, stream)
        return got, stream.stats()

    out = run_members(
        {0: lambda: send_stream(groups[0], iter(buckets), BroadcastPlane())}
        | {r: (lambda r=r: receive(r)) for r in (1, 2)}
    )
    sent = out[0]
    assert sent["buckets"] == 2 and sent["num_tensors"] == 6 and sent["bytes"] == 88 + 24
    expected = [item for b in buckets for item in b]
    for r in (1, 2):
        got, stats = out[r]
        assert [n for n, _ in got] == [n for n, _ in expected]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))
        assert got[0][1] is got[1][1]
        assert stats == {"received_buckets": 2, "received_bytes": 112 + 32}
    for g in groups.values():
        g.close()


def test_a_loader_failing_half_way_drains_the_stream_and_its_error_surfaces():
    groups = make_group(2)
    buckets = [sample_bucket(), sample_bucket(), sample_bucket()]

    def failing_loader(named):
        next(iter(named))
        raise KeyError("model has no parameter 'x'")

    def receive():
        stream = ReceiveStream(groups[1], BroadcastPlane())
        with pytest.raises(KeyError, match="no parameter"):
            receive_into(failing_loader, stream)
        return stream.stats()

    out = run_members(
        {0: lambda: send_stream(groups[0], iter(buckets), BroadcastPlane()), 1: receive}
    )
    assert out[0]["buckets"] == 3  # the sender finished: nothing hangs
    assert out[1] == {"received_buckets": 3, "received_bytes": 3 * 112}


def test_a_receiver_without_sender_times_out_naming_itself():
    groups = make_group(2, timeout_s=1.0)
    start = time.perf_counter()
    stream = ReceiveStream(groups[1], BroadcastPlane())
    with pytest.raises(TransferError, match=r"rank 1/2: header of bucket 0 failed or timed out"):
        receive_into(list, stream)
    assert time.perf_counter() - start < 5
    assert stream.failed


def test_joining_a_group_nobody_else_joins_times_out():
    store, host, port = open_store(1.0)
    spec = GroupSpec(host, port, 2, "gloo", 1.0, prefix="test/alone")
    start = time.perf_counter()
    with pytest.raises(
        TransferError, match=r"\(rank 0 of 2\): rank\(s\) \[1\] did not join within 1 s"
    ):
        TransferGroup(spec, 0, device="cpu", store=store)
    assert time.perf_counter() - start < 10
