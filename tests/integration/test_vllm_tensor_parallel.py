"""A tensor-parallel (TP=2) vLLM-CPU engine inside the real rollout actor, placed like a GPU run.

The rollout worker gets two CPU slots of a placement group (``num_gpus_per_worker: 2``), so vLLM
finds itself inside a placement group, exactly where it would otherwise pick its Ray executor
and wait for bundles the placement already holds. The strategy names the ``mp`` executor: the two
TP workers are child processes of the actor. Then a one-rank ZeRO-2 trainer syncs its trained
weights into both TP workers (the collective transport: each TP worker is a member of the group
and reloads its shard), and the engine's log-probs must match the trainer's on a probe batch.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from ray import cloudpickle  # noqa: E402

from roll_ds.config.schema import (  # noqa: E402
    ModelArgs,
    StrategyArgs,
    TrainingArgs,
    WorkerConfig,
)
from roll_ds.distributed.batch import Batch  # noqa: E402
from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.ray_init import connect  # noqa: E402
from roll_ds.distributed.resource_manager import ResourceManager  # noqa: E402
from roll_ds.pipeline.workers import ActorTrainWorker, RolloutWorker  # noqa: E402
from roll_ds.platform import VLLM_MULTIPROC_ENV  # noqa: E402
from roll_ds.strategy import StrategyContext  # noqa: E402
from roll_ds.weight_sync import TRANSPORTS  # noqa: E402
from roll_ds.weight_sync.parity import WeightSyncParityError, check_parity, random_probe  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # nll_loss travels to the trainer

VOCAB = 128
PARITY_MAX = 1e-3  # fp32 trainer vs fp32 TP=2 engine; measured ~1e-5
ENGINE = {"enforce_eager": True, "block_size": 32, "max_num_seqs": 8}


def nll_loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


@pytest.fixture(scope="module")
def resources():
    saved = os.environ.pop("RAY_ADDRESS", None)
    connect(num_cpus=3, log_to_driver=False)
    manager = ResourceManager(
        {"actor_train": RoleSpec((0,), 1), "actor_infer": RoleSpec((1, 2), 1, 2)},
        num_gpus_per_node=3,
        device_resource="CPU",
        ready_timeout_s=60,
    ).reserve()
    yield manager
    manager.release()
    ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


@pytest.mark.parametrize("multiproc", [False, True], ids=["in_process_core", "multiproc"])
def test_tp2_engine_in_the_rollout_actor_generates_and_takes_a_synced_model(
    resources, tiny_qwen2_dir, multiproc
):
    """``multiproc``: the engine core in a process of its own (ROLL_DS_VLLM_MULTIPROC=1, as on
    GPU), so the seats and the weights cross vLLM's serializer to reach the TP workers."""
    sys.path.insert(0, os.path.dirname(__file__))
    from _train_helpers import preset

    ctx = StrategyContext(pretrain=tiny_qwen2_dir, seed=0, max_steps=10, response_length=8)
    infer_role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="vllm", strategy_config=dict(ENGINE)),
        model_args=ModelArgs(dtype="fp32"),
        num_gpus_per_worker=2,  # tensor parallel 2 over the worker's two slots
    )
    train_role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="deepspeed_train", strategy_config=preset(2)),
        model_args=ModelArgs(dtype="fp32"),
        training_args=TrainingArgs(
            learning_rate=2e-2, per_device_train_batch_size=2, gradient_accumulation_steps=1
        ),
        infer_batch_size=4,
    )
    start = time.perf_counter()
    infer = Cluster(
        "actor_infer",
        RolloutWorker,
        resources,
        init_args=(infer_role, ctx),
        call_timeout_s=300,
        env={VLLM_MULTIPROC_ENV: "1"} if multiproc else None,
    )
    train = Cluster(
        "actor_train", ActorTrainWorker, resources, init_args=(train_role, ctx), call_timeout_s=300
    )
    try:
        pending = [infer.submit("initialize"), train.submit("initialize")]
        for call in pending:
            call.get(timeout_s=300)  # a TP engine waiting for Ray bundles would hang here
        started_s = time.perf_counter() - start
        workers = infer.execute(lambda w: len(w.strategy.llm.collective_rpc("roll_ds_worker_rank")))
        assert workers == [2]

        batch = Batch(non_tensors={"prompt_ids": [[3, 5, 7, 9], [11, 13]], "row": [0, 1]})
        out = infer.generate(batch, seed=7, n=2, max_new_tokens=6, ignore_eos=True)
        assert [len(r) for r in out["response_ids"]] == [6] * 4  # 2 prompts x n=2

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (4, 16), generator=g)
        train.train_step(
            Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), nll_loss
        )
        probe = random_probe(VOCAB, size=4, length=24, seed=3)
        with pytest.raises(WeightSyncParityError):  # the engine still serves the old weights
            check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)

        transport = TRANSPORTS.get("collective")(bucket_bytes=256 * 1024, timeout_s=120)
        metrics = transport.sync(train, infer)
        parity = check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
        transport.close(train, infer)
        assert metrics["sync/buckets"] >= 4, metrics
        again = infer.generate(batch, seed=7, n=2, max_new_tokens=6, ignore_eos=True)
        before = [list(r) for r in out["rollout_logprobs"]]
        after = [list(r) for r in again["rollout_logprobs"]]
        assert before != after  # the same seed now samples from the new weights
        print(
            f"\nTP=2 engine in a Ray actor (multiproc={multiproc}): roles started in "
            f"{started_s:.1f} s; sync "
            f"{metrics['sync/seconds']:.3f} s ({metrics['sync/bytes'] / 1e6:.2f} MB into 2 TP "
            f"workers); parity max |diff| {parity['sync/parity_max_abs_diff']:.1e}"
        )
    finally:
        train.shutdown()
        infer.shutdown()
