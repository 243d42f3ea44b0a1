"""The GPU path end to end, for the day a GPU is available: `bash scripts/test.sh -m gpu`.

Each test is the CPU test of the same thing, on CUDA:

- NCCL weight sync between two separate GPUs (trainer on GPU 0, vLLM on GPU 1), with the
  log-prob parity check before and after (``test_weight_sync.py`` on CPU with gloo);
- ZeRO-3 with CPU offload on the GPUs (one rank per GPU, up to 2): DeepSpeedCPUAdam really
  runs, and the loss trajectory equals ZeRO-3 without offload on FusedAdam
  (``test_zero_parity.py``);
- LoRA under ZeRO-3 on the GPUs, bf16 kernels aside (fp32): each frozen-base / adapter-stage
  case of ``test_lora_zero3.py``, the same checks, the CPU reference forward within ``GPU_ATOL``;
- a 3-step RLVR run of the embedded model on 2 GPUs through run.py, colocated (train and vLLM
  on the same GPUs, weights by CUDA IPC) and separate (NCCL) (``test_rlvr_pipeline.py``).

Without CUDA (or with fewer than 2 GPUs where a test needs 2) they skip with the reason; the
overrides the runs use are composed and validated on CPU by the one test here that runs
everywhere.
Colocated CUDA IPC sync, TP=2 vLLM and sleep/wake memory have their own GPU tests
(``test_weight_sync.py``, ``test_vllm_strategy.py`` and the colocation tests).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys

import pytest
import torch

pytestmark = pytest.mark.integration
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _gpu import NEEDS_VLLM, TWO_GPUS  # noqa: E402
from test_lora_zero3 import CASES as LORA_CASES  # noqa: E402

PARITY_MAX = 2e-3  # trainer (fp32) vs vLLM (fp32) on the probe; GPU kernels differ from CPU's
GPU_ATOL = 1e-4  # fp32 log-probs on CUDA against the same model's forward on the CPU
VOCAB = 128

# --- NCCL weight sync across two separate GPUs ----------------------------------------------


def nll_loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


@pytest.mark.gpu
@NEEDS_VLLM
@TWO_GPUS
def test_nccl_sync_between_separate_gpus_serves_the_trained_weights(tiny_qwen2_dir):
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
    from roll_ds.platform import current_platform
    from roll_ds.strategy import StrategyContext
    from roll_ds.weight_sync import TRANSPORTS
    from roll_ds.weight_sync.parity import WeightSyncParityError, check_parity, random_probe

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors get nll_loss by value
    n = torch.cuda.device_count()
    connect(num_cpus=8, log_to_driver=False)
    rm = ResourceManager(
        {"actor_train": RoleSpec((0,), 1), "actor_infer": RoleSpec((1,), 1)},
        num_gpus_per_node=n,
        device_resource="GPU",
        cpus_per_device=2,
    )
    ctx = StrategyContext(pretrain=tiny_qwen2_dir, seed=0, max_steps=10, response_length=16)
    train_role = WorkerConfig(
        strategy_args=StrategyArgs(
            strategy_name="deepspeed_train",
            strategy_config=preset(3, stage3_param_persistence_threshold=0),
        ),
        model_args=ModelArgs(dtype="fp32"),
        training_args=TrainingArgs(
            learning_rate=2e-2, per_device_train_batch_size=2, gradient_accumulation_steps=1
        ),
        infer_batch_size=4,
    )
    infer_role = WorkerConfig(
        strategy_args=StrategyArgs(
            strategy_name="vllm",
            strategy_config={"enforce_eager": True, "gpu_memory_utilization": 0.3},
        ),
        model_args=ModelArgs(dtype="fp32"),
    )
    try:
        train = Cluster("actor_train", ActorTrainWorker, rm, init_args=(train_role, ctx))
        infer = Cluster("actor_infer", RolloutWorker, rm, init_args=(infer_role, ctx))
        train.initialize()
        infer.initialize()
        assert train.infos[0]["accelerator_ids"]["GPU"] != infer.infos[0]["accelerator_ids"]["GPU"]
        probe = random_probe(VOCAB, size=4, length=24, seed=3)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (4, 16), generator=g)
        train.train_step(
            Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), nll_loss
        )
        with pytest.raises(WeightSyncParityError):  # vLLM still serves the pre-training weights
            check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
        assert current_platform().dist_backend == "nccl"
        transport = TRANSPORTS.get("collective")(bucket_bytes=256 * 1024, timeout_s=120)
        metrics = transport.sync(train, infer)
        assert metrics["sync/bytes"] > 1e6 and metrics["sync/receivers"] == 1, metrics
        parity = check_parity(train, infer, probe, max_abs_diff=PARITY_MAX)
        assert parity["sync/parity_max_abs_diff"] <= PARITY_MAX, parity
        transport.close(train, infer)
        print(f"\nNCCL sync GPU 0 -> GPU 1: {metrics}, parity {parity}")
    finally:
        rm.release()
        ray.shutdown()


# --- ZeRO-3 + CPU offload on GPU ------------------------------------------------------------

STEPS = 3


def _zero3_with_and_without_offload(model_path: str) -> dict:
    from _train_helpers import make_strategy, nll_loss, rank_batch

    out: dict = {}
    for key in (3, "3_offload"):
        s = make_strategy(
            model_path, key, zero={"stage3_param_persistence_threshold": 0}, seed=0, max_steps=4
        )
        assert next(s.module.parameters()).device.type == "cuda"
        out[f"{key}/optimizer"] = type(s.engine.basic_optimizer).__name__
        batch = rank_batch(s.rank)  # the strategy moves it to its GPU
        out[str(key)] = [s.train_step(batch, nll_loss)["loss"] for _ in range(STEPS)]
        s.close()
    return out


def _gpu_ranks() -> int:
    return min(2, torch.cuda.device_count())


@pytest.mark.gpu
def test_zero3_cpu_offload_trains_on_the_gpus(tiny_qwen2_dir):
    from _dist import run_distributed

    results = run_distributed(
        _zero3_with_and_without_offload,
        world_size=_gpu_ranks(),
        args=(tiny_qwen2_dir,),
        timeout_s=600,
    )
    for rank, res in enumerate(results):
        assert res["3_offload/optimizer"] == "DeepSpeedCPUAdam", res
        assert res["3/optimizer"] == "FusedAdam", res  # built, whatever TORCH_CUDA_ARCH_LIST says
        ref = res["3"]
        assert all(b < a for a, b in itertools.pairwise(ref)), f"rank {rank}: {ref}"
        # CPU Adam vs the GPU's fused Adam, fp32: reduction order only
        assert res["3_offload"] == pytest.approx(ref, rel=1e-4, abs=1e-5), (rank, res)


@pytest.mark.gpu
@pytest.mark.parametrize(("frozen_base", "adapter_stage", "engine_stage"), LORA_CASES)
def test_lora_under_zero3_on_the_gpus(
    tiny_qwen2_dir, tmp_path, frozen_base, adapter_stage, engine_stage
):
    from _dist import run_distributed
    from test_lora_zero3 import _lora_checks, check_lora_results

    results = run_distributed(
        _lora_checks,
        world_size=_gpu_ranks(),
        args=(tiny_qwen2_dir, str(tmp_path / "export"), frozen_base, adapter_stage),
        timeout_s=600,
    )
    check_lora_results(results, frozen_base, engine_stage, GPU_ATOL)


# --- 3-step RLVR runs of the embedded model on 2 GPUs ---------------------------------------

GPU_RUN = [
    "max_steps=3",
    "save_steps=0",
    "eval_steps=0",
    "num_gpus_per_node=2",
    "device=cuda",
    # the trainer shares the GPUs with vLLM in the colocated run: vLLM takes a quarter
    "+actor_infer.strategy_args.strategy_config.gpu_memory_utilization=0.25",
]
PLACEMENTS = {
    # the 16-GPU example's shape in small: every GPU holds a trainer rank and a vLLM engine
    "colocated": ["actor_train.device_mapping=[0,1]", "actor_infer.device_mapping=[0,1]"],
    "separate": ["actor_train.device_mapping=[0]", "actor_infer.device_mapping=[1]"],
}


def test_gpu_run_configs_compose_and_validate():
    """Runs everywhere: the GPU runs' overrides are valid (the day a GPU comes, only the GPU
    part can fail)."""
    from _pipeline_run import SMALL

    from roll_ds.config import load_config

    for name, placement in PLACEMENTS.items():
        cfg = load_config("rlvr_lora_zero3", [*SMALL, *GPU_RUN, *placement], check_files=False)
        assert cfg.device == "cuda" and cfg.max_steps == 3, name
        assert cfg.actor_infer.strategy_args.strategy_config["gpu_memory_utilization"] == 0.25


@pytest.mark.gpu
@NEEDS_VLLM
@TWO_GPUS
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_rlvr_three_steps_on_two_gpus(placement, tmp_path):
    from _pipeline_run import metrics, run, served_syncs

    result = run(tmp_path, *GPU_RUN, *PLACEMENTS[placement], timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [r for r in metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        sync = served_syncs(metrics(tmp_path))[row["step"]]
        assert sync["sync/parity_max_abs_diff"] < PARITY_MAX, row
        assert sync["sync/bytes"] > 0 and row["grad_norm"] > 0, row
    chosen = re.findall(r"weight sync: transport (\w+)", result.stderr)
    # NCCL refuses two ranks on one GPU: colocated weights must not go through a collective
    assert chosen and (chosen[0] != "collective") == (placement == "colocated"), chosen
    print(f"\n{placement}: transport {chosen[0]}, " + json.dumps(rows[-1], sort_keys=True)[:600])
