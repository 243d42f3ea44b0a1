"""The GPU path's process boundary on CPU: the rollout actor's vLLM engine runs with V1
multiprocessing on (``ROLL_DS_VLLM_MULTIPROC=1``), so its engine core and worker are processes
of their own (spawned from the Ray actor) and every ``collective_rpc`` argument and result crosses
vLLM's msgpack serializer exactly as on GPU.

A small set on purpose (the in-process suite covers the rest): generation with log-probs and
prompt log-probs against an fp32 HF forward, a sleep/wake round, and each CPU transport syncing
ZeRO-3 LoRA-merged and ZeRO-2 weights with parity. TP=2 across the boundary is
``test_vllm_tensor_parallel.py[multiproc]``; the adapter sync and a 2-step RLVR run are in
``test_rlvr_pipeline.py``.
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

sys.path.insert(0, os.path.dirname(__file__))
from test_weight_sync import (  # noqa: E402
    ENGINE,
    MOVED,
    PARITY_MAX,
    PROBE,
    PROMPTS,
    TOL,
    context,
    load_hf,
    max_gap,
    served_gaps,
    start_trainer,
    train_step,
    transport,
)

from roll_ds.config.schema import ModelArgs, StrategyArgs, WorkerConfig  # noqa: E402
from roll_ds.distributed.batch import Batch  # noqa: E402
from roll_ds.distributed.cluster import Cluster  # noqa: E402
from roll_ds.distributed.placement import RoleSpec  # noqa: E402
from roll_ds.distributed.ray_init import connect  # noqa: E402
from roll_ds.distributed.resource_manager import ResourceManager  # noqa: E402
from roll_ds.pipeline.workers import RolloutWorker  # noqa: E402
from roll_ds.platform import VLLM_MULTIPROC_ENV  # noqa: E402
from roll_ds.weight_sync.parity import WeightSyncParityError, check_parity  # noqa: E402

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _engine_facts runs in the actor


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


@pytest.fixture(scope="module")
def infer(resources, tiny_qwen2_dir):
    role = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="vllm", strategy_config=dict(ENGINE)),
        model_args=ModelArgs(dtype="fp32"),
    )
    cluster = Cluster(
        "actor_infer",
        RolloutWorker,
        resources,
        init_args=(role, context(tiny_qwen2_dir)),
        call_timeout_s=300,
        env={VLLM_MULTIPROC_ENV: "1"},
    )
    start = time.perf_counter()
    cluster.initialize()
    print(
        f"\nmultiprocess vLLM engine in a Ray actor: started in {time.perf_counter() - start:.1f} s"
    )
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def pretrain(tiny_qwen2_dir):
    return load_hf(tiny_qwen2_dir)


def _engine_facts(worker) -> dict:
    import psutil

    client = type(worker.strategy.llm.llm_engine.engine_core).__name__
    children = psutil.Process(os.getpid()).children(recursive=True)
    return {"client": client, "in_process": worker.strategy._in_process, "children": len(children)}


@torch.no_grad()
def _hf_prompt_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_generation_logprobs_and_sleep_wake_across_the_boundary(infer, pretrain):
    (facts,) = infer.execute(_engine_facts)
    assert facts["client"] == "SyncMPClient" and not facts["in_process"], facts
    assert facts["children"] >= 2, facts  # the engine core and its worker

    batch = Batch(non_tensors={"prompt_ids": PROMPTS, "row": list(range(len(PROMPTS)))})
    out = infer.generate(batch, seed=7, n=2, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    assert max_gap(pretrain, out) <= TOL

    ids = torch.tensor([[*p, 1, 2, 3] for p in PROMPTS])
    scored = infer.compute_logprobs(
        Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    )
    gap = (scored["logprobs"] - _hf_prompt_logprobs(pretrain, ids)).abs().max().item()
    assert gap <= TOL, gap

    infer.offload_states(level=1)
    with pytest.raises(Exception, match="offloaded"):
        infer.generate(batch, seed=7, n=2, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    infer.reload_states(tags=["weights"])
    infer.reload_states()
    again = infer.generate(batch, seed=7, n=2, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    assert [list(r) for r in again["response_ids"]] == [list(r) for r in out["response_ids"]]


CASES = [(3, True), (2, False)]


@pytest.mark.parametrize(
    ("stage", "lora"), CASES, ids=[f"zero{s}-{'lora' if lo else 'full'}" for s, lo in CASES]
)
def test_each_transport_syncs_across_the_boundary(
    resources, infer, tiny_qwen2_dir, pretrain, tmp_path, stage, lora
):
    """object_store: the whole model crosses vLLM's serializer as plain bytes; collective: the
    group seat does, and the worker receives from the group itself."""
    train = start_trainer(resources, tiny_qwen2_dir, stage, lora)
    report = {}
    try:
        for step, name in enumerate(("object_store", "collective")):
            train_step(train, seed=step)
            with pytest.raises(WeightSyncParityError):
                check_parity(train, infer, PROBE, max_abs_diff=PARITY_MAX)
            t = transport(name)
            metrics = t.sync(train, infer)
            assert metrics["sync/receivers"] == 1 and metrics["sync/bytes"] > 1e6, metrics
            parity = check_parity(train, infer, PROBE, max_abs_diff=PARITY_MAX)
            synced, original = served_gaps(train, infer, str(tmp_path / name), pretrain)
            assert synced <= TOL, (name, synced)
            assert original > MOVED, (name, original, "vLLM still serves the pre-training model")
            t.close(train, infer)
            report[name] = (
                round(metrics["sync/seconds"], 3),
                f"{parity['sync/parity_max_abs_diff']:.1e}",
            )
        print(f"\nmultiproc zero{stage} lora={lora}: {report}")
    finally:
        train.shutdown()
