"""The Python half of scripts/gpu/check.sh (which calls it; see that file's header).

    python scripts/gpu/check.py versions WORK          WORK/versions.json: python, packages, GPU
    python scripts/gpu/check.py runs WORK [--only A,B] [--steps N --save-steps K]
            [--run-timeout S] [--deadline EPOCH_S] [--override X=Y ...]
        RLVR runs of the embedded default with scripts/gpu/run_overrides.txt, under WORK/runs/,
        in this order (--only: some of them; each call adds to WORK/runs.json):
          straight   uninterrupted
          restarted  the same, its trainer's one rank (the ray::ActorTrainWorker process)
                     SIGKILLed once its first checkpoint is complete; the run restarts itself
                     from it (fault_tolerance.max_trainer_restarts) and ends by itself
          killed     SIGKILL to its whole process group once its first checkpoint is complete
          resumed    resume_from_checkpoint=latest by hand in the killed run's folder
        A run that would not end by --deadline (its time estimated from the straight run's) is
        skipped with the reason; logs WORK/run_<name>.log, outcomes WORK/runs.json
    python scripts/gpu/check.py report WORK OUT_JSON   everything above and the pytest junit XML
        (WORK/pytest.xml), stage results (WORK/stages.txt) and the nccl stage's WORK/nccl.json
        (scripts/gpu/nccl_check.py) in one JSON

Only the standard library (and psutil where present): the report must come out even when the
packages under test fail to import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = "rlvr_lora_zero3"
OVERRIDES_FILE = Path(__file__).with_name("run_overrides.txt")
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "ray",
    "deepspeed",
    "hydra-core",
    "omegaconf",
    "pydantic",
    "math-verify",
    "jsonschema",
    "numpy",
    "vllm",
    "flash-attn",
    "pytest",
)
# Differ between two runs of the same steps by nature (wall clock, and the throughput, FLOP/s and
# MFU derived from it), under any role's prefix (critic/perf/mfu); everything else should not.
# As tests/integration/_pipeline_run.py's.
VOLATILE_SECTIONS = ("time", "throughput", "perf")
VOLATILE_WORDS = ("seconds", "gbps")
RESUME_RTOL, RESUME_ATOL = 1e-5, 1e-6  # what the CPU resume tests allow


# --- versions -----------------------------------------------------------------------------


def versions() -> dict:
    from importlib import metadata

    out: dict = {"python": sys.version.split()[0], "executable": sys.executable, "packages": {}}
    for name in PACKAGES:
        try:
            out["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out["packages"][name] = None
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = {
                "name": props.name,
                "count": torch.cuda.device_count(),
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
            }
    except Exception as exc:  # report what broke, keep going
        out["torch_error"] = repr(exc)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvidia_smi"] = repr(exc)
    return out


# --- the runs -----------------------------------------------------------------------------


def run_overrides() -> list[str]:
    lines = OVERRIDES_FILE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def command(out_dir: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        "run.py",
        "--config-name",
        CONFIG,
        f"output_dir={out_dir}",
        *run_overrides(),
        f"max_steps={args.steps}",
        f"save_steps={args.save_steps}",
        *args.override,
        *extra,
    ]


_running: list[subprocess.Popen] = []  # the run in progress, for the SIGTERM handler


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """``cmd`` in a session (and process group) of its own, output to ``log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    _running[:] = [proc]
    return proc


def _terminated(signum: int, frame: object) -> None:
    """check.sh's `timeout` ended this stage: the run in progress, in a session of its own,
    would outlive it; kill its tree first."""
    for proc in _running:
        if proc.poll() is None:
            kill_tree(proc, grace_s=2.0)
    sys.exit(128 + signum)


def finish(proc: subprocess.Popen, timeout_s: float) -> dict:
    started = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        killed = kill_tree(proc)
        return {"rc": None, "timed_out": True, "seconds": timeout_s, **killed}
    return {"rc": rc, "timed_out": False, "seconds": round(time.monotonic() - started, 1)}


def descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # no psutil, or the process is gone
        return []


def kill_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> dict:
    """SIGKILL to ``proc``'s process group (kill -9 -PGID), then wait up to ``grace_s`` for
    every process it had started; what outlives the group (started in a session of its own)
    is reported and killed by its pid."""
    tree = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return {"processes_in_tree": len(tree), "outlived_kill": reap(tree, grace_s)}


def reap(processes: list, grace_s: float) -> list[str]:
    """Wait up to ``grace_s`` for ``processes`` (psutil's) to end; kill those still alive and
    return their command lines."""
    deadline = time.monotonic() + grace_s
    alive = [p for p in processes if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _alive(p)]
    outlived = []
    for p in alive:
        outlived.append(_cmdline(p)[:160])
        with contextlib.suppress(Exception):  # gone meanwhile
            p.kill()
    return outlived


def _alive(process: object) -> bool:
    try:
        return process.is_running() and process.status() != "zombie"
    except Exception:  # psutil.NoSuchProcess: gone meanwhile
        return False


def gpu_processes() -> list[dict] | None:
    """The processes on the GPU (nvidia-smi's compute apps, memory in MiB); None without
    nvidia-smi (CPU)."""
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if smi.returncode != 0:
        return None
    out = []
    for line in smi.stdout.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit():
            out.append({"pid": int(pid), "used": used.strip()})
    return out


def first_checkpoint(proc: subprocess.Popen, out: Path, timeout_s: float) -> dict:
    """Wait until ``checkpoints/latest`` names a complete checkpoint (the pipeline writes it
    last); {} then, else what went wrong (the run is killed if still going)."""
    latest = out / CONFIG / "checkpoints" / "latest"
    started = time.monotonic()
    while not latest.exists():
        if proc.poll() is not None:
            return {"rc": proc.returncode, "error": "ended before its first checkpoint"}
        if time.monotonic() - started > timeout_s:
            return {"timed_out": True, **kill_tree(proc)}
        time.sleep(0.2)
    return {}


def run_straight(work: Path, args: argparse.Namespace, timeout_s: float) -> dict:
    out = work / "runs" / "straight"
    proc = start(command(out, args), work / "run_straight.log")
    return finish(proc, timeout_s)


def run_restarted(work: Path, args: argparse.Namespace, timeout_s: float) -> dict:
    """The straight run again, its trainer's one rank (the ``ray::ActorTrainWorker`` process
    among the run's descendants: the raylet the driver starts is its parent) SIGKILLed once the
    first checkpoint is complete. The driver must tear every role down (on a GPU: the NCCL
    group and the CUDA memory of the dead rank's peers), start them again, resume from the
    checkpoint and end with rc 0 by itself. Also recorded: the processes on the GPU once the
    restarted attempt logs its first step (the dead rank's must not be among them), and every
    process the run started that outlived it."""
    out = work / "runs" / "restarted"
    log = work / "run_restarted.log"
    proc = start(command(out, args), log)
    started = time.monotonic()
    failed = first_checkpoint(proc, out, timeout_s)
    if failed:
        return failed
    seconds_to_kill = round(time.monotonic() - started, 1)
    checkpoint = (out / CONFIG / "checkpoints" / "latest").read_text().strip()
    ranks = [p for p in descendants(proc.pid) if "ray::ActorTrainWorker" in _cmdline(p)]
    if not ranks:
        return {"error": "no ray::ActorTrainWorker process under the run", **kill_tree(proc)}
    victim = ranks[-1]
    killed = {"pid": victim.pid, "cmdline": _cmdline(victim)[:160]}
    victim.kill()
    seen = {p.pid: p for p in descendants(proc.pid)}  # every process the run starts, for leaks
    metrics_file = out / CONFIG / "metrics.jsonl"
    gpu_restarted, looked = None, False
    while proc.poll() is None:
        if time.monotonic() - started > timeout_s:
            return {"timed_out": True, "seconds": timeout_s, "killed": killed, **kill_tree(proc)}
        seen |= {p.pid: p for p in descendants(proc.pid)}
        # The first row the restarted attempt logs (a line may be half written: no parsing)
        if not looked and metrics_file.is_file() and "faults/restarts" in metrics_file.read_text():
            gpu_restarted, looked = gpu_processes(), True
        time.sleep(1.0)
    seconds = round(time.monotonic() - started, 1)
    outlived = reap([p for p in seen.values() if p.pid != victim.pid], grace_s=10.0)
    rows = [r for r in read_jsonl(metrics_file) if "faults/restarts" in r]
    text = log.read_text(errors="replace")
    gpu_after = gpu_processes()
    return {
        "rc": proc.returncode,
        "timed_out": False,
        "seconds": seconds,
        "checkpoint": checkpoint,  # the one the run restarted from
        "seconds_to_kill": seconds_to_kill,
        "killed": killed,
        "restart_logged": "automatic restart 1 of" in text,
        "faults": {k: v for k, v in rows[-1].items() if k.startswith("faults/")} if rows else {},
        "first_restarted_step": rows[0]["step"] if rows else None,
        "processes_in_tree": len(seen),
        "outlived_run": outlived,
        "gpu_processes_restarted": gpu_restarted,
        "killed_rank_on_gpu": (
            None if gpu_restarted is None else any(g["pid"] == victim.pid for g in gpu_restarted)
        ),
        "gpu_processes_after": gpu_after,
    }


def _cmdline(process: object) -> str:
    try:  # a Ray worker's title is padded with spaces
        return " ".join(" ".join(process.cmdline()).split())
    except Exception:  # gone meanwhile
        return ""


def run_killed(work: Path, args: argparse.Namespace, timeout_s: float) -> dict:
    """Start a run and SIGKILL its process group once its first checkpoint is complete."""
    out = work / "runs" / "resume"
    proc = start(command(out, args), work / "run_killed.log")
    started = time.monotonic()
    failed = first_checkpoint(proc, out, timeout_s)
    if failed:
        return failed
    seconds = round(time.monotonic() - started, 1)
    killed = kill_tree(proc)
    latest = out / CONFIG / "checkpoints" / "latest"
    return {"checkpoint": latest.read_text().strip(), "seconds_to_kill": seconds, **killed}


def run_resumed(work: Path, args: argparse.Namespace, timeout_s: float) -> dict:
    out = work / "runs" / "resume"
    cmd = command(out, args, "resume_from_checkpoint=latest")
    return finish(start(cmd, work / "run_resumed.log"), timeout_s)


# In this order; each run's time as a multiple of the straight run's, measured (CPU, 4 steps,
# save at 2: docs/cluster.md; H200, 10 steps, save at 5: the killed and resumed runs of
# benchmarks/results/gpu_check_h200.json), rounded up: a run is skipped when less than that is
# left before --deadline, and may take that multiple of --run-timeout.
RUNS = {
    "straight": (run_straight, 1.0),
    "restarted": (run_restarted, 1.5),
    "killed": (run_killed, 0.8),
    "resumed": (run_resumed, 0.8),
}


def runs(work: Path, args: argparse.Namespace) -> dict:
    """The runs of ``args.only``, one after the other, added to WORK/runs.json (the straight
    run first: its metrics are the timings reported); each is bounded, and a failure does not
    stop the next."""
    runs_file = work / "runs.json"
    results: dict = json.loads(runs_file.read_text()) if runs_file.is_file() else {}
    results |= {"overrides": run_overrides() + list(args.override), "steps": args.steps}
    straight = results.get("straight", {})
    straight_s = straight.get("seconds") if straight.get("rc") == 0 else None
    for name in [n for n in RUNS if n in args.only]:
        fn, factor = RUNS[name]
        skipped = skip_reason(name, results, factor * straight_s if straight_s else 0.0, args)
        if skipped:
            results[name] = {"skipped": skipped}
        else:
            timeout_s = args.run_timeout * factor
            if args.deadline is not None:
                timeout_s = min(timeout_s, args.deadline - time.time())
            print(f"check.py: run {name} (at most {timeout_s:.0f} s) ...", flush=True)
            try:
                results[name] = fn(work, args, timeout_s)
            except Exception as exc:
                results[name] = {"error": repr(exc)}
                for proc in _running:  # what the run started must not outlive its error
                    if proc.poll() is None:
                        kill_tree(proc, grace_s=2.0)
        if name == "straight":
            straight_s = results[name].get("seconds") if results[name].get("rc") == 0 else None
        print(f"check.py: run {name}: {results[name]}", flush=True)
        runs_file.write_text(json.dumps(results, indent=1))
    return results


def skip_reason(name: str, results: dict, need_s: float, args: argparse.Namespace) -> str | None:
    """Why run ``name`` is not started (it needs about ``need_s``), or None."""
    if name == "resumed" and "checkpoint" not in results.get("killed", {}):
        why = "skipped" if "skipped" in results.get("killed", {}) else "left no checkpoint"
        return f"the killed run {why}"
    if args.deadline is None:
        return None
    left = args.deadline - time.time()
    if left >= max(need_s, 10.0):
        return None
    if not need_s:  # no straight run to estimate from
        return f"{left:.0f} s left of the check's budget"
    straight_s = results["straight"]["seconds"]
    return (
        f"{left:.0f} s left of the check's budget; this run takes about {need_s:.0f} s "
        f"({RUNS[name][1]:g} x the straight run's {straight_s} s)"
    )


def runs_ok(done: dict, names: list[str]) -> bool:
    """Every run of ``names`` that was not skipped for time did what it checks."""
    checks = {
        "straight": lambda r: r.get("rc") == 0,
        "restarted": lambda r: r.get("rc") == 0 and r.get("restart_logged") is True,
        "killed": lambda r: "checkpoint" in r,
        "resumed": lambda r: r.get("rc") == 0,
    }
    return all("skipped" in done[n] or checks[n](done[n]) for n in names)


# --- the report ---------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pytest_summary(xml_path: Path) -> dict:
    """Counts, the failures' names and messages, and the skips grouped by reason."""
    if not xml_path.is_file():
        return {"error": f"no {xml_path.name} (pytest did not finish?)"}
    root = ET.parse(xml_path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = (outcome.get("message") or "").strip()
            if reason == "collection skipped":  # a module's importorskip: the why is in the text
                why = (outcome.text or "").rpartition("Skipped: ")[2].strip()
                why = why.removesuffix('")').removesuffix("')")
                reason = f"module skipped: {why}"
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            message = (outcome.get("message") or outcome.text or "").strip()
            failures.append({"test": name, "kind": outcome.tag, "message": message[:600]})
    seconds = sum(float(s.get("time", 0)) for s in root.iter("testsuite"))
    return {**counts, "seconds": round(seconds, 1), "failures": failures, "skip_reasons": skips}


def is_volatile(key: str) -> bool:
    sections = key.split("/")[:-1]
    return any(s in VOLATILE_SECTIONS for s in sections) or any(w in key for w in VOLATILE_WORDS)


def step_table(rows: list[dict], prefixes: tuple[str, ...]) -> list[dict]:
    return [
        {"step": r["step"], **{k: v for k, v in sorted(r.items()) if k.startswith(prefixes)}}
        for r in rows
        if r.get("step", 0) > 0
    ]


def resume_diffs(resumed: list[dict], straight: list[dict], after_step: int) -> dict:
    """Per metric, the largest |resumed - straight| over the steps after the checkpoint; the
    metrics beyond the CPU tests' tolerance listed apart (wall-clock ones are not compared)."""
    got = {r["step"]: r for r in resumed}
    want = {r["step"]: r for r in straight}
    steps = sorted(s for s in want if s > after_step)
    per_metric: dict[str, float] = {}
    beyond, missing = [], []
    for step in steps:
        if step not in got:
            missing.append(f"step {step}")
            continue
        for key, value in want[step].items():
            if key == "step" or is_volatile(key):
                continue
            if key not in got[step]:
                missing.append(f"{key}@{step}")
                continue
            diff = abs(got[step][key] - value)
            if math.isnan(diff):
                diff = 0.0 if math.isnan(got[step][key]) and math.isnan(value) else math.inf
            per_metric[key] = max(per_metric.get(key, 0.0), diff)
            if diff > RESUME_ATOL + RESUME_RTOL * abs(value):
                beyond.append(
                    {"step": step, "metric": key, "resumed": got[step][key], "straight": value}
                )
    return {
        "compared_steps": steps,
        "max_abs_diff_per_metric": dict(sorted(per_metric.items())),
        "beyond_tolerance": beyond,
        "tolerance": {"rel": RESUME_RTOL, "abs": RESUME_ATOL},
        "missing": missing,
    }


def memory_trace(trace: list[dict]) -> list[dict]:
    """The trace entries that carry memory figures (GPU runs): the first two steps and the
    start-up, which repeat every step after."""
    return [e for e in trace if "memory_mib" in e and (e["step"] is None or e["step"] < 2)]


def run_report(work: Path) -> dict:
    runs_file = work / "runs.json"
    outcome = json.loads(runs_file.read_text()) if runs_file.is_file() else {}
    if outcome:  # a run whose stage never started check.py (no time left) says so too
        for name in RUNS:
            outcome.setdefault(name, {"skipped": "its stage did not start: no time left"})
    exp = Path(CONFIG)
    straight = read_jsonl(work / "runs" / "straight" / exp / "metrics.jsonl")
    resumed = read_jsonl(work / "runs" / "resume" / exp / "metrics.jsonl")
    restarted = read_jsonl(work / "runs" / "restarted" / exp / "metrics.jsonl")
    trace = read_jsonl(work / "runs" / "straight" / exp / "colocation_trace.jsonl")
    report: dict = {
        "runs": outcome,
        "phase_seconds": step_table(straight, ("time/", "colocation/seconds")),
        "memory_mib_per_step": step_table(straight, ("colocation/actor",)),
        "memory_mib_trace": memory_trace(trace),
        "parity": step_table(straight, ("sync/parity_", "rollout/mismatch")),
        "learning": step_table(straight, ("rollout/score", "eval/accuracy", "actor/pg_loss")),
    }
    # The by-hand resume and the automatic restart, each against the uninterrupted run over the
    # steps after the checkpoint it went on from (faults/* are the restarted run's alone).
    for key, name, rows in (("resume", "killed", resumed), ("restart", "restarted", restarted)):
        checkpoint = outcome.get(name, {}).get("checkpoint", "")
        if checkpoint.startswith("step_") and rows:
            after = int(checkpoint.removeprefix("step_"))
            report[key] = {"checkpoint": checkpoint, **resume_diffs(rows, straight, after)}
    return report


def stages(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        name, rc, seconds = line.split()
        out.append({"stage": name, "rc": int(rc), "seconds": int(seconds)})
    return out


def report(work: Path, out_json: Path) -> dict:
    versions_file = work / "versions.json"
    result = {
        "versions": json.loads(versions_file.read_text()) if versions_file.is_file() else None,
        "stages": stages(work / "stages.txt"),
        "pytest": pytest_summary(work / "pytest.xml"),
    }
    nccl = work / "nccl.json"  # scripts/gpu/nccl_check.py's stage
    result["nccl"] = json.loads(nccl.read_text()) if nccl.is_file() else None
    try:
        result["rlvr"] = run_report(work)
    except Exception as exc:  # the rest of the report still comes back
        result["rlvr"] = {"error": repr(exc)}
    out_json.write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("versions").add_argument("work", type=Path)
    p = sub.add_parser("runs")
    p.add_argument("work", type=Path)
    p.add_argument(
        "--only",
        type=lambda v: [n for n in v.split(",") if n],
        default=list(RUNS),
        help=f"comma-separated, of {','.join(RUNS)} (in that order)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--run-timeout", type=float, default=150.0, help="seconds per run")
    p.add_argument(
        "--deadline", type=float, help="time.time() by which every run must end; skip the rest"
    )
    p.add_argument("--override", action="append", default=[], help="one more run.py override")
    p = sub.add_parser("report")
    p.add_argument("work", type=Path)
    p.add_argument("out_json", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.what == "versions":
        found = versions()
        (args.work / "versions.json").write_text(json.dumps(found, indent=1))
        print(json.dumps(found, indent=1))
    elif args.what == "runs":
        signal.signal(signal.SIGTERM, _terminated)
        unknown = sorted(set(args.only) - set(RUNS))
        if unknown:
            parser.error(f"--only: no run {unknown}; the runs are {', '.join(RUNS)}")
        done = runs(args.work, args)
        return 0 if runs_ok(done, args.only) else 1
    else:
        found = report(args.work, args.out_json)
        print(json.dumps({k: found[k] for k in ("stages", "pytest")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
