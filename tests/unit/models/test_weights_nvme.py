"""Under ZeRO-Infinity (parameters on NVMe) a weight-sync bucket is gathered a unit at a time:
DeepSpeed swaps each gathered parameter in through one of offload_param.buffer_count buffers,
and gathering a whole bucket of a 3B model at once failed ("Not enough buffers 5 for swapping
6", measured by benchmarks/model_size.py)."""

import contextlib
from types import SimpleNamespace

import torch
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from roll_ds.models import weights
from roll_ds.models.lora import WeightUnit


def _param(location):
    p = torch.nn.Parameter(torch.zeros(2))
    p.ds_tensor = SimpleNamespace(final_location=location)
    return p


def _units(location, n=3):
    units = []
    for i in range(n):
        params = [_param(location), _param(location)]
        units.append(WeightUnit(params, lambda i=i: [(f"w{i}", torch.full((2,), float(i)))], 8))
    return units


def _record(monkeypatch):
    gathers = []

    def gathered(params):
        gathers.append(len(params))
        return contextlib.nullcontext()

    monkeypatch.setattr(weights, "_gathered", gathered)
    return gathers


def test_nvme_parameters_are_gathered_one_unit_at_a_time(monkeypatch):
    gathers = _record(monkeypatch)
    bucket = weights._materialise(_units(OffloadDeviceEnum.nvme))
    assert gathers == [2, 2, 2]
    assert [name for name, _ in bucket] == ["w0", "w1", "w2"]


def test_other_parameters_are_gathered_as_one_bucket(monkeypatch):
    for location in (OffloadDeviceEnum.cpu, OffloadDeviceEnum.none, None):
        gathers = _record(monkeypatch)
        bucket = weights._materialise(_units(location))
        assert gathers == [6], location
        assert [name for name, _ in bucket] == ["w0", "w1", "w2"]


def test_an_adapter_on_nvme_is_gathered_one_parameter_at_a_time(monkeypatch):
    gathers = _record(monkeypatch)
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.ds_tensor = SimpleNamespace(final_location=OffloadDeviceEnum.nvme)
    state = weights.gathered_adapter_state(model)
    assert gathers == [1, 1] and sorted(state) == ["bias", "weight"]
