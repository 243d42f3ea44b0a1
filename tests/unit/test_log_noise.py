"""roll_ds.log_noise drops exactly the listed harmless lines, and they still exist in vLLM."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path

import pytest

from roll_ds import log_noise


def test_torch_deprecations_are_ignored_other_future_warnings_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_noise.quiet_warnings()
        warnings.warn(
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...",
            FutureWarning,
            stacklevel=1,
        )
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("`some.other.api` is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`some.other.api` is deprecated"]


@pytest.fixture
def captured():
    """Records reaching a handler on each noisy vLLM logger; filters removed afterwards."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    loggers = [logging.getLogger(name) for name in log_noise.VLLM_HARMLESS]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)
        for f in [f for f in logger.filters if isinstance(f, log_noise._DropMessages)]:
            logger.removeFilter(f)


def test_vllm_harmless_records_are_dropped_others_kept(captured):
    log_noise.quiet_vllm()
    log_noise.quiet_vllm()  # idempotent: one filter per logger
    for name in log_noise.VLLM_HARMLESS:
        assert (
            sum(isinstance(f, log_noise._DropMessages) for f in logging.getLogger(name).filters)
            == 1
        )
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
    layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real failure
    renderer = logging.getLogger("vllm.renderers.base")
    renderer.warning("Chat template warmup failed")
    renderer.warning("Using None for EOS token id because tokenizer is not initialized")
    renderer.warning("something else")
    assert [r.getMessage() for r in captured] == [
        "QKVParallelLinear: Failed to load weights",
        "something else",
    ]


def test_silenced_messages_still_exist_in_the_installed_vllm():
    """If a vLLM upgrade moves or rewords one, this names it (the filter would be dead code)."""
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    for module, messages in log_noise.VLLM_HARMLESS.items():
        path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
        assert path.is_file(), f"{module} is gone from vllm"
        source = path.read_text()
        for message in messages:
            needle = message.removeprefix("RotaryEmbedding: ")  # formatted with %s there
            assert needle in source, f"{module} no longer logs {message!r}"
