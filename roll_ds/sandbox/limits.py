"""What one run of the sandbox may use (:class:`SandboxLimits`) and the ways it may be isolated
(:data:`NETWORK_ISOLATION`, see :mod:`roll_ds.sandbox.run`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

NETWORK_ISOLATION = ("required", "best_effort", "off")


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-run limits; small defaults because test programs are tiny."""

    timeout_s: float = 5.0  # wall clock of the program (RLIMIT_CPU: this, rounded up)
    memory_mb: int = 512  # RLIMIT_AS (address space; Python itself needs ~30 MB)
    file_size_mb: int = 4  # RLIMIT_FSIZE: largest file the program may write
    max_processes: int = 8  # RLIMIT_NPROC in the user namespace, the program included
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # per stream; more is killed as "output_limit"
    workdir_mb: int = 16  # size of the tmpfs work dir

    def problems(self, prefix: str = "") -> list[str]:
        """Out-of-range values, each naming its field."""
        out = []
        t = self.timeout_s
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and 0 < t <= 3600):
            out.append(f"{prefix}timeout_s: {self.timeout_s!r}; use seconds in (0, 3600]")
        minimum = {"memory_mb": 64, "max_processes": 1, "max_open_files": 16}
        for f in fields(self):
            if f.name == "timeout_s":
                continue
            value, low = getattr(self, f.name), minimum.get(f.name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                out.append(f"{prefix}{f.name}: {value!r}; use an integer >= {low}")
        return out
