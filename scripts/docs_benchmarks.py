"""Render the measured tables of docs/benchmarks.md and README.md from the benchmarks' JSON.

    python scripts/docs_benchmarks.py           # rewrite the generated blocks of both pages
    python scripts/docs_benchmarks.py --check   # exit 1 if one is stale

docs/benchmarks.md (and the README's two tables) is hand-written prose (what ran, where,
when, what it means) with blocks between ``<!-- generated: NAME -->`` and
``<!-- end generated -->``; each block is rendered here from ``benchmarks/results/*.json`` (and
``docs/async_vs_sync.json``, the learning curves ``benchmarks/learning_curves.py`` drew). No
number in a block is typed by hand: ``tests/unit/docs/test_docs_generated.py`` fails while a
block differs from its JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)


def _load(name: str) -> Any:
    path = ROOT / name if "/" in name else RESULTS / f"{name}.json"
    return json.loads(path.read_text())


def _models(name: str) -> dict[str, list[dict]]:
    """A versus_trl JSON's runs by model (its ``host`` record left out)."""
    return {k: v for k, v in _load(name).items() if k != "host"}


def _s(value: float) -> str:
    """Seconds as the tables print them: two decimals, 0 below half a hundredth."""
    return "0" if abs(value) < 0.005 else f"{value:.2f}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- step time versus TRL (benchmarks/versus_trl.py) ------------------------------------------

RUNS = {  # versus_trl's `who` -> (the row's label, its old log-probs cell or None for the number)
    "roll_ds sync": ("ours, sync (the default)", None),
    "roll_ds sync_recompute": (
        "ours, sync, `old_logprobs=recompute` (in the train step)",
        "(in train)",
    ),
    "roll_ds sync_compiled": ("ours, sync, vLLM compiled", None),
    "roll_ds stream2_rollout": ("ours, stream k=2, `old_logprobs=rollout`", None),
    "TRL 2 thread(s)": ("TRL 2 threads", None),
}
VERSUS_TRL = [  # (file, the block's label, labels that differ in this block)
    ("versus_trl_embedded", "embedded (0.43M, ~4 tokens/response)", {}),
    ("versus_trl_20m", "~20M Qwen2 (48 tokens/response)", {}),
    (
        "versus_trl_20m_zero2",
        "~20M, the ZeRO-2 preset",
        {"roll_ds sync": ("ours, sync", None)},
    ),
    (
        "versus_trl_bf16_20m",
        "~20M, bf16 on both sides",
        {
            "roll_ds sync": ("ours, sync (`old_logprobs: auto` recomputes in bf16)", "(in train)"),
            "TRL 2 thread(s)": ("TRL 2 threads, bf16", None),
        },
    ),
]


def versus_trl() -> str:
    rows = []
    for name, block, labels in VERSUS_TRL:
        runs = next(iter(_models(name).values()))
        trl = next(r for r in runs if r.get("engine") == "trl")
        for i, run in enumerate(runs):
            label, old = {**RUNS, **labels}[run["who"]]
            m = run["median_s"]
            if run is trl:
                step = run["step_s"]
                phases = [m["rollout_generate"], m["logprobs"], m["train"]]
                cells = [*map(_s, phases), "-"]
                ratio = ""
            else:
                step = m["step"]
                stream = "stream" in run["who"]
                gen = "(overlapped)" if stream else _s(m["rollout_generate"])
                # runs recorded before the loop timed a stream step's sync as "sync" name it
                # "sync_after"
                sync = m.get("sync_after", m["sync"]) if stream else m["sync"]
                cells = [gen, old or _s(m["logprobs"]), _s(m["train"]), _s(sync)]
                ratio = _x(trl["step_s"] / step).removesuffix("x")
            rows.append([block if i == 0 else "", label, _s(step), " / ".join(cells), ratio])
    return _table(["model", "run", "s/step", "phases", "x vs TRL 2 threads"], rows)


# --- learning curves (benchmarks/learning_curves.py) ------------------------------------------

CURVES = "docs/async_vs_sync.json"
CURVE_LABELS = {
    "sync": "`rlvr_lora_zero3` (the default)",
    "async (max_staleness 1)": "`async_generation.max_staleness=1`",
    "async, rollout log-probs as old": "`max_staleness=1 algorithm.old_logprobs=rollout`",
}


def _curve_rows(variants: list[str]) -> list[list[str]]:
    data = _load(CURVES)
    rows = []
    for variant in variants:
        for i, (seed, curve) in enumerate(zip(data["seeds"], data["curves"][variant], strict=True)):
            values = [v for _, v in curve]
            gain = 100 * (values[-1] - values[0])
            steps = " / ".join(f"{v:g}" for v in values)
            label = CURVE_LABELS[variant] if i == 0 else ""
            rows.append([label, str(seed), steps, f"{gain:+.1f} points"])
    return rows


def learning_default() -> str:
    return _table(
        ["run", "seed", "steps 0 / 10 / 20 / 30 / 40", "gain at step 40"], _curve_rows(["sync"])
    )


def learning_async() -> str:
    data = _load(CURVES)
    return _table(
        ["run", "seed", "steps 0 / 10 / 20 / 30 / 40", "gain at step 40"],
        _curve_rows(list(data["curves"])),
    )


def readme_learning() -> str:
    rows = [row[1:] for row in _curve_rows(["sync"])]
    return _table(["seed", "held-out accuracy, steps 0 / 10 / 20 / 30 / 40", "gain"], rows)


README_SPEED = [  # (file, the row's label)
    ("versus_trl_embedded", "embedded tiny Qwen2 (0.43M), fp32"),
    ("versus_trl_20m", "~20M Qwen2, fp32"),
    ("versus_trl_bf16_20m", "~20M Qwen2, bf16"),
]


def _perf(run: dict) -> tuple[str, str]:
    """The run's train TFLOP/s per rank with its MFU, and its engines' generated tokens per
    second of generation: rlvr_step.py's ``mean_perf``, or "—" in a JSON written before it
    recorded them (the README's command below re-measures)."""
    perf = run.get("mean_perf", {})
    train = f"{perf['tflops']:.3g} ({perf['mfu']:.1%})" if "mfu" in perf else "—"
    generate = f"{perf['generate_tokens_per_s']:.0f}" if "generate_tokens_per_s" in perf else "—"
    return train, generate


def readme_speed() -> str:
    rows = []
    for name, label in README_SPEED:
        runs = {r["who"]: r for r in next(iter(_models(name).values()))}
        trl = runs["TRL 2 thread(s)"]["step_s"]
        sync = runs["roll_ds sync"]["median_s"]["step"]
        stream = runs["roll_ds stream2_rollout"]["median_s"]["step"]
        rows.append(
            [
                label,
                f"{_s(sync)} s ({_x(trl / sync)})",
                f"{_s(stream)} s ({_x(trl / stream)})",
                f"{_s(trl)} s",
                *_perf(runs["roll_ds sync"]),
            ]
        )
    header = [
        "model",
        "roll_ds, default",
        "roll_ds, stream k=2",
        "TRL GRPOTrainer, 2 threads",
        "default: train TFLOP/s per rank (MFU)",
        "default: generated tokens/s",
    ]
    return _table(header, rows)


# --- micro-batches by tokens and packing (benchmarks/train_packing.py) ------------------------


def _speedups(name: str) -> dict[str, str]:
    d = _load(name)["speedups_vs_rows_padded"]
    return {
        k: f"train {_x(v['train_s'])}, log-probs {_x(v['logprobs_s'])}"
        for k, v in d.items()
        if k != "rows_padded"
    }


def _packing_rows(names: list[str], first: Callable[[dict], str]) -> list[list[str]]:
    rows = []
    for name in names:
        s = _speedups(name)
        cells = [s.get(k, "") for k in ("rows_packed", "tokens", "tokens_packed")]
        rows.append([first(_load(name)), *cells])
    return rows


def packing_cpu() -> str:
    names = ["train_packing_b2264", "train_packing_b1132", "train_packing_b566"]
    rows = _packing_rows(names, lambda d: f"{d['budget']}")
    return _table(["budget (tokens)", "packing alone", "budget", "budget + packing"], rows)


def packing_h100() -> str:
    names = ["train_packing_h100", "train_packing_h100_long"]
    first = lambda d: (  # noqa: E731
        f"{d['rows']} rows up to {d['width']} tokens, micro {d['micro']} x {d['accum']}, "
        f"budget {d['budget']}"
    )
    return _table(
        ["batch", "packing alone", "budget", "budget + packing"], _packing_rows(names, first)
    )


# --- LoRA under ZeRO-3 (benchmarks/zero3_frozen_base.py) --------------------------------------

VARIANTS = {
    "zero2": "the ZeRO-2 preset",
    "zero3_partition": "ZeRO-3, base partitioned",
    "zero3_persist": "ZeRO-3, base partitioned, `stage3_param_persistence_threshold: 1e12`",
    "zero3_whole": "ZeRO-3, base whole, adapter at stage 3",
}
ZERO3 = {  # file -> what its `zero3_auto` ran (the shipped preset's auto, as it was then)
    "zero3_frozen_base": "base whole, adapter at stage 3 (before `zero3_adapter_stage`)",
    "zero3_frozen_base_embedded": "",
    "zero3_frozen_base_fp32_16x2": "",
    "zero3_frozen_base_h100": "base whole, adapter at stage 2 (auto is stage 1 now)",
}


def zero3_frozen_base(name: str) -> str:
    d = _load(name)
    s = d["settings"]
    argv = d["argv"][: d["argv"].index("--out")] if "--out" in d["argv"] else d["argv"]
    lines = [
        f"`python benchmarks/zero3_frozen_base.py {' '.join(argv)}`: {s['model']}, {s['dtype']}, "
        f"{s['world_size']} rank(s), LoRA r{s['lora_rank']}, {s['micro_batch']} x {s['accum']} "
        f"rows of {s['seq_len']} tokens per rank, medians of {s['rounds']} rounds x "
        f"{s['repeats']} repeats.",
        "",
    ]
    rows = []
    for variant, r in d["summary"].items():
        label = VARIANTS.get(variant) or f"the preset's auto: {ZERO3[name]}"
        rows.append(
            [
                label,
                _s(r["train_step_s"]),
                _s(r["compute_logprobs_s"]),
                _s(r["cpu_s"]),
                f"{max(r['param_mib_per_rank']):.1f}",
                _x(r["total_vs_zero3_partition"]),
                _x(r["cpu_vs_zero3_partition"]),
            ]
        )
    header = [
        "variant",
        "train step s",
        "log-probs s",
        "CPU s",
        "weights MiB/rank",
        "wall vs partitioned",
        "CPU vs partitioned",
    ]
    return "\n".join(lines) + "\n" + _table(header, rows)


# --- the GPU check (scripts/gpu/check.sh) -----------------------------------------------------

LEARNING_PREFIXES = ("actor/", "rollout/", "eval/")


def gpu_check(d: dict | None = None) -> str:
    """The GPU check's report (``d``, else gpu_check_h200.json); one recorded before the check
    had its "restarted" run renders without it."""
    given = d
    d = d or _load("gpu_check_h200")
    gpu, packages, runs = d["versions"]["gpu"], d["versions"]["packages"], d["rlvr"]["runs"]
    test = d["pytest"]
    # A step whose rollout the last step's evaluation synced for logs no parity of its own.
    parity = max(p.get("sync/parity_max_abs_diff", 0.0) for p in d["rlvr"]["parity"])
    key = "colocation/actor_train_offload_allocated_mib"
    offload = [m[key] for m in d["rlvr"]["memory_mib_per_step"] if key in m]
    eval_acc = [r["eval/accuracy"] for r in d["rlvr"]["learning"] if "eval/accuracy" in r]
    rows = [[st["stage"], str(st["rc"]), f"{st['seconds']} s"] for st in d["stages"]]
    skips = "; ".join(f"{reason} ({n})" for reason, n in test["skip_reasons"].items())
    lines = [
        f"One {gpu['name']} ({gpu['memory_gib']} GiB), torch {packages['torch']}, DeepSpeed "
        f"{packages['deepspeed']}, Ray {packages['ray']}, no vLLM "
        f"(`benchmarks/results/gpu_check_h200.json`).",
        "",
        _table(["stage", "exit", "time"], rows),
        "",
        f"- RLVR run, {runs['steps']} steps, overrides `{' '.join(runs['overrides'])}`: "
        f"{runs['straight']['seconds']:g} s uninterrupted.",
    ]
    if "restarted" in runs:
        lines += _gpu_check_restart(runs["restarted"], d["rlvr"].get("restart"))
    killed, resumed = runs.get("killed", {}), runs.get("resumed", {})
    if "checkpoint" in killed and "seconds" in resumed:
        resume = d["rlvr"]["resume"]
        steps, learned = resume["compared_steps"], _learned(resume)
        lines += [
            f"- A run SIGKILLed (its whole process group) after its `{killed['checkpoint']}` "
            f"checkpoint ({killed['seconds_to_kill']:g} s, {killed['processes_in_tree']} "
            f"processes, {len(killed['outlived_kill'])} outlived the kill) and resumed by hand in "
            f"{resumed['seconds']:g} s.",
            f"- Resumed against uninterrupted, steps {steps[0]}-{steps[-1]}: largest difference "
            f"over {len(learned)} learning and eval metrics {max(learned.values()):g}.",
        ]
    else:
        why = killed.get("skipped") or killed.get("error") or resumed.get("skipped", "not run")
        lines.append(f"- Killed by hand and resumed: not checked ({why}).")
    lines += [
        f"- Parity after each sync: max |delta| {parity:.2g} at most.",
        f"- Trainer offloaded while the rollout generates: {min(offload):.0f}-{max(offload):.0f} "
        f"MiB left allocated on the GPU; eval accuracy at step {runs['steps']}: {eval_acc[-1]:g}.",
        f"- `pytest -m gpu`: {test['passed']} passed, {test['failed']} failed, {test['errors']} "
        f"errors, {test['skipped']} skipped ({skips}).",
    ]
    rerun = RESULTS / "gpu_check_h200_pytest.json"
    if given is None and rerun.is_file():  # `SKIP_RUNS=1 bash scripts/gpu/check.sh` after fixes
        again = json.loads(rerun.read_text())["pytest"]
        lines.append(
            f"- `pytest -m gpu` again after fixing what it found (`SKIP_RUNS=1`, "
            f"`benchmarks/results/gpu_check_h200_pytest.json`): {again['passed']} passed, "
            f"{again['failed']} failed, {again['errors']} errors, {again['skipped']} skipped."
        )
    return "\n".join(lines)


def _learned(diffs: dict) -> dict[str, float]:
    """The largest difference per learning or eval metric (not the phase times or memory)."""
    per_metric = diffs["max_abs_diff_per_metric"]
    return {k: v for k, v in per_metric.items() if k.startswith(LEARNING_PREFIXES)}


def _gpu_check_restart(run: dict, restart: dict | None) -> list[str]:
    if "seconds_to_kill" not in run:
        return [f"- Automatic restart: not checked ({run.get('skipped') or run.get('error')})."]
    faults = run["faults"]
    gpu_after = run["gpu_processes_after"]
    line = (
        f"- The same run, its trainer rank (`{run['killed']['cmdline'].split()[0]}`) SIGKILLed "
        f"after its `{run['checkpoint']}` checkpoint ({run['seconds_to_kill']:g} s): "
        f"{'automatic restart 1 logged' if run['restart_logged'] else 'no restart logged'}, "
        f"exit {run['rc']} after {run['seconds']:g} s; faults/restarts "
        f"{faults.get('faults/restarts', 0):g}, faults/lost_seconds "
        f"{faults.get('faults/lost_seconds', 0):.1f}; {len(run['outlived_run'])} of "
        f"{run['processes_in_tree']} processes outlived the run"
    )
    if run["killed_rank_on_gpu"] is not None:
        line += (
            f"; on the GPU once restarted {len(run['gpu_processes_restarted'])} processes, the "
            f"dead rank {'among them' if run['killed_rank_on_gpu'] else 'not among them'}"
        )
    if gpu_after is not None:
        line += f", after the run {len(gpu_after)}"
    lines = [line + "."]
    if restart and restart["compared_steps"]:
        steps, learned = restart["compared_steps"], _learned(restart)
        lines.append(
            f"- Restarted against uninterrupted, steps {steps[0]}-{steps[-1]}: largest difference "
            f"over {len(learned)} learning and eval metrics {max(learned.values()):g}."
        )
    return lines


# --- the largest model per mode (benchmarks/model_size.py) ----------------------------------


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _proc_label(name: str) -> str:
    """A process's command line as the table names it: the Ray actor's class, or the program."""
    if name.startswith("ray::"):
        return name.split()[0].removeprefix("ray::").split(".")[0]
    return Path(name.split()[0]).name


def model_size() -> str:
    d = _load("model_size")
    rows = []
    for a in d["attempts"]:
        biggest = a["processes"][0] if a["processes"] else {"name": "?", "peak_rss_bytes": 0}
        mfu = a.get("metrics", {}).get("perf/mfu")
        rows.append(
            [
                a["mode"],
                a["size"],
                f"{a['params'] / 1e9:.2f}B",
                "ok" if a["ok"] else f"failed (exit {a['exit_code']})",
                f"{a['step_s']:.0f}" if a.get("step_s") else "-",
                _gib(a["peak_box_used_bytes"]),
                f"{_gib(biggest['peak_rss_bytes'])} ({_proc_label(biggest['name'])})",
                f"{_gib(a['trainer_disk_read_bytes'])} / {_gib(a['trainer_disk_write_bytes'])}",
                f"{mfu:.2f}" if mfu is not None else "-",
            ]
        )
    header = [
        "mode",
        "size",
        "parameters",
        "one RL step",
        "step s",
        "box peak GiB",
        "largest process GiB",
        "trainer disk read / written GiB",
        "MFU",
    ]
    largest = d["largest_params"]
    commands = ", then ".join(f"`{c}`" for c in d["commands"])
    lines = [f"{commands} on {d['box']} (`benchmarks/results/model_size.json`).", ""]
    lines.append(_table(header, rows))
    lines.append("")
    lines.append(
        "Largest completed per mode: "
        + ", ".join(f"{m} {p / 1e9:.2f}B" for m, p in largest.items())
        + "."
    )
    if "zero0_full" in largest and "zero3_nvme_full" in largest:
        ratio = largest["zero3_nvme_full"] / largest["zero0_full"]
        lines.append(f"ZeRO-3 + NVMe trains {ratio:.1f}x the parameters ZeRO-0 does.")
    return "\n".join(lines)


# --- the page ---------------------------------------------------------------------------------

BLOCKS: dict[str, Callable[[], str]] = {
    "versus-trl": versus_trl,
    "learning-default": learning_default,
    "learning-async": learning_async,
    "packing-cpu": packing_cpu,
    "packing-h100": packing_h100,
    "gpu-check": gpu_check,
    "model-size": model_size,
    **{name.replace("_", "-"): (lambda n=name: zero3_frozen_base(n)) for name in ZERO3},
}


PAGES: dict[str, dict[str, Callable[[], str]]] = {
    "docs/benchmarks.md": BLOCKS,
    "README.md": {"readme-learning": readme_learning, "readme-speed": readme_speed},
}


def render_page(page: str, text: str) -> str:
    """``text`` (of ``page``) with every generated block rendered anew; every block the page
    has a generator for must be on it."""
    blocks, found = PAGES[page], []

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in blocks:
            raise ValueError(f"{page}: no generator for block {name!r}")
        found.append(name)
        return f"{match[1]}\n{blocks[name]()}\n\n{match[4]}"

    out = BLOCK.sub(fill, text)
    missing = sorted(set(blocks) - set(found))
    if missing:
        raise ValueError(f"{page} lacks the generated blocks {missing}")
    return out


def stale_pages() -> list[str]:
    """The pages whose generated blocks differ from their JSON."""
    return [p for p in PAGES if render_page(p, (ROOT / p).read_text()) != (ROOT / p).read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for page in stale:
            print(f"{page} is stale: run python scripts/docs_benchmarks.py")
        return 1 if stale else 0
    for page in PAGES:
        path = ROOT / page
        path.write_text(render_page(page, path.read_text()))
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
