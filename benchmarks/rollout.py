"""Rollout throughput: generated tokens/s of the vllm strategy vs HF ``generate`` on one model.

    python benchmarks/rollout.py                                  # tiny Qwen2, batches 8 and 64
    python benchmarks/rollout.py --batch-sizes 4 16 64 --n 8 --max-new-tokens 128
    python benchmarks/rollout.py --model /path/to/hf_model --dtype bf16 --compile

Both engines sample at temperature 1 with no eos (every sample runs to ``--max-new-tokens``) from
the same random prompts; vLLM also returns each token's log-prob, HF ``generate`` does not. The
tiny model is the test suite's (vocab 128, hidden 128, 2 layers), built locally. Times are the
median of ``--repeats`` runs after one warm-up run per batch size. Prints a table and writes
JSON (default benchmarks/results/rollout.json).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_QWEN2 = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32, the minimum of vLLM's CPU attention
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def build_tiny_model(out_dir: str) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).save_pretrained(out_dir)
    return out_dir


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_hf(model_path: str, args, batches: dict[int, list[list[int]]]) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from roll_ds.models.tensors import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(args.dtype)).eval()
    results = {}
    for size, prompts in batches.items():
        ids = torch.tensor(prompts)

        def run(ids=ids, size=size) -> None:
            torch.manual_seed(0)
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=args.max_new_tokens,
                    min_new_tokens=args.max_new_tokens,
                    num_return_sequences=args.n,
                    pad_token_id=0,
                )
            assert out.shape == (size * args.n, ids.shape[1] + args.max_new_tokens)

        results[size] = timed(run, args.repeats)
    return results


def bench_vllm(model_path: str, args, batches: dict[int, list[list[int]]]) -> dict:
    from strategies.vllm import VllmStrategy

    config = {} if args.compile else {"enforce_eager": True}
    strategy = VllmStrategy(model_path=model_path, dtype=args.dtype, seed=0, strategy_config=config)
    start = time.perf_counter()
    strategy.initialize()
    startup = time.perf_counter() - start
    results = {}
    for size, prompts in batches.items():

        def run(prompts=prompts, size=size) -> None:
            out = strategy.generate(
                prompts, n=args.n, max_new_tokens=args.max_new_tokens, seed=0, ignore_eos=True
            )
            assert sum(map(len, out["response_ids"])) == size * args.n * args.max_new_tokens

        results[size] = timed(run, args.repeats)
    strategy.close()
    return {"startup_s": startup, "seconds": results}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="HF model dir (default: build the tiny Qwen2)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64], help="prompts/batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for HF generate")
    ap.add_argument("--compile", action="store_true", help="vLLM with torch.compile (not eager)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollout.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model or build_tiny_model(tmp)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        batches = {b: random_prompts(b, args.prompt_len, vocab, seed=b) for b in args.batch_sizes}
        hf = {} if args.skip_hf else bench_hf(model_path, args, batches)
        vllm_result = bench_vllm(model_path, args, batches)

    import vllm

    rows = []
    for size in args.batch_sizes:
        tokens = size * args.n * args.max_new_tokens
        row = {
            "prompts": size,
            "samples": size * args.n,
            "generated_tokens": tokens,
            "vllm_s": vllm_result["seconds"][size],
            "vllm_tokens_per_s": tokens / vllm_result["seconds"][size],
        }
        if size in hf:
            row.update(hf_s=hf[size], hf_tokens_per_s=tokens / hf[size])
            row["vllm_over_hf"] = row["vllm_tokens_per_s"] / row["hf_tokens_per_s"]
        rows.append(row)

    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "cuda": torch.cuda.is_available(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "params": {**vars(args), "model": args.model or "tiny-qwen2 (built)"},
        "vllm_startup_s": vllm_result["startup_s"],
        "rows": rows,
    }
    print(
        f"vLLM engine start: {vllm_result['startup_s']:.1f} s  (load avg {os.getloadavg()[0]:.1f})"
    )
    header = ("prompts", 8), ("samples", 8), ("tokens", 8), ("vLLM tok/s", 11), ("HF tok/s", 10)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'ratio':>6}")
    for r in rows:
        hf_tps = f"{r['hf_tokens_per_s']:10.0f}" if "hf_tokens_per_s" in r else f"{'-':>10}"
        ratio = f"{r['vllm_over_hf']:6.2f}" if "vllm_over_hf" in r else f"{'-':>6}"
        print(
            f"{r['prompts']:8d} {r['samples']:8d} {r['generated_tokens']:8d} "
            f"{r['vllm_tokens_per_s']:11.0f} {hf_tps} {ratio}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(result), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
