"""ZeRO-3 with LoRA: the frozen base partitioned (gathered every pass), persisted by DeepSpeed's
threshold, or kept whole out of ZeRO-3, next to ZeRO-2, on the real ``deepspeed_train`` strategy.

    python benchmarks/zero3_frozen_base.py                          # ~20M Qwen2, 2 ranks, gloo
    python benchmarks/zero3_frozen_base.py --model embedded --rounds 3 --out /tmp/z3.json

Every rank builds ``DeepSpeedTrainStrategy`` (LoRA r16 on every linear layer) once per variant and
times ``train_step`` (micro batch x gradient accumulation rows, one optimizer step) and
``compute_logprobs`` (the same rows, ``infer_batch_size`` chunks) over ``--repeats`` repeats after
one warm-up step that is dropped. Variants (``--variants``):

    zero2            the ZeRO-2 preset
    zero3_partition  the ZeRO-3 preset with zero3_frozen_base: partitioned (its persistence
                     threshold "auto" = 10 * hidden: every base weight matrix is partitioned and
                     all-gathered in every forward and backward)
    zero3_persist    partitioned, stage3_param_persistence_threshold = 10**12: DeepSpeed
                     persists every parameter (kept gathered between passes, but re-partitioned
                     and re-gathered at every optimizer step and cache release)
    zero3_whole      zero3_frozen_base: whole: the base loaded whole on every rank and kept out
                     of ZeRO-3 (buffers), zero3_adapter_stage: 3: only the adapter is partitioned
    zero3_auto       the ZeRO-3 preset as shipped (its "auto" resolution decides: with the base
                     whole, the adapter trains at stage 1)

The box may be shared, so ``--rounds`` runs the whole variant list again (A B C A B C ...) and the
figures are medians over all rounds; compare the ratios to ``zero3_partition`` more than the
seconds. ``CPU s`` (the rank's process CPU time for train step + log-probs) is less disturbed by
other work on the machine than the wall-clock seconds. Per rank it also reports how many
parameters persist, the weight bytes the rank holds after a step (the local shards plus every
full copy) and its resident memory after the variant (VmRSS; the process's peak, ``ru_maxrss``,
only grows across variants, so it is reported once per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VARIANTS = ("zero2", "zero3_partition", "zero3_persist", "zero3_whole", "zero3_auto")
PERSIST_ALL = 10**12


def _preset(name: str) -> dict[str, Any]:
    import yaml

    with open(os.path.join(REPO, "examples", "config", f"{name}.yaml")) as f:
        return yaml.safe_load(f)[name]


def variant_config(variant: str, hidden: int) -> dict[str, Any]:
    """The strategy config of ``variant`` (see the module doc)."""
    if variant == "zero2":
        return _preset("deepspeed_zero2")
    cfg = _preset("deepspeed_zero3")
    zero = cfg["zero_optimization"]
    if variant == "zero3_partition":
        cfg["zero3_frozen_base"] = "partitioned"
        zero["stage3_param_persistence_threshold"] = 10 * hidden
    elif variant == "zero3_persist":
        cfg["zero3_frozen_base"] = "partitioned"
        zero["stage3_param_persistence_threshold"] = PERSIST_ALL
    elif variant == "zero3_whole":
        cfg["zero3_frozen_base"] = "whole"
        cfg["zero3_adapter_stage"] = 3  # the adapter partitioned too (auto would run stage 1)
    elif variant != "zero3_auto":
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return cfg


def _loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum(), {}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def param_census(module: Any) -> dict[str, int]:
    """Parameters that persist (ZeRO-3 ``ds_persist``), those that are frozen, the frozen base
    weights kept whole as buffers, and the bytes of weight storage this rank holds (local shards
    plus full copies, each storage once)."""
    from roll_ds.models.frozen_base import count_frozen_whole, named_weights

    seen: set[int] = set()
    held = 0
    for _, p in named_weights(module):
        for t in (getattr(p, "ds_tensor", None), p.data):
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held += storage.nbytes()
    params = list(module.parameters())
    return {
        "frozen_whole": count_frozen_whole(module),
        "params": len(params),
        "frozen": sum(not p.requires_grad for p in params),
        "persisted": sum(bool(getattr(p, "ds_persist", False)) for p in params),
        "frozen_persisted": sum(
            bool(getattr(p, "ds_persist", False)) and not p.requires_grad for p in params
        ),
        "param_bytes_held": held,
    }


def _measure(variant: str, args: argparse.Namespace, model_dir: str, hidden: int) -> dict:
    import torch

    from roll_ds.config.schema import ModelArgs, TrainingArgs
    from strategies.deepspeed.train import DeepSpeedTrainStrategy

    cfg = variant_config(variant, hidden)
    s = DeepSpeedTrainStrategy(
        model_path=model_dir,
        strategy_config=cfg,
        model_args=ModelArgs(dtype=args.dtype, lora_rank=args.lora_rank),
        training_args=TrainingArgs(
            learning_rate=1e-4,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.accum,
        ),
        seed=0,
        max_steps=args.repeats + 2,
        infer_batch_size=args.micro_batch,
    )
    start = time.perf_counter()
    s.initialize()
    init_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(s.rank)
    rows = args.micro_batch * args.accum
    vocab = s.module.config.vocab_size
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, args.seq_len), generator=g),
        "attention_mask": torch.ones(rows, args.seq_len, dtype=torch.long),
    }
    train_s, logprob_s, cpu_s = [], [], []
    census: dict[str, int] = {}
    for i in range(args.repeats + 1):  # the first (warm-up: traces, optimizer states) dropped
        c0, t0 = time.process_time(), time.perf_counter()
        s.train_step(batch, _loss)
        t1 = time.perf_counter()
        if i == 0:  # after a step: what stays gathered between passes is held whole now
            census = param_census(s.module)
            t1 = time.perf_counter()
        s.compute_logprobs(batch["input_ids"], batch["attention_mask"])
        t2 = time.perf_counter()
        if i > 0:
            train_s.append(t1 - t0)
            logprob_s.append(t2 - t1)
            cpu_s.append(time.process_time() - c0)
    threshold = s.ds_config["zero_optimization"].get("stage3_param_persistence_threshold")
    s.close()
    return {
        "variant": variant,
        "persistence_threshold": threshold,
        "frozen_base": s.ds_config.get("zero3_frozen_base"),
        "init_s": init_s,
        "train_step_s": train_s,
        "compute_logprobs_s": logprob_s,
        "cpu_s": cpu_s,
        "rss_bytes": _rss_bytes(),
        **census,
    }


def setup_rank(rank: int, world_size: int, port: int, threads: int) -> None:
    """A spawned rank's process: torch.distributed's env (one host), its threads, quiet logs
    (shared with benchmarks/sequence_parallel.py)."""
    import logging
    import warnings

    import torch

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, model: tuple):
    setup_rank(rank, world_size, port, args.threads)
    model_dir, hidden = model
    results = [
        {"round": r, **_measure(v, args, model_dir, hidden)}
        for r in range(args.rounds)
        for v in args.variants
    ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(args.tmp, f"rank{rank}.json"), "w") as f:
        json.dump({"results": results, "peak_rss_bytes": peak}, f)


def resolve_model(name: str, cache: Path) -> tuple[str, int]:
    """``(directory, hidden size)`` of ``qwen2-20m`` or ``embedded`` (embedded:tiny-qwen2)."""
    from transformers import AutoConfig

    if name == "qwen2-20m":
        from benchmarks.rlvr_step import build_medium_model

        path = build_medium_model(cache)
    else:
        from roll_ds.models.loading import resolve_model_path

        path = resolve_model_path("embedded:tiny-qwen2")
    return path, int(AutoConfig.from_pretrained(path).hidden_size)


def summarise(per_rank: list[dict], variants: list[str]) -> dict[str, dict]:
    """Medians over every round and rank per variant, and ratios to ``zero3_partition``."""
    out: dict[str, dict] = {}
    for v in variants:
        mine = [r for rank in per_rank for r in rank["results"] if r["variant"] == v]
        train = statistics.median(t for r in mine for t in r["train_step_s"])
        logp = statistics.median(t for r in mine for t in r["compute_logprobs_s"])
        out[v] = {
            "train_step_s": train,
            "compute_logprobs_s": logp,
            "total_s": train + logp,
            "cpu_s": statistics.median(t for r in mine for t in r["cpu_s"]),
            "persistence_threshold": mine[0]["persistence_threshold"],
            "frozen_base": mine[0]["frozen_base"],
            "frozen_whole": mine[0]["frozen_whole"],
            "persisted": [r["persisted"] for r in mine if r["round"] == 0],
            "frozen": mine[0]["frozen"],
            "params": mine[0]["params"],
            "param_mib_per_rank": [r["param_bytes_held"] / 2**20 for r in mine if r["round"] == 0],
            "rss_mib_per_rank": [r["rss_bytes"] / 2**20 for r in mine if r["round"] == 0],
        }
    base = out.get("zero3_partition")
    if base:
        for row in out.values():
            row["total_vs_zero3_partition"] = row["total_s"] / base["total_s"]
            row["train_vs_zero3_partition"] = row["train_step_s"] / base["train_step_s"]
            row["cpu_vs_zero3_partition"] = row["cpu_s"] / base["cpu_s"]
    return out


def report(summary: dict[str, dict], args: argparse.Namespace) -> str:
    head = (
        f"{'variant':<17}{'frozen base':>12}{'threshold':>14}{'persist':>9}{'train s':>9}"
        f"{'logp s':>8}{'total s':>9}{'x part.':>8}{'CPU s':>7}{'x part.':>8}"
        f"{'param MiB/rank':>16}{'RSS MiB/rank':>15}"
    )
    from roll_ds.platform import current_platform

    where = current_platform()
    lines = [
        f"{args.model}, LoRA r{args.lora_rank}, {args.dtype}, {args.world_size} ranks "
        f"({where.dist_backend}, {where.device_type}), "
        f"{args.micro_batch}x{args.accum} rows of {args.seq_len} tokens per rank, medians of "
        f"{args.rounds} rounds x {args.repeats} repeats",
        head,
        "-" * len(head),
    ]
    for v, r in summary.items():
        ratio, cpu_ratio = r.get("total_vs_zero3_partition"), r.get("cpu_vs_zero3_partition")
        lines.append(
            f"{v:<17}{r['frozen_base'] or '-':>12}{r['persistence_threshold']!s:>14}"
            f"{'/'.join(map(str, r['persisted'])):>9}{r['train_step_s']:>9.3f}"
            f"{r['compute_logprobs_s']:>8.3f}{r['total_s']:>9.3f}"
            f"{(f'{ratio:.2f}' if ratio else '-'):>8}{r['cpu_s']:>7.2f}"
            f"{(f'{cpu_ratio:.2f}' if cpu_ratio else '-'):>8}"
            f"{'/'.join(f'{m:.0f}' for m in r['param_mib_per_rank']):>16}"
            f"{'/'.join(f'{m:.0f}' for m in r['rss_mib_per_rank']):>15}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("qwen2-20m", "embedded"), default="qwen2-20m")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variant list")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "roll_ds_bench"))
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "zero3_frozen_base.json")
    )
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown --variants {sorted(unknown)}; valid: {list(VARIANTS)}")

    import torch.multiprocessing as mp

    Path(args.cache).mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, Path(args.cache))
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_rank_main, args=(args.world_size, port, args, model), nprocs=args.world_size)
        per_rank = []
        for rank in range(args.world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    summary = summarise(per_rank, args.variants)
    print(report(summary, args))
    print("peak RSS MiB per rank (whole run):", [r["peak_rss_bytes"] // 2**20 for r in per_rank])
    result = {
        "argv": sys.argv[1:],
        "settings": {k: v for k, v in vars(args).items() if k not in ("tmp",)},
        "summary": summary,
        "per_rank": per_rank,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    with open(args.out, "w") as f:
        json.dump(with_host(result), f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
