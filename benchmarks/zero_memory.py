"""Model-state memory and step time per ZeRO stage, measured against the ZeRO paper's formula.

    python benchmarks/zero_memory.py                        # bf16, 2 ranks, tiny random Qwen2
    python benchmarks/zero_memory.py --dtype fp32 --world-size 2 --out /tmp/zero.json

For every configuration (ZeRO 0, 1, 2, 3, 2 + CPU offload, 3 + CPU offload) each rank runs a few
steps of a ``deepspeed_train`` engine on a random Qwen2 with gradient accumulation 2 and, after
the first micro batch's backward of the second step (optimizer states exist, gradients are held
until the next micro batch), counts the bytes of the tensors it actually holds, each storage once
(found from the module and by walking the DeepSpeed optimizer's object graph):

    params      the module's parameters (the local shard ``ds_tensor`` under ZeRO-3)
    grads       ``.grad`` of the parameters and every optimizer/engine tensor named ``*grad*``
    optimizer   optimizer states (Adam m, v) and fp32 master copies (``*fp32*``, ``*master*``,
                ``single_partition*``)
    other       everything else the optimizer object graph holds (communication buckets, ...)

The ZeRO paper (Rajbhandari et al., 2020, section 5) counts mixed-precision Adam as
``2Ψ`` (fp16/bf16 params) + ``2Ψ`` (grads) + ``12Ψ`` (fp32 params, m, v) and shards it as
stage 1: ``4Ψ + 12Ψ/N``, stage 2: ``2Ψ + 14Ψ/N``, stage 3: ``16Ψ/N``. Pure fp32 training has no
master copy: ``4Ψ + 4Ψ + 8Ψ`` (params, grads, m+v), sharded the same way. The table prints the
measured ``params + grads + optimizer`` next to the formula for the same Ψ and N and the ratio.
CPU offload moves the optimizer partition (and under ZeRO-3 the parameter shards) to host memory
and adds an fp32 copy of the gradient partition there for the CPU Adam step (4Ψ/N, plus transfer
buffers); on a CPU-only machine host and device are one memory, so the table shows the sum.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CONFIGS = [  # (label, preset, stage)
    ("zero0", "deepspeed_zero", 0),
    ("zero1", "deepspeed_zero2", 1),  # the ZeRO-2 preset's buckets, gradients not partitioned
    ("zero2", "deepspeed_zero2", 2),
    ("zero3", "deepspeed_zero3", 3),
    ("zero2_offload", "deepspeed_zero2_cpuoffload", 2),
    ("zero3_offload", "deepspeed_zero3_cpuoffload", 3),
]
CATEGORIES = ("params", "grads", "optimizer", "other")


# ---------------------------------------------------------------------------------------------
# the paper's formula


def formula_bytes(stage: int, psi: int, n: int, dtype: str) -> float:
    """Model-state bytes per rank: ZeRO paper, section 5 (K=12 for mixed-precision Adam)."""
    p, g, o = (4, 4, 8) if dtype == "fp32" else (2, 2, 12)
    if stage == 0:
        return (p + g + o) * psi
    if stage == 1:
        return (p + g) * psi + o * psi / n
    if stage == 2:
        return p * psi + (g + o) * psi / n
    return (p + g + o) * psi / n


def formula_text(stage: int, dtype: str) -> str:
    p, g, o = (4, 4, 8) if dtype == "fp32" else (2, 2, 12)
    return {
        0: f"{p}Ψ+{g}Ψ+{o}Ψ",
        1: f"{p + g}Ψ+{o}Ψ/N",
        2: f"{p}Ψ+{g + o}Ψ/N",
        3: f"{p + g + o}Ψ/N",
    }[stage]


# ---------------------------------------------------------------------------------------------
# counting tensors


def _walk(obj: Any, path: str, depth: int, seen: set[int], out: list[tuple[str, Any]]) -> None:
    import torch

    if depth > 10 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        if obj.grad is not None:  # e.g. fp32 master params carrying fp32 grads
            out.append((f"{path}.grad", obj.grad))
        return
    if isinstance(obj, torch.nn.Module):
        return  # parameters are counted from the module itself
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(obj.items()):
            name = k if isinstance(k, str) else str(i)
            _walk(v, f"{path}.{name}", depth + 1, seen, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", depth + 1, seen, out)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", depth + 1, seen, out)


def _classify(path: str) -> str:
    low = path.lower()
    if "grad" in low:
        return "grads"
    if any(k in low for k in (".state.", "param_groups", "fp32", "master", "single_partition")):
        return "optimizer"
    return "other"


def count_model_states(engine: Any) -> tuple[dict[str, int], list[tuple[str, str, int]]]:
    """Bytes per category of the distinct storages this rank holds, and the storages
    ``(category, where found, bytes)``."""
    counted: dict[int, str] = {}
    totals = dict.fromkeys(CATEGORIES, 0)
    storages: list[tuple[str, str, int]] = []

    def add(tensor: Any, category: str, path: str) -> None:
        if tensor.device.type == "meta":  # shape-only placeholders hold no memory
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in counted:
            return
        counted[key] = category
        totals[category] += storage.nbytes()
        storages.append((category, path, storage.nbytes()))

    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3: the local shard, plus the full copy of a
            add(p.ds_tensor, "params", name)  # persistent (small, never partitioned) param
        add(p.data, "params", name)
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            add(p.grad, "grads", f"{name}.grad")
    found: list[tuple[str, Any]] = []
    _walk(engine.optimizer, "optimizer", 0, set(), found)
    for path, tensor in found:
        add(tensor, _classify(path), path)
    return totals, storages


# ---------------------------------------------------------------------------------------------
# one rank


def _loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


def _measure(label: str, preset: str, stage: int, args: argparse.Namespace, model_dir: str) -> dict:
    import torch
    import yaml

    from roll_ds.config.schema import ModelArgs, TrainingArgs
    from strategies import _common
    from strategies.deepspeed.train import DeepSpeedTrainStrategy

    with open(os.path.join(REPO, "examples", "config", f"{preset}.yaml")) as f:
        cfg = yaml.safe_load(f)[preset]
    cfg["zero_optimization"]["stage"] = stage
    s = DeepSpeedTrainStrategy(
        model_path=model_dir,
        strategy_config=cfg,
        model_args=ModelArgs(dtype=args.dtype),
        training_args=TrainingArgs(
            learning_rate=1e-4,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=2,
        ),
        seed=0,
        max_steps=args.steps + 1,
    )
    s.initialize()
    g = torch.Generator().manual_seed(s.rank)
    batch = {
        "input_ids": torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=g),
        "attention_mask": torch.ones(args.micro_batch, args.seq_len, dtype=torch.long),
    }
    engine = s.engine
    psi = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    times = []
    snapshot: dict[str, int] = {}
    for step in range(args.steps + 1):
        start = time.perf_counter()
        for micro in range(2):  # gradient accumulation 2: grads persist between micro batches
            out = _common.forward_logprobs(engine, batch["input_ids"], batch["attention_mask"])
            engine.backward(_loss(out["logprobs_BT"], batch)[0])
            if step == 1 and micro == 0:  # optimizer states exist (built by step 0)
                pause = time.perf_counter()
                snapshot, storages = count_model_states(engine)
                start += time.perf_counter() - pause
            engine.step()
        if step > 0:  # the first step builds optimizer states lazily: not timed
            times.append(time.perf_counter() - start)
    s.close()
    storages.sort(key=lambda x: -x[2])
    return {
        "label": label,
        "stage": stage,
        "psi": psi,
        "bytes": snapshot,
        "optimizer_class": type(engine.optimizer).__name__,
        "step_time_s": sum(times) / len(times),
        "largest_storages": storages[:12],
    }


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, model_dir: str):
    import torch

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    results = [
        _measure(label, preset, stage, args, model_dir)
        for label, preset, stage in CONFIGS
        if label in args.configs
    ]
    path = os.path.join(args.tmp, f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(results, f)


# ---------------------------------------------------------------------------------------------
# driver


def build_model(out_dir: str, args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=max(256, args.seq_len),
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(out_dir)


def report(rows: list[dict], dtype: str, world_size: int) -> str:
    mb = 2**20
    head = (
        f"{'config':<14}{'rank':>5}{'params':>9}{'grads':>9}{'optim':>9}{'other':>8}"
        f"{'P+G+O':>9}{'formula':>16}{'=MiB':>8}{'ratio':>7}{'step s':>8}"
    )
    lines = [
        f"model-state MiB per rank, dtype {dtype}, N={world_size}, Ψ={rows[0]['psi']:,} params",
        head,
        "-" * len(head),
    ]
    for r in rows:
        b = r["bytes"]
        total = b["params"] + b["grads"] + b["optimizer"]
        lines.append(
            f"{r['label']:<14}{r['rank']:>5}{b['params'] / mb:>9.2f}{b['grads'] / mb:>9.2f}"
            f"{b['optimizer'] / mb:>9.2f}{b['other'] / mb:>8.2f}{total / mb:>9.2f}"
            f"{formula_text(r['stage'], dtype):>16}{r['formula_bytes'] / mb:>8.2f}"
            f"{total / r['formula_bytes']:>7.2f}{r['step_time_s']:>8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "zero_memory.json")
    )
    args = parser.parse_args(argv)
    args.configs = set(args.configs.split(","))
    unknown = args.configs - {c[0] for c in CONFIGS}
    if unknown:
        parser.error(f"unknown --configs {sorted(unknown)}; valid: {[c[0] for c in CONFIGS]}")

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        model_dir = os.path.join(tmp, "model")
        build_model(model_dir, args)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_rank_main, args=(args.world_size, port, args, model_dir), nprocs=args.world_size)
        per_rank = []
        for rank in range(args.world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    rows = []
    for results in zip(*per_rank, strict=True):
        for rank, r in enumerate(results):
            r["rank"] = rank
            r["formula_bytes"] = formula_bytes(r["stage"], r["psi"], args.world_size, args.dtype)
            r["formula"] = formula_text(r["stage"], args.dtype)
            rows.append(r)
    table = report(rows, args.dtype, args.world_size)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from roll_ds.host import host_record  # the host with the figures

    with open(args.out, "w") as f:
        settings = {k: v for k, v in vars(args).items() if k not in ("tmp", "configs")}
        json.dump(
            {
                "settings": settings,
                "configs": sorted(args.configs),
                "rows": rows,
                "table": table.splitlines(),
                "host": host_record(),
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
