"""Weight sync end to end on CPU: real Ray actors, DeepSpeed ZeRO (2 ranks) and one in-process
vLLM-CPU engine on the tiny Qwen2.

One Ray and one vLLM actor serve the whole module (a reload replaces every weight, so the engine
carries nothing over between tests); each {ZeRO 2, ZeRO 3} x {full, LoRA} case starts its own
trainer and runs both CPU transports against it:

    train a step -> parity before any sync fails (vLLM still serves other weights)
    sync (object_store) -> sampled log-probs == fp32 HF forward of the exported weights (1e-4),
        != the pre-training model's; parity passes
    train a step -> parity fails (a stale engine, i.e. a sync that moved nothing, is caught)
    sync (collective) -> the same checks on the new weights

The last test kills the vLLM actor in the middle of a collective sync and measures how long the
call takes to fail (it must name the dead worker).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
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
from roll_ds.strategy import StrategyContext  # noqa: E402
from roll_ds.weight_sync import TRANSPORTS  # noqa: E402
from roll_ds.weight_sync.base import WeightSyncError  # noqa: E402
from roll_ds.weight_sync.parity import WeightSyncParityError, check_parity, random_probe  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-4  # vLLM vs an fp32 HF forward of the same weights
MOVED = 1e-3  # the trained policy must differ from the pre-training one by more than this
PARITY_MAX = 1e-3  # trainer (fp32) vs vLLM on the probe, measured ~1e-5
KILL_BOUND_S = 30.0
# a 3 s sync bound, up to 3 s more for the group to tell who waited, the 2 s failure grace
STUCK_BOUND_S = 3 + 3 + 2 + 2
VOCAB = 128
ENGINE = {"enforce_eager": True, "block_size": 32, "max_num_seqs": 32}
PROBE = random_probe(VOCAB, size=4, length=24, seed=3)
PROMPTS = [[(5 * i + 3 * j) % VOCAB for j in range(12)] for i in range(3)]


def nll_loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


class KillableRolloutWorker(RolloutWorker):
    def die_in(self, seconds: float) -> int:
        """SIGKILL this actor's process after ``seconds`` (like an OOM kill mid-call)."""
        timer = threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
        return os.getpid()

    def stall(self, seconds: float) -> None:
        """Keep the actor busy (a stuck receiver)."""
        time.sleep(seconds)


class StallableTrainWorker(ActorTrainWorker):
    def stall(self, seconds: float, rank: int) -> None:
        """Keep rank ``rank`` busy (a trainer rank that stopped answering)."""
        if self.rank == rank:
            time.sleep(seconds)


@pytest.fixture(scope="module")
def resources():
    saved = os.environ.pop("RAY_ADDRESS", None)
    connect(num_cpus=4, log_to_driver=False)
    manager = ResourceManager(
        {"actor_train": RoleSpec((0, 1), 2), "actor_infer": RoleSpec((2,), 1)},
        num_gpus_per_node=3,
        device_resource="CPU",
        ready_timeout_s=60,
    ).reserve()
    yield manager
    manager.release()
    ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


def context(model_dir: str) -> StrategyContext:
    return StrategyContext(pretrain=model_dir, seed=0, max_steps=10, response_length=16)


@pytest.fixture(scope="module")
def infer(resources, tiny_qwen2_dir):
    role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="vllm", strategy_config=dict(ENGINE)),
        model_args=ModelArgs(dtype="fp32"),
    )
    cluster = Cluster(
        "actor_infer",
        KillableRolloutWorker,
        resources,
        init_args=(role, context(tiny_qwen2_dir)),
        call_timeout_s=300,
    )
    cluster.initialize()
    yield cluster
    cluster.shutdown()


def start_trainer(
    resources, model_dir: str, stage: int, lora: bool, worker_cls: type = ActorTrainWorker
) -> Cluster:
    sys.path.insert(0, os.path.dirname(__file__))
    from _train_helpers import preset

    ds = preset(stage, stage3_param_persistence_threshold=0) if stage == 3 else preset(stage)
    role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="deepspeed_train", strategy_config=ds),
        model_args=ModelArgs(dtype="fp32", lora_rank=4 if lora else None, lora_alpha=8),
        training_args=TrainingArgs(
            learning_rate=2e-2, per_device_train_batch_size=2, gradient_accumulation_steps=1
        ),
        infer_batch_size=4,
    )
    cluster = Cluster(
        "actor_train",
        worker_cls,
        resources,
        init_args=(role, context(model_dir)),
        call_timeout_s=300,
    )
    cluster.initialize()
    return cluster


def train_step(train: Cluster, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 16), generator=g)
    train.train_step(Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), nll_loss)


@torch.no_grad()
def hf_sampled_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_gap(model, out: Batch) -> float:
    gap = 0.0
    for row, response, got in zip(
        out["row"], out["response_ids"], out["rollout_logprobs"], strict=True
    ):
        ref = hf_sampled_logprobs(model, PROMPTS[row], list(response))
        gap = max(gap, (ref - torch.tensor(got)).abs().max().item())
    return gap


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def served_gaps(train: Cluster, infer: Cluster, export_dir: str, pretrain) -> tuple[float, float]:
    """(vLLM vs the synced weights, vLLM vs the pre-training model) on sampled tokens."""
    train.export_hf(export_dir)
    batch = Batch(non_tensors={"prompt_ids": PROMPTS, "row": list(range(len(PROMPTS)))})
    out = infer.generate(batch, seed=7, n=2, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    return max_gap(load_hf(export_dir), out), max_gap(pretrain, out)


def transport(name: str, bucket_bytes: int = 256 * 1024, timeout_s: float = 60.0):
    return TRANSPORTS.get(name)(bucket_bytes=bucket_bytes, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def pretrain(tiny_qwen2_dir):
    return load_hf(tiny_qwen2_dir)


CASES = [(2, False), (3, False), (2, True), (3, True)]


@pytest.mark.parametrize(
    ("stage", "lora"), CASES, ids=[f"zero{s}-{'lora' if lo else 'full'}" for s, lo in CASES]
)
def test_sync_serves_the_trained_weights(
    resources, infer, tiny_qwen2_dir, pretrain, tmp_path, stage, lora
):
    start = time.perf_counter()
    train = start_trainer(resources, tiny_qwen2_dir, stage, lora)
    setup_s = time.perf_counter() - start
    report = {"setup_s": round(setup_s, 1)}
    try:
        for step, name in enumerate(("object_store", "collective")):
            train_step(train, seed=step)
            with pytest.raises(WeightSyncParityError, match="actor_infer rank 0"):
                check_parity(train, infer, PROBE, max_abs_diff=PARITY_MAX)
            t = transport(name)
            metrics = t.sync(train, infer)
            assert metrics["sync/bytes"] > 1e6 and metrics["sync/buckets"] >= 4, metrics
            # what the sync's bound was computed from, counted without gathering
            assert train.weight_sync_nbytes(None, False) == metrics["sync/bytes"]
            assert metrics["sync/receivers"] == 1 and metrics["sync/gbps"] > 0, metrics
            parity = check_parity(train, infer, PROBE, max_abs_diff=PARITY_MAX)
            assert parity["sync/parity_max_abs_diff"] <= PARITY_MAX, parity
            synced, original = served_gaps(train, infer, str(tmp_path / name), pretrain)
            assert synced <= TOL, (name, synced)
            assert original > MOVED, (name, original, "vLLM still serves the pre-training model")
            t.close(train, infer)
            report[name] = (round(metrics["sync/seconds"], 3), f"{synced:.1e}", f"{original:.2f}")
        print(f"\nzero{stage} lora={lora}: {report}")
    finally:
        train.shutdown()


def test_stuck_or_killed_vllm_actor_fails_the_sync_in_bounded_time(
    resources, infer, tiny_qwen2_dir
):
    """A receiver that never starts receiving hits weight_sync.timeout_s and is named as the
    sync's cause (not the trainer rank whose broadcast waited on it); so is a trainer rank that
    never starts sending (not the receiver that waited on it), which restarts the run; a vLLM
    actor killed while a collective sync streams tiny buckets into it fails the sync at once,
    named."""
    from roll_ds.distributed.recovery import failed_ranks
    from roll_ds.pipeline.restarts import failed_trainer

    def causes(error: WeightSyncError) -> list[tuple[str, str, list[int]]]:
        return [(type(c).__name__, c.role, failed_ranks(c)) for c in error.causes]

    train = start_trainer(resources, tiny_qwen2_dir, 2, False, StallableTrainWorker)
    try:
        stuck = transport("collective", bucket_bytes=4096, timeout_s=3)
        stuck.connect(train, infer)
        stall = infer.submit("stall", 12.0)
        start = time.perf_counter()
        with pytest.raises(WeightSyncError, match="timed out") as info:
            stuck.sync(train, infer)
        took_stuck = time.perf_counter() - start
        # Rank 0's broadcast waits on the receiver too: at the driver's deadline both are busy,
        # and rank 0's gloo timeout (the same 3 s, within the settle wait) tells who waited.
        assert "actor_infer ranks [0]" in str(info.value), info.value
        assert causes(info.value) == [("WorkerTimeoutError", "actor_infer", [0])], info.value
        assert failed_trainer(info.value) is None  # an engine's fault: no run restart
        assert took_stuck < STUCK_BOUND_S, took_stuck
        stall.get()

        # The sender (train rank 0) stops answering: the receiver's header wait times out in
        # the group; the trainer is the cause.
        stuck = transport("collective", bucket_bytes=4096, timeout_s=3)
        stuck.connect(train, infer)
        stall = train.submit("stall", 12.0, 0)
        start = time.perf_counter()
        with pytest.raises(WeightSyncError) as info:
            stuck.sync(train, infer)
        took_trainer = time.perf_counter() - start
        assert causes(info.value) == [("WorkerTimeoutError", "actor_train", [0])], info.value
        assert "stuck (did not answer): actor_train ranks [0]" in str(info.value), info.value
        assert failed_trainer(info.value) == "actor_train ranks [0]"  # the run restarts
        assert took_trainer < STUCK_BOUND_S, took_trainer
        print(f"\nstuck trainer rank 0: failed after {took_trainer:.2f} s:\n{info.value}")
        stall.get()

        # 1 KB buckets: one tensor each, ~30 per sync; the kill lands inside one, not between.
        t = transport("collective", bucket_bytes=1024, timeout_s=60)
        t.connect(train, infer)
        infer.die_in(1.0)
        killed_at = time.perf_counter() + 1.0
        starts = []
        with pytest.raises(WeightSyncError) as info:
            for _ in range(30):  # keep syncing until the kill lands in one
                starts.append(time.perf_counter())
                t.sync(train, infer)
        took = time.perf_counter() - killed_at
        message = str(info.value)
        print(
            f"\nstuck receiver: failed after {took_stuck:.2f} s; killed vLLM actor: sync "
            f"{len(starts)} (started {killed_at - starts[-1]:.2f} s before the kill) failed "
            f"{took:.2f} s after the kill:\n{message}"
        )
        assert starts[-1] < killed_at, "the kill landed between two syncs"
        assert took < KILL_BOUND_S
        assert message.startswith("weight sync (collective) failed")
        first = message.splitlines()[1]
        assert "actor_infer rank 0" in first and "receive_weights" in first, message
        assert "ActorDiedError" in first, message
        assert causes(info.value) == [("WorkerError", "actor_infer", [0])], message
        assert failed_trainer(info.value) is None  # the trainer's broken broadcast only waited
    finally:
        train.shutdown()
