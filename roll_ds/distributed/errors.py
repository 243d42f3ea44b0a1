"""Errors of the cluster layer. Each message names what failed, where, and the numbers."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """Base of every cluster-layer error."""


class PlacementError(ClusterError):
    """A placement the Ray cluster cannot satisfy (raised before or instead of waiting forever)."""


class WorkerError(ClusterError):
    """A worker actor of a role died or raised; names role, rank, node and the original error."""

    def __init__(
        self,
        role: str,
        rank: int,
        method: str,
        cause: BaseException,
        *,
        node_id: str | None = None,
        node_ip: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.role = role
        self.rank = rank
        self.method = method
        self.cause = cause
        self.node_id = node_id
        self.node_ip = node_ip
        self.pid = pid
        where = f"node {node_id[:12] if node_id else '?'} ({node_ip or '?'})"
        if pid is not None:
            where += f", pid {pid}"
        original = _original(cause)
        summary = _summary(original)
        detail = str(cause).strip()
        message = f"{role} rank {rank} on {where} failed in {method}(): {type(original).__name__}: "
        message += summary
        if detail and " ".join(detail.split()) != " ".join(summary.split()):
            message += f"\n--- original error ---\n{detail}"
        super().__init__(message)


class WorkerTimeoutError(ClusterError):
    """A call did not finish within its time limit (the workers may still be alive)."""

    def __init__(self, role: str, method: str, ranks: list[int], timeout_s: float) -> None:
        self.role = role
        self.method = method
        self.ranks = ranks
        self.timeout_s = timeout_s
        if method == "__init__":
            why = (
                "not scheduled (resources taken?) or a slow __init__; see `ray status`, or raise "
                "start_timeout_s"
            )
        else:
            why = "alive but slow or stuck; raise the timeout if the work is legitimately long"
        super().__init__(
            f"{role}.{method}(): ranks {ranks} did not answer within {timeout_s:g} s ({why})"
        )


def _original(exc: BaseException) -> BaseException:
    """The user's exception inside a RayTaskError, else ``exc`` itself."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _summary(exc: BaseException, limit: int = 300) -> str:
    """The error's text on one line (Ray's actor-death text spans several), cut to ``limit``."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not text:
        return "(no message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."
