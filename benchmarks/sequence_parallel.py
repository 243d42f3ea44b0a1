"""Per-rank activation memory of one long row with and without Ulysses sequence parallelism, on
the real ``deepspeed_train`` strategy.

    python benchmarks/sequence_parallel.py             # ~20M Qwen2, 4096 tokens, SP 1 and 2
    python benchmarks/sequence_parallel.py --seq-len 8192 --sizes 1,2 --out /tmp/sp.json

For each SP size ``n`` the benchmark starts ``n`` ranks (gloo on CPU, NCCL on GPUs) forming one
SP group, each building ``DeepSpeedTrainStrategy`` (ZeRO-2 preset, fp32, micro 1 x accumulation 1)
with ``sequence_parallel_size: n``, and trains one step on one row of ``--seq-len`` tokens per
rank (a warm-up step first, dropped): the group's ``n`` rows are its ``n`` micro-batches, each
computed by all ``n`` ranks on ``1/n`` of its columns. Figures per rank:

    saved MiB   the bytes autograd keeps for the backward of a micro-batch's forward (every
                distinct storage a saved tensor holds, parameters excluded), the largest over
                the step's micro-batches: the activation memory that peaks at the end of a
                forward, counted exactly on any device
    device MiB  on GPUs, the peak allocated during the step less the allocation before it
    train s     the step's wall time (``n`` rows under SP ``n``, one row without); logp s:
                ``compute_logprobs`` of the rank's row

The model is ``benchmarks/rlvr_step.py``'s ~20M Qwen2 (hidden 512, 6 layers, 8 heads, 2 key-value
heads) with room for the row's positions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def long_model(cache: Path, positions: int) -> str:
    """The ~20M Qwen2 of ``benchmarks/rlvr_step.py`` with ``max_position_embeddings`` raised."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from benchmarks.rlvr_step import build_medium_model

    path = cache / f"qwen2-20m-{positions}"
    if (path / "config.json").is_file():
        return str(path)
    base = build_medium_model(cache)
    config = AutoConfig.from_pretrained(base)
    config.max_position_embeddings = positions
    AutoModelForCausalLM.from_pretrained(base, config=config).save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return str(path)


def _loss(logprobs_BT, micro_batch, entropy_BT=None):
    mask = micro_batch["attention_mask"][:, 1:].to(logprobs_BT.dtype)
    return -(logprobs_BT * mask).sum() / mask.sum() - 0.01 * entropy_BT.mean(), {}


class SavedBytes:
    """Distinct storages autograd saves for backward (parameters excluded), per forward: a
    micro-batch's backward runs before the next one's forward, so the largest is the peak."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.storages, self.forwards = exclude, {}, []

    def new_forward(self, *_args) -> None:
        self.storages = {}
        self.forwards.append(self.storages)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def peak(self) -> int:
        return max(sum(f.values()) for f in self.forwards)


def _rank_main(rank: int, size: int, port: int, args: argparse.Namespace, model_dir: str) -> None:
    import torch

    from benchmarks.zero3_frozen_base import setup_rank

    setup_rank(rank, size, port, args.threads)
    import yaml

    from roll_ds.config.schema import ModelArgs, TrainingArgs
    from strategies.deepspeed.train import DeepSpeedTrainStrategy

    with open(os.path.join(REPO, "examples", "config", "deepspeed_zero2.yaml")) as f:
        preset = yaml.safe_load(f)["deepspeed_zero2"]
    s = DeepSpeedTrainStrategy(
        model_path=model_dir,
        strategy_config=preset,
        model_args=ModelArgs(dtype="fp32"),
        training_args=TrainingArgs(
            per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=1e-5
        ),
        max_steps=10,
        infer_batch_size=1,
        sequence_parallel_size=size,
    )
    s.initialize()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (1, args.seq_len), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    s.train_step(batch, _loss, with_entropy=True)  # warm-up
    params = {p.untyped_storage().data_ptr() for p in s.module.parameters()}
    saved = SavedBytes(params)
    hook = s.module.register_forward_pre_hook(saved.new_forward)
    cuda = s.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        s.train_step(batch, _loss, with_entropy=True)
    train_s = time.perf_counter() - started
    hook.remove()
    device_mib = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
    started = time.perf_counter()
    s.compute_logprobs(ids, batch["attention_mask"])
    logp_s = time.perf_counter() - started
    s.close()
    out = {
        "rank": rank,
        "saved_mib": saved.peak / 2**20,
        "micro_batches": len(saved.forwards),
        "device_peak_mib": device_mib,
        "train_step_s": train_s,
        "compute_logprobs_s": logp_s,
        "device": str(s.device),
    }
    with open(os.path.join(args.tmp, f"sp{size}_rank{rank}.json"), "w") as f:
        json.dump(out, f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--sizes", default="1,2", help="SP sizes (ranks per run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "roll_ds_bench"))
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "sequence_parallel.json")
    )
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]

    import torch.multiprocessing as mp

    Path(args.cache).mkdir(parents=True, exist_ok=True)
    model_dir = long_model(Path(args.cache), max(8192, args.seq_len))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for size in sizes:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.spawn(_rank_main, args=(size, port, args, model_dir), nprocs=size)
            ranks = []
            for rank in range(size):
                with open(os.path.join(tmp, f"sp{size}_rank{rank}.json")) as f:
                    ranks.append(json.load(f))
            runs[f"sp{size}"] = ranks
    base = max(r["saved_mib"] for r in runs[f"sp{sizes[0]}"])
    print(f"~20M Qwen2, fp32, one row of {args.seq_len} tokens, ZeRO-2, {args.threads} thread(s)")
    print(f"{'SP':>3}{'saved MiB/rank':>16}{'x SP ' + str(sizes[0]):>9}{'train s':>9}{'logp s':>8}")
    for name, ranks in runs.items():
        worst = max(r["saved_mib"] for r in ranks)
        per_rank = "/".join(f"{r['saved_mib']:.0f}" for r in ranks)
        print(
            f"{name[2:]:>3}{per_rank:>16}"
            f"{worst / base:>9.2f}{max(r['train_step_s'] for r in ranks):>9.2f}"
            f"{max(r['compute_logprobs_s'] for r in ranks):>8.2f}"
        )
        if ranks[0]["device_peak_mib"] is not None:
            print(f"    device peak MiB/rank: {[round(r['device_peak_mib']) for r in ranks]}")
    result = {
        "command": " ".join(["python benchmarks/sequence_parallel.py", *sys.argv[1:]]),
        "settings": {k: v for k, v in vars(args).items() if k != "tmp"},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    with open(args.out, "w") as f:
        json.dump(with_host(result), f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
