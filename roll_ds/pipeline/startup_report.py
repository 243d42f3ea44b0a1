"""The start-up profile of a run: from the launch to the end of its first training step, per
process and phase, written to ``<output_dir>/<exp_name>/startup.json`` and summarised in one log
line (``benchmarks/startup.py`` reads the file).

The driver records its phases with ``roll_ds.timeline``; each rank's come back with its start
(``Cluster.infos``: Ray's worker boot and ``__init__``) and its ``initialize`` answer (model
load, DeepSpeed engine, vLLM engine). A rank's ``boot`` starts at its process's creation or at
the moment its role was asked to start, whichever is later: Ray may hand an actor a worker
process it started earlier, idle until then.

The file (times in seconds from the driver process's creation)::

    {"launch_to_first_step_s": 31.2,
     "driver": [{"name": "ray.init", "start": 3.1, "end": 7.9}, ...],
     "roles": {"actor_train": [{"rank": 0, "pid": 123, "libraries": ["torch", ...],
                                "phases": [{"name": "boot", ...}, ...]}, ...], ...}}
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from roll_ds import timeline

logger = logging.getLogger(__name__)

STARTUP_FILE = "startup.json"
_written = False  # once per process: a restarted attempt's start is not the launch's


class StartupReport:
    """Collects the ranks' phases as the roles start; ``write`` adds the driver's."""

    def __init__(self) -> None:
        self.origin = timeline.process_started()
        self.roles: dict[str, dict[int, dict[str, Any]]] = {}
        self.asked: dict[str, float] = {}  # role -> when the driver asked it to start

    def role_asked(self, role: str, at: float) -> None:
        self.asked[role] = at

    def add_ranks(self, role: str, answers: Any) -> None:
        """The ranks' answers of ``role`` (start infos or ``initialize`` results): each may
        carry ``timeline`` (its phases) and ``libraries``."""
        if not isinstance(answers, list):
            return
        for rank, answer in enumerate(answers):
            if not isinstance(answer, dict) or "timeline" not in answer:
                continue
            entry = self.roles.setdefault(role, {}).setdefault(
                rank, {"rank": rank, "pid": answer.get("pid"), "phases": []}
            )
            entry["pid"] = entry["pid"] or answer.get("pid")
            entry["libraries"] = answer.get("libraries", [])
            for p in answer["timeline"]:
                if p["name"] == "boot":  # an idle process Ray handed over: from the ask
                    p = {**p, "start": max(p["start"], self.asked.get(role, p["start"]))}
                entry["phases"].append(p)

    def build(self, end: float) -> dict[str, Any]:
        """The profile up to ``end`` (the first step's end), times from the launch."""

        def rel(p: dict[str, Any]) -> dict[str, Any]:
            start, stop = p["start"] - self.origin, p["end"] - self.origin
            extra = {k: v for k, v in p.items() if k not in ("name", "start", "end")}
            return {"name": p["name"], "start": round(start, 3), "end": round(stop, 3), **extra}

        return {
            "launch_to_first_step_s": round(end - self.origin, 3),
            "driver_pid": os.getpid(),
            "driver": [rel(p) for p in timeline.drain()],
            "roles": {
                role: [
                    {**r, "phases": [rel(p) for p in r["phases"]]} for _, r in sorted(ranks.items())
                ]
                for role, ranks in self.roles.items()
            },
        }

    def write(self, out_dir: Path, end: float) -> dict[str, Any] | None:
        """Write the profile, once per process (a restarted attempt's start is not the
        launch's)."""
        global _written
        if _written:
            return None
        _written = True
        report = self.build(end)
        timeline.stop()  # the later steps' phases are not the start-up's
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{STARTUP_FILE}.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(out_dir / STARTUP_FILE)
        logger.info("start-up: %s (%s)", summary(report), out_dir / STARTUP_FILE)
        return report


def summary(report: dict[str, Any]) -> str:
    """One line: the launch to the first step, the driver's phases, each role's slowest rank."""
    driver = ", ".join(f"{p['name']} {p['end'] - p['start']:.1f}" for p in report["driver"])
    roles = []
    for role, ranks in report["roles"].items():
        slowest = max(ranks, key=lambda r: max((p["end"] for p in r["phases"]), default=0.0))
        parts = ", ".join(f"{p['name']} {p['end'] - p['start']:.1f}" for p in slowest["phases"])
        roles.append(f"{role}[{slowest['rank']}]: {parts}")
    return (
        f"first step done {report['launch_to_first_step_s']:.1f} s after the launch; "
        f"driver: {driver}; " + "; ".join(roles)
    )
