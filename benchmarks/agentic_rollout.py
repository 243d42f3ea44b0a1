"""Agentic rollout speed: episodes/s of the episode runner with every unfinished episode's turn
in one generate call and the environment steps concurrent, against stepping the same episodes
one at a time; and the split between generation and environment time.

    python benchmarks/agentic_rollout.py                       # 32 guess_number episodes
    python benchmarks/agentic_rollout.py --episodes 64 --env calculator --tokens-per-turn 56

One in-process vLLM engine (the ``vllm`` strategy) serves the embedded agent model
(``embedded:tiny-agent``, or ``--model``); environments run in this process's ``EnvHost``
(threads, as in an environment worker). Both modes play the same episodes (same environment
seeds, same per-episode sampling seeds) at temperature 1. Prints a table and writes JSON
(default benchmarks/results/agentic_rollout.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENV_CONFIGS = {"guess_number": {"low": 1, "high": 16}, "calculator": {}}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="embedded:tiny-agent")
    ap.add_argument("--env", default="guess_number", choices=sorted(ENV_CONFIGS))
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--tokens-per-turn", type=int, default=8)
    ap.add_argument("--context", type=int, default=192)
    # vLLM-CPU's default KV block is 128 tokens: an episode's context rarely fills one, so no
    # turn reuses the previous turn's prefix from the cache; 32-token blocks do.
    ap.add_argument("--block-size", type=int, default=32, help="vLLM KV block (CPU default 128)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agentic_rollout.json"))
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from roll_ds.agentic.env_pool import EnvTypeSpec, LocalEnvPool
    from roll_ds.agentic.runner import (
        EpisodeRunner,
        EpisodeSpec,
        TurnLimits,
        episode_metrics,
        one_sample_each,
    )
    from roll_ds.models.shipped import resolve_pretrain
    from strategies.vllm import VllmStrategy

    torch.set_num_threads(1)
    model = resolve_pretrain(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = VllmStrategy(
        model_path=model,
        seed=0,
        strategy_config={
            "enforce_eager": True,
            "max_model_len": args.context,
            "block_size": args.block_size,
        },
        stop_token_ids=[tokenizer.eos_token_id],
    )
    engine.initialize()

    def generate(contexts, max_new_tokens, rows, seed):
        out = engine.generate(
            contexts,
            n=1,
            seed=seed,
            temperature=1.0,
            prompt_indices=rows,
            max_new_tokens_each=max_new_tokens,
        )
        return {"response_ids": out["response_ids"], "rollout_logprobs": out["logprobs"]}

    specs = {"e": EnvTypeSpec(args.env, ENV_CONFIGS[args.env])}
    runner = EpisodeRunner(
        tokenizer=tokenizer,
        pool=LocalEnvPool(specs, step_timeout_s=30),
        generate=one_sample_each(generate),
        limits={"e": TurnLimits(args.max_turns, args.tokens_per_turn)},
        max_context_tokens=args.context,
    )
    episodes = [EpisodeSpec(i, i, "e", 10_000 + i) for i in range(args.episodes)]
    runner.run(episodes[:4], seed=1)  # warm-up

    results = {}
    for mode in ("batched", "one_at_a_time"):
        started = time.perf_counter()
        if mode == "batched":
            played, timings = runner.run(episodes, seed=0)
        else:
            played, timings = [], {"generate_s": 0.0, "env_s": 0.0}
            for spec in episodes:
                one, t = runner.run([spec], seed=0)
                played += one
                timings["generate_s"] += t["generate_s"]
                timings["env_s"] += t["env_s"]
        wall = time.perf_counter() - started
        metrics = episode_metrics(played, "rollout")
        results[mode] = {
            "seconds": wall,
            "episodes_per_s": len(played) / wall,
            "generate_s": timings["generate_s"],
            "env_s": timings["env_s"],
            "success": metrics["rollout/success"],
            "turns_per_episode": metrics["rollout/turns_per_episode"],
        }
    engine.close()
    speedup = results["batched"]["episodes_per_s"] / results["one_at_a_time"]["episodes_per_s"]
    report = {
        "model": args.model,
        "env": args.env,
        "episodes": args.episodes,
        "results": results,
        "batched_over_one_at_a_time": speedup,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_avg": os.getloadavg()[0],
    }
    print(f"{args.episodes} {args.env} episodes, model {args.model}")
    print(f"{'mode':<15} {'s':>7} {'ep/s':>7} {'generate s':>11} {'env s':>7} {'turns':>6}")
    for mode, r in results.items():
        print(
            f"{mode:<15} {r['seconds']:7.2f} {r['episodes_per_s']:7.2f} {r['generate_s']:11.2f} "
            f"{r['env_s']:7.3f} {r['turns_per_episode']:6.2f}"
        )
    print(f"batched / one at a time: {speedup:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from roll_ds.host import with_host  # the host with the figures

    Path(args.out).write_text(json.dumps(with_host(report), indent=2))


if __name__ == "__main__":
    main()
