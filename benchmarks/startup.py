"""The start-up profile of ``run.py``: launch -> first training step, per process and phase,
against the import floor of its heavy libraries measured in the same invocation.

    python benchmarks/startup.py                              # 2 full default runs (40 steps)
    python benchmarks/startup.py --first-step-only --runs 1   # a quick profile (max_steps=1)
    python benchmarks/startup.py --cold                       # run 0 JIT-builds DeepSpeed ops
    python benchmarks/startup.py --config rlvr_lora_zero2 --override seed=1 --out /tmp/s.json

First the floor: a fresh ``python -c "import torch, transformers, deepspeed, ray, vllm"``
timed from the outside, best of ``--floor-repeats``, and each library alone once. Then
``--runs`` sequential runs of ``python run.py --config-name <config> output_dir=<tmp>`` as
subprocesses (the repository root as cwd), each timed from the outside: the wall time to its
exit and to the moment its ``startup.json`` appeared (polled every 0.1 s), next to what the
file says (``roll_ds/pipeline/startup_report.py``: driver phases, each role's ranks' phases and
the libraries they imported, times from the driver process's creation). The full run also
gives the summed ``time/step`` of ``metrics.jsonl`` (so the time outside the steps) and the eval
accuracy rows, which show the results unchanged. ``--cold`` gives the first run an empty
TORCH_EXTENSIONS_DIR, as a fresh clone's first run has (DeepSpeed JIT-builds its ops), and the
later runs the same directory (warm); without it the inherited one is used.

Prints one line per run and the phase breakdown of the last, and writes JSON (default
output/benchmarks/startup.json) with the figures, the compact breakdown of every run and every
run's whole ``startup.json`` under ``profiles``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLOOR_LIBRARIES = ("torch", "transformers", "deepspeed", "ray", "vllm")
STARTUP_FILE = "startup.json"  # roll_ds/pipeline/startup_report.py's STARTUP_FILE
METRICS_FILE = "metrics.jsonl"  # roll_ds/tracking.py's METRICS_FILE
POLL_S = 0.1

# --- pure parts: figures from a startup.json dict and metrics rows -----------------------------


def durations(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each phase with its duration ``s`` (start and end kept, extra fields such as ``roles``
    too)."""
    return [{**p, "s": round(p["end"] - p["start"], 3)} for p in phases]


def slowest_rank(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank whose last phase ends last (the one its role waited for)."""
    return max(ranks, key=lambda r: max((p["end"] for p in r["phases"]), default=0.0))


def roles_up_s(driver: list[dict[str, Any]]) -> float | None:
    """The end of the last ``initialize stage N``: every role is up (None if none was
    recorded)."""
    ends = [p["end"] for p in driver if p["name"].startswith("initialize stage")]
    return max(ends) if ends else None


def role_breakdown(profile: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per role: its slowest rank's phases with durations and the libraries its ranks loaded."""
    out = {}
    for role, ranks in profile.get("roles", {}).items():
        if not ranks:
            continue
        slow = slowest_rank(ranks)
        libraries: list[str] = []
        for rank in ranks:
            libraries += [lib for lib in rank.get("libraries", []) if lib not in libraries]
        out[role] = {
            "ranks": len(ranks),
            "slowest_rank": slow["rank"],
            "phases": durations(slow["phases"]),
            "libraries": libraries,
        }
    return out


def is_accuracy_key(key: str) -> bool:
    return key.startswith("eval/") and key.endswith("accuracy")


def metrics_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """From ``metrics.jsonl`` rows: the number of training steps and their summed ``time/step``,
    ``eval/accuracy`` by step, and the last eval row's accuracy keys (``eval/.../accuracy``)."""
    steps = [r["time/step"] for r in rows if "time/step" in r]
    evals = [r for r in rows if any(is_accuracy_key(k) for k in r)]
    final = evals[-1] if evals else {}
    return {
        "steps": len(steps),
        "steps_s": round(sum(steps), 3),
        "eval_accuracy_by_step": {
            str(int(r["step"])): r["eval/accuracy"] for r in evals if "eval/accuracy" in r
        },
        "final_eval_step": int(final["step"]) if "step" in final else None,
        "final_eval_accuracy": {k: v for k, v in sorted(final.items()) if is_accuracy_key(k)},
    }


def derive(
    profile: dict[str, Any],
    rows: list[dict[str, Any]],
    *,
    wall_s: float,
    floor_s: float | None,
    startup_seen_s: float | None = None,
) -> dict[str, Any]:
    """A run's figures from its startup.json (``profile``), its metrics rows and what was timed
    from the outside (``wall_s`` to its exit, ``startup_seen_s`` until startup.json appeared)."""
    first = profile["launch_to_first_step_s"]
    metrics = metrics_figures(rows)
    return {
        "launch_to_first_step_s": first,
        "ratio_to_import_floor": round(first / floor_s, 2) if floor_s else None,
        "roles_up_s": roles_up_s(profile["driver"]),
        "startup_seen_s": None if startup_seen_s is None else round(startup_seen_s, 3),
        # > 0: the file appeared that long after the first step's end (its write, the 0.1 s
        # poll); < 0: the profile's origin (the OS's process creation time) is early
        "seen_minus_first_step_s": (
            None if startup_seen_s is None else round(startup_seen_s - first, 3)
        ),
        "wall_s": round(wall_s, 3),
        **metrics,
        "outside_steps_s": round(wall_s - metrics["steps_s"], 3),
        "driver": durations(profile["driver"]),
        "roles": role_breakdown(profile),
    }


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def run_table(runs: list[dict[str, Any]], floor_s: float | None) -> list[str]:
    """One line per run: cold/warm, first step, x floor, roles up, wall, steps, outside them."""
    head = (
        f"{'run':>3}  {'ext':<9} {'first step s':>12} {'x floor':>7} {'roles up s':>10} "
        f"{'seen s':>7} {'wall s':>7} {'steps s':>7} {'outside steps s':>15}"
    )
    lines = [f"import floor {_f(floor_s, '.2f')} s", head]
    for r in runs:
        lines.append(
            f"{r['index']:>3}  {r['extensions']:<9} {_f(r['launch_to_first_step_s']):>12} "
            f"{_f(r['ratio_to_import_floor'], '.2f'):>7} {_f(r['roles_up_s']):>10} "
            f"{_f(r['startup_seen_s']):>7} {_f(r['wall_s']):>7} {_f(r['steps_s'], '.2f'):>7} "
            f"{_f(r['outside_steps_s']):>15}"
        )
    return lines


def breakdown_table(run: dict[str, Any]) -> list[str]:
    """The driver's phases, then each role's slowest rank's, with start, end and duration."""

    def line(p: dict[str, Any], indent: str) -> str:
        name = f"{indent}{p['name']}"
        return f"  {name:<34} {p['start']:>7.2f} {p['end']:>7.2f} {p['s']:>7.2f}"

    lines = [f"  {'phase (s from launch)':<34} {'start':>7} {'end':>7} {'s':>7}", "  driver"]
    lines += [line(p, "  ") for p in run["driver"]]
    for role, info in run["roles"].items():
        lines.append(
            f"  {role}[{info['slowest_rank']}] of {info['ranks']}: "
            f"{', '.join(info['libraries']) or 'no heavy library'}"
        )
        lines += [line(p, "  ") for p in info["phases"]]
    return lines


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- the subprocesses ------------------------------------------------------------------------


def time_import(modules: tuple[str, ...], env: dict[str, str]) -> float:
    """Wall seconds of a fresh interpreter importing ``modules``, timed from the outside."""
    code = f"import {', '.join(modules)}" if modules else "pass"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"the import floor needs {', '.join(modules)} importable by {sys.executable}: "
            f"`{code}` failed:\n{done.stderr[-2000:]}"
        )
    return wall


def import_floor(repeats: int, env: dict[str, str]) -> dict[str, Any]:
    together = [time_import(FLOOR_LIBRARIES, env) for _ in range(max(1, repeats))]
    alone = {lib: round(time_import((lib,), env), 3) for lib in FLOOR_LIBRARIES}
    bare = round(time_import((), env), 3)  # the interpreter alone, inside every figure above
    return {
        "command": f'python -c "import {", ".join(FLOOR_LIBRARIES)}"',
        "floor_s": round(min(together), 3),
        "together_s": [round(t, 3) for t in together],
        "alone_s": alone,
        "python_s": bare,
    }


def _stop(proc: subprocess.Popen) -> None:
    """End the run's process group (started by us in its own session) if still alive."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_once(
    command: list[str], env: dict[str, str], out_dir: Path, timeout_s: float
) -> tuple[float, float | None, Path]:
    """Run ``command`` to its exit, logging to ``out_dir/run.log``; returns the wall seconds,
    the seconds until a ``*/startup.json`` appeared under ``out_dir`` and that file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "run.log"
    seen: float | None = None
    with log.open("w") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                if seen is None and any(out_dir.glob(f"*/{STARTUP_FILE}")):
                    seen = time.perf_counter() - start
                if time.perf_counter() - start > timeout_s:
                    raise SystemExit(f"the run passed --timeout {timeout_s:.0f} s; log: {log}")
                time.sleep(POLL_S)
            wall = time.perf_counter() - start
        finally:
            _stop(proc)
    found = sorted(out_dir.glob(f"*/{STARTUP_FILE}"))
    if proc.returncode != 0 or not found:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        why = f"exited {proc.returncode}" if proc.returncode else f"wrote no {STARTUP_FILE}"
        raise SystemExit(f"`{' '.join(command)}` {why}; the end of {log}:\n{tail}")
    return wall, seen, found[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="rlvr_lora_zero3", help="run.py's --config-name")
    ap.add_argument("--runs", type=int, default=2, help="sequential runs of run.py")
    ap.add_argument(
        "--override", action="append", default=[], help="a config override (repeatable)"
    )
    ap.add_argument(
        "--first-step-only", action="store_true", help="max_steps=1: the profile, not the run"
    )
    ap.add_argument(
        "--cold", action="store_true", help="the first run gets an empty TORCH_EXTENSIONS_DIR"
    )
    ap.add_argument("--floor-repeats", type=int, default=2, help="best of N for the import floor")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument(
        "--work-dir", default=None, help="where the runs write (kept); default: a temp dir"
    )
    ap.add_argument("--out", default=str(ROOT / "output" / "benchmarks" / "startup.json"))
    args = ap.parse_args()

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "params": vars(args),
    }
    floor = import_floor(args.floor_repeats, env)
    result["import_floor"] = floor
    alone = ", ".join(f"{lib} {s:.2f}" for lib, s in floor["alone_s"].items())
    print(
        f"import floor: {floor['floor_s']:.2f} s together (best of {floor['together_s']}); "
        f"alone: {alone}; python alone {floor['python_s']:.2f}"
    )

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="startup_"))
    extensions = tempfile.mkdtemp(prefix="torch_ext_") if args.cold else None
    if extensions:
        env["TORCH_EXTENSIONS_DIR"] = extensions
    overrides = [*(["max_steps=1"] if args.first_step_only else []), *args.override]
    runs, profiles = [], []
    try:
        for index in range(args.runs):
            out_dir = work / f"run{index}"
            command = [
                sys.executable,
                "run.py",
                "--config-name",
                args.config,
                f"output_dir={out_dir}",
                *overrides,
            ]
            label = ("cold" if index == 0 else "warm") if args.cold else "inherited"
            wall, seen, path = run_once(command, env, out_dir, args.timeout)
            profile = json.loads(path.read_text())
            rows = read_rows(path.parent / METRICS_FILE)
            run = {
                "index": index,
                "extensions": label,
                "cold": label == "cold",
                "torch_extensions_dir": env.get("TORCH_EXTENSIONS_DIR"),
                "command": command[1:],
                **derive(profile, rows, wall_s=wall, floor_s=floor["floor_s"], startup_seen_s=seen),
            }
            runs.append(run)
            profiles.append(profile)
            print(
                f"run {index} ({label}): first step {run['launch_to_first_step_s']:.1f} s, "
                f"wall {wall:.1f} s"
            )
    finally:
        if extensions:
            shutil.rmtree(extensions, ignore_errors=True)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    result["runs"] = runs
    result["profiles"] = profiles

    print()
    print("\n".join(run_table(runs, floor["floor_s"])))
    if runs:
        last = runs[-1]
        accuracy = " / ".join(f"{v:g}" for v in last["eval_accuracy_by_step"].values())
        print(f"eval/accuracy by step ({', '.join(last['eval_accuracy_by_step'])}): {accuracy}")
        print(f"\nphases of run {last['index']} ({last['extensions']}):")
        print("\n".join(breakdown_table(last)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from roll_ds.host import with_host  # the host with the figures

    out.write_text(json.dumps(with_host(result), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
