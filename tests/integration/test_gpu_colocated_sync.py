"""Colocated weight sync and tensor-parallel vLLM on GPUs (``bash scripts/test.sh -m gpu``).

- one GPU: actor_train and actor_infer share GPU 0; ``transport: auto`` picks ``cuda_ipc``,
  refuses ``collective`` (NCCL would put two ranks on one GPU), and the synced engine's log-probs
  match the trainer's;
- one GPU, no Ray or vLLM: the CUDA IPC plane between two processes, two buckets (the second
  larger, so the send buffer is re-exported), received bit for bit;
- one GPU: after a cuda_ipc and an object_store sync the vLLM worker's reserved GPU memory is
  back to its level before the sync;
- one GPU, object_store: the whole model crosses vLLM's process boundary (collective_rpc into
  the engine core's worker) as byte chunks (``wire.WIRE_CHUNK_BYTES``), with parity;
- two GPUs: the 16-GPU example in miniature. Two ZeRO-3 train ranks and one TP=2 vLLM engine on
  GPUs 0-1, in the rollout actor (vLLM's ``mp`` executor inside a placement group); each TP
  worker reads the buckets of the train rank on its own GPU by CUDA IPC (two groups, paired by
  GPU UUID), then generates with the synced weights.

Without CUDA (or with one GPU for the second test) they skip with the reason.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.gpu]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _gpu import NEEDS_VLLM, TWO_GPUS  # noqa: E402

PARITY_MAX = 2e-3  # fp32 trainer vs fp32 vLLM on the probe (GPU kernels differ from CPU's)
VOCAB = 128
ENGINE = {"enforce_eager": True, "gpu_memory_utilization": 0.25, "max_num_seqs": 8}


def nll_loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


def start_roles(model_dir: str, gpus: tuple[int, ...], tp: int, stage: int):
    """Ray on this machine's GPUs, actor_train (one rank per GPU) and actor_infer (one engine
    per ``tp`` GPUs) both on ``gpus``, initialized and trained one step."""
    import ray
    from _train_helpers import preset
    from ray import cloudpickle

    from roll_ds.config.schema import ModelArgs, StrategyArgs, TrainingArgs, WorkerConfig
    from roll_ds.distributed.batch import Batch
    from roll_ds.distributed.cluster import Cluster
    from roll_ds.distributed.placement import RoleSpec
    from roll_ds.distributed.ray_init import connect
    from roll_ds.distributed.resource_manager import ResourceManager
    from roll_ds.pipeline.workers import ActorTrainWorker, RolloutWorker
    from roll_ds.strategy import StrategyContext

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.pop("RAY_ADDRESS", None)
    connect(num_cpus=2 * len(gpus) + 2, num_gpus=len(gpus), log_to_driver=False)
    manager = ResourceManager(
        {
            "actor_train": RoleSpec(gpus, len(gpus)),
            "actor_infer": RoleSpec(gpus, len(gpus) // tp, tp),
        },
        num_gpus_per_node=len(gpus),
        device_resource="GPU",
    ).reserve()
    ctx = StrategyContext(pretrain=model_dir, seed=0, max_steps=10, response_length=8)
    ds = preset(stage, stage3_param_persistence_threshold=0) if stage == 3 else preset(stage)
    train_role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="deepspeed_train", strategy_config=ds),
        model_args=ModelArgs(dtype="fp32"),
        training_args=TrainingArgs(
            learning_rate=2e-2, per_device_train_batch_size=2, gradient_accumulation_steps=1
        ),
        infer_batch_size=4,
    )
    infer_role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="vllm", strategy_config=dict(ENGINE)),
        model_args=ModelArgs(dtype="fp32"),
        num_gpus_per_worker=tp,
    )
    train = Cluster("actor_train", ActorTrainWorker, manager, init_args=(train_role, ctx))
    infer = Cluster("actor_infer", RolloutWorker, manager, init_args=(infer_role, ctx))
    train.initialize(_timeout_s=600)
    infer.initialize(_timeout_s=600)  # after the trainer: vLLM profiles the memory left
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2 * len(gpus), 16), generator=g)
    train.train_step(Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), nll_loss)

    def stop() -> None:
        train.shutdown()
        infer.shutdown()
        manager.release()
        ray.shutdown()

    return train, infer, stop


def sync_and_check(train, infer, expected_groups: int) -> dict[str, float]:
    from roll_ds.config.schema import WeightSyncConfig
    from roll_ds.weight_sync.parity import WeightSyncParityError, check_parity, random_probe
    from roll_ds.weight_sync.select import build_transport

    probe = random_probe(VOCAB, size=4, length=24, seed=3)
    with pytest.raises(WeightSyncParityError):  # the engine still serves the old weights
        check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
    with pytest.raises(ValueError, match="Duplicate GPU detected"):
        build_transport(WeightSyncConfig(transport="collective"), train, infer, rollout_dtype=None)
    transport = build_transport(WeightSyncConfig(), train, infer, rollout_dtype="fp32")
    try:
        assert transport.name == "cuda_ipc"
        assert len(transport.groups) == expected_groups  # one group per shared GPU
        metrics = transport.sync(train, infer)
        parity = check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
        # the IPC send buffer (as large as the largest bucket) does not outlive the sync
        held = train.execute(lambda w: w.weight_sender.member.plane.buffer)
        assert all(b is None for b in held), "a train rank still holds its cuda_ipc buffer"
    finally:
        transport.close(train, infer)
    print(f"\ncuda_ipc sync: {metrics} parity: {parity}")
    return metrics


@NEEDS_VLLM
def test_colocated_cuda_ipc_sync_on_one_gpu(tiny_qwen2_dir):
    train, infer, stop = start_roles(tiny_qwen2_dir, (0,), tp=1, stage=2)
    try:
        metrics = sync_and_check(train, infer, expected_groups=1)
        assert metrics["sync/bytes"] > 1e6
    finally:
        stop()


@NEEDS_VLLM
def test_object_store_sync_crosses_vllms_process_boundary_on_a_gpu(tiny_qwen2_dir):
    """object_store (allowed on GPUs): the whole model reaches the engine core's worker through
    collective_rpc, i.e. vLLM's msgpack serializer (roll_ds.weight_sync.wire)."""
    from roll_ds.distributed.batch import Batch
    from roll_ds.weight_sync import TRANSPORTS
    from roll_ds.weight_sync.parity import WeightSyncParityError, check_parity, random_probe

    train, infer, stop = start_roles(tiny_qwen2_dir, (0,), tp=1, stage=3)
    try:
        assert infer.execute(lambda w: w.strategy._in_process) == [False]  # engine core apart
        probe = random_probe(VOCAB, size=4, length=24, seed=3)
        with pytest.raises(WeightSyncParityError):
            check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
        transport = TRANSPORTS.get("object_store")(bucket_bytes=256 * 1024, timeout_s=120)
        metrics = transport.sync(train, infer)
        parity = check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
        assert metrics["sync/bytes"] > 1e6
        batch = Batch(non_tensors={"prompt_ids": [[3, 5, 7, 9]], "row": [0]})
        out = infer.generate(batch, seed=7, n=2, max_new_tokens=6, ignore_eos=True)
        assert [len(r) for r in out["response_ids"]] == [6, 6]
        print(f"\nobject_store sync on a GPU: {metrics} parity: {parity}")
    finally:
        stop()


MIB = 2**20
# a Qwen2 whose embedding (fp32, tied) is 64 MiB: a sync's transient GPU buffers in the vLLM
# worker (the copy out of the CUDA IPC buffer, the reload's materialised layer) are that large
MID_QWEN2 = dict(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
RESERVED_SLACK = 8 * MIB  # a few of the caching allocator's 2 MiB segments


@pytest.fixture(scope="module")
def mid_qwen2_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MID_QWEN2, torch_dtype="float32"))
    path = tmp_path_factory.mktemp("mid_qwen2")
    model.save_pretrained(path)
    return str(path)


@NEEDS_VLLM
def test_a_sync_leaves_the_vllm_workers_reserved_memory_where_it_was(mid_qwen2_dir):
    """What a sync allocates in the vLLM worker lies outside vLLM's memory budget; after the
    sync the worker's torch allocator holds no more GPU memory than before it (the worker
    extension empties the CUDA cache), for a group transport (cuda_ipc) and object_store."""
    from roll_ds.config.schema import WeightSyncConfig
    from roll_ds.weight_sync.select import build_transport

    train, infer, stop = start_roles(mid_qwen2_dir, (0,), tp=1, stage=3)

    def reserved() -> int:
        memory = infer.execute(lambda w: w.strategy.llm.collective_rpc("roll_ds_device_memory"))
        return memory[0][0]["reserved"]

    try:
        for name in ("cuda_ipc", "object_store"):
            cfg = WeightSyncConfig(transport=name)
            transport = build_transport(cfg, train, infer, rollout_dtype="fp32")
            try:
                before = reserved()
                metrics = transport.sync(train, infer)
                after = reserved()
            finally:
                transport.close(train, infer)
            print(f"\n{name}: vLLM worker reserved {before / MIB:.0f} -> {after / MIB:.0f} MiB")
            assert metrics["sync/bytes"] > 64 * MIB
            assert after <= before + RESERVED_SLACK, (name, before, after)
    finally:
        stop()


@NEEDS_VLLM
@TWO_GPUS
def test_tp2_engine_takes_each_shard_from_the_train_rank_on_its_gpu(tiny_qwen2_dir):
    from roll_ds.distributed.batch import Batch

    train, infer, stop = start_roles(tiny_qwen2_dir, (0, 1), tp=2, stage=3)
    try:
        uuids = infer.execute(lambda w: w.strategy.transfer_group_devices())[0]
        assert len(set(uuids)) == 2  # TP worker i on the i-th visible GPU, two distinct GPUs
        sync_and_check(train, infer, expected_groups=2)
        batch = Batch(non_tensors={"prompt_ids": [[3, 5, 7, 9]], "row": [0]})
        out = infer.generate(batch, seed=7, n=2, max_new_tokens=6, ignore_eos=True)
        assert [len(r) for r in out["response_ids"]] == [6, 6]
    finally:
        stop()


def _ipc_member() -> bool:
    """One of two processes sharing GPU 0: rank 0 sends two buckets by CUDA IPC (the second one
    larger, so the buffer is re-exported), rank 1 receives and checks them."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from roll_ds.weight_sync.collective import (
        GroupSpec,
        ReceiveStream,
        TransferGroup,
        receive_into,
        send_stream,
    )
    from roll_ds.weight_sync.cuda_ipc import IpcPlane

    rank, host, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    torch.cuda.set_device(0)
    spec = GroupSpec(host, int(port), 2, "gloo", 60.0, prefix="test/cuda_ipc")
    store = TCPStore(host, int(port), None, rank == 0, timedelta(seconds=60))
    group = TransferGroup(spec, rank, device="cuda:0", store=store)
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=g).cuda()
    buckets = [
        [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)],
        [("model.norm.weight", torch.randn(4096, generator=g).cuda().bfloat16())],
    ]
    if rank == 0:
        return send_stream(group, iter(buckets), IpcPlane())["buckets"] == 2
    got = receive_into(
        lambda named: [(n, t.cpu()) for n, t in named], ReceiveStream(group, IpcPlane())
    )
    want = [(n, t.cpu()) for b in buckets for n, t in b]
    return [n for n, _ in got] == [n for n, _ in want] and all(
        torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True)
    )


def test_cuda_ipc_moves_buckets_between_processes_on_one_gpu():
    from _dist import run_distributed

    assert run_distributed(_ipc_member, world_size=2, timeout_s=120) == [True, True]
