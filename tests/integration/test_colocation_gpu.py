"""Colocation on one real GPU: actor_train (ZeRO-3 LoRA) and actor_infer (vLLM, sleep mode) on
the same device, two steps of the real pipeline. After every transition of the choreography
the trainer's ``torch.cuda.memory_allocated`` and the device's used memory (``mem_get_info``,
which sees vLLM's own allocator too) are read in the actors: each offload / sleep must free
what the transition says it frees, and each reload / wake must bring it back."""

from __future__ import annotations

import pytest

from roll_ds.config.compose import PROJECT_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.gpu]
pytest.importorskip("vllm", reason="needs vLLM (pip install '.[gpu]'); it is not installed here")

GIB = 2**30
UTILIZATION = 0.3  # vLLM's share of the GPU while generating


def _memory(worker) -> dict[str, int]:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "device_used": total - free}


def test_offloads_free_the_gpu_for_the_other_side(tmp_path, monkeypatch):
    import ray

    from roll_ds.config import load_config
    from roll_ds.pipeline.rlvr import RLVRPipeline

    monkeypatch.chdir(PROJECT_ROOT)  # the example's data paths are relative to the repo
    cfg = load_config(
        "rlvr_lora_zero3",
        [
            f"output_dir={tmp_path}",
            "num_gpus_per_node=1",
            "actor_train.device_mapping=[0]",
            "actor_infer.device_mapping=[0]",
            f"+actor_infer.strategy_args.strategy_config.gpu_memory_utilization={UTILIZATION}",
            "max_steps=2",
            "eval_steps=0",
            "save_steps=0",
            "rollout_batch_size=4",
            "num_return_sequences_in_group=4",
            "actor_train.training_args.per_device_train_batch_size=8",
            "actor_train.training_args.gradient_accumulation_steps=2",
            "tracking.tensorboard=false",
        ],
    )
    pipe = RLVRPipeline(cfg)
    figures: list[tuple[tuple, dict, dict]] = []  # (trace entry, trainer rank 0, engine rank 0)

    def measure() -> tuple[dict, dict]:
        train = pipe.clusters["actor_train"].actors[0]
        infer = pipe.clusters["actor_infer"].actors[0]
        return tuple(ray.get([a.__ray_call__.remote(_memory) for a in (train, infer)]))

    try:
        pipe.start()
        choreo = pipe.colocation
        assert choreo.active and choreo.plan.trainers == ("actor_train",)
        run = choreo._run

        def measured_run(stage):  # the real runner, then the figures after the stage
            run(stage)
            figures.append((stage, *measure()))

        choreo._run = measured_run
        before = measure()
        for step in range(2):
            pipe.train_one_step(step)
    finally:
        pipe.shutdown()
        ray.shutdown()

    kv_bytes = UTILIZATION * _total_memory() * 0.5  # at least half of vLLM's share is KV cache
    last_train, last_device = before[0]["allocated"], before[1]["device_used"]
    seen = set()
    for stage, train, engine in figures:
        for t in stage:
            seen.add(t.action)
            if t.action == "offload":  # the trainer's parameter shards (and more) left the GPU
                assert train["allocated"] < last_train, (t, train, last_train)
            elif t.action == "reload":
                assert train["allocated"] > last_train, (t, train, last_train)
            elif t.action == "sleep":  # KV cache freed, weights to host memory
                assert engine["device_used"] < last_device - kv_bytes, (t, engine, last_device)
            elif t.action in ("wake_kv_cache", "wake"):
                assert engine["device_used"] > last_device + kv_bytes, (t, engine, last_device)
        last_train, last_device = train["allocated"], engine["device_used"]
    assert {"offload", "reload", "sleep", "wake_weights", "wake_kv_cache"} <= seen
    print("memory after each transition (trainer allocated / device used, GiB):")
    for stage, train, engine in figures:
        names = ", ".join(f"{t.role} {t.action}" for t in stage)
        print(f"  {names}: {train['allocated'] / GIB:.3f} / {engine['device_used'] / GIB:.2f}")


def _total_memory() -> int:
    import torch

    return torch.cuda.mem_get_info()[1]
