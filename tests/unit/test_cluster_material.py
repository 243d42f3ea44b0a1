"""The cluster material (cluster/): Ray's own validator accepts the `ray up` config, the KubeRay
manifest and the image recipe agree with pyproject's pins and with each other.

No Docker here: the image is not built; what it would install is checked instead.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
IMAGE = f"roll-ds:{PYPROJECT['project']['version']}"


def pinned(name: str) -> str:
    """The exact version pyproject pins ``name`` to (``name==X``)."""
    for requirement in PYPROJECT["project"]["dependencies"]:
        match = re.fullmatch(rf"{name}==([\w.]+)", requirement.split("#")[0].strip())
        if match:
            return match.group(1)
    raise AssertionError(f"pyproject pins no {name}==")


def ray_up_configs() -> list[Path]:
    """Every `ray up` config in cluster/ (YAML files with a `provider`)."""
    found = [p for p in CLUSTER.glob("*.yaml") if "provider" in (yaml.safe_load(p.read_text()))]
    assert found, "no ray up config in cluster/"
    return found


@pytest.mark.parametrize("path", ray_up_configs(), ids=lambda p: p.name)
def test_ray_up_config_passes_rays_own_validation(path: Path):
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    # The file as written, against Ray's schema (this is where `min_workers` was refused) ...
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    # ... and the way `ray up` reads it: defaults filled in, then validated.
    prepared = prepare_config(config)
    validate_config(prepared)
    assert prepared["docker"]["image"] == IMAGE


def test_ray_up_config_is_the_16_gpu_example():
    config = yaml.safe_load((CLUSTER / "ray_up.yaml").read_text())
    assert len(config["provider"]["worker_ips"]) + 1 == 2  # num_nodes of the example
    assert config["max_workers"] == len(config["provider"]["worker_ips"])
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all(cmd.split("; ")[-1].startswith("/opt/venv/bin/ray") for cmd in starts)


def manifest() -> dict:
    return yaml.safe_load((CLUSTER / "kuberay_raycluster.yaml").read_text())


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_kuberay_manifest_matches_the_pins_and_the_example():
    doc = manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    assert doc["spec"]["rayVersion"] == pinned("ray")
    assert {c["image"] for c in containers(doc)} == {IMAGE}
    head = doc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # a CPU-only head drives the GPU workers
    (workers,) = doc["spec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2
    (worker,) = workers["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"  # num_gpus_per_node


def dockerfile() -> str:
    return (CLUSTER / "Dockerfile").read_text()


def test_dockerfile_python_fits_pyproject_and_repeats_no_pin():
    text = dockerfile()
    python = re.search(r"^ARG PYTHON_VERSION=([\d.]+)$", text, re.M).group(1)
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert tuple(int(p) for p in python.split(".")) >= (3, 11)  # image_requirements: tomllib
    # Ray, vLLM, torch, DeepSpeed come from pyproject only.
    assert not re.search(r"\b(ray|vllm|torch|deepspeed|transformers)(\[\w+\])?[=<>~]=", text)
    assert "python cluster/image_requirements.py" in text
    assert 'pip install --no-build-isolation -e ".[gpu]"' in text
    assert f"-t {IMAGE} " in text


def test_image_requirements_are_pyprojects():
    out = subprocess.run(
        [sys.executable, str(CLUSTER / "image_requirements.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    gpu = PYPROJECT["project"]["optional-dependencies"]["gpu"]
    vllm = [r for r in gpu if r.startswith("vllm")]
    assert vllm and set(vllm) <= set(out)  # the gpu extra's vLLM range, verbatim
    assert f"ray[default]=={pinned('ray')}" in out
    assert f"deepspeed=={pinned('deepspeed')}" in out
    assert not any(line.startswith("flash") for line in out)  # built after torch, in the image
    kept = [r for r in gpu if not r.startswith("flash")]
    assert len(out) == len(PYPROJECT["project"]["dependencies"]) + len(kept)


def test_one_image_name_everywhere():
    readme = (CLUSTER / "README.md").read_text()
    named = set(re.findall(r"\broll-ds:[\w.]+", readme + dockerfile()))
    for path in (CLUSTER / "ray_up.yaml", CLUSTER / "kuberay_raycluster.yaml"):
        named |= set(re.findall(r"\broll-ds:[\w.]+", path.read_text()))
    assert named == {IMAGE}


def test_dockerignore_keeps_the_venv_out_of_the_build_context():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "output"} <= set(ignored)
