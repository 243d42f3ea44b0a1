#!/usr/bin/env bash
# Fill .gpu_carry/ with what the lent GPU machine needs to run roll_ds and its image lacks.
#
# Run HERE, on a CPU box with network to PyPI (the device machine reaches no network):
#
#     bash scripts/gpu/carry.sh                       # CPython 3.12 (the device's python3)
#     bash scripts/gpu/carry.sh --python-version 3.11 --out /tmp/carry311   # a variant to test
#
# The device image (/work/.library/device/KINDS.md) has torch 2.11 (cu130), transformers,
# peft, accelerate, numpy, msgpack, tensorboard, matplotlib, rich, tqdm, pytest, ninja, nvcc,
# aiohttp, psutil, py-cpuinfo, einops, pyyaml, requests, protobuf, click, filelock, attrs,
# sympy, pyarrow; it has no Ray, DeepSpeed, vLLM, Hydra/OmegaConf, pydantic, jsonschema,
# math-verify. What travels (a call carries at most 64 MiB, the repo ~9 MB of it):
#
#   .gpu_carry/wheels/*.whl   pip download --only-binary for cpXY manylinux x86_64 (pure or
#                             binary), plus wheels built here from the sdist-only packages
#                             (deepspeed, antlr4-python3-runtime); versions pinned to the ones the
#                             CPU tests run with
#   .gpu_carry/ray-<v>-cpXY.tar.xz   Ray's wheel unpacked, without what roll_ds never imports
#                             (Java jars, RLlib, Serve, Data, Train, Tune, AIR, LLM, the
#                             dashboard's web client): its 79 MB wheel alone is too big to carry
#   .gpu_carry/MANIFEST       the python tag, the files and the total size
#
# scripts/gpu/install_carry.sh installs the lot into a site directory (check.sh calls it on the
# device). Options: --python-version X.Y (default 3.12), --out DIR (default .gpu_carry), and
# PYTHON=... for the interpreter whose pip downloads and builds (default python3).
set -euo pipefail

PY_VERSION=3.12
OUT=.gpu_carry
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) PY_VERSION=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -e/p' "$0" | sed 's/^# \{0,1\}//;/^set -e/d'; exit 0 ;;
        *) echo "carry.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
PYTHON=${PYTHON:-python3}
TAG=cp${PY_VERSION/./}
RAY_VERSION=2.60.0

# Binary or pure wheels from PyPI (NAME==VERSION). Their own needs that the image already has
# (click, filelock, msgpack, packaging, protobuf, pyyaml, requests, attrs, sympy, einops, psutil,
# py-cpuinfo, ninja, numpy, tqdm, nvidia-ml-py, torch) stay behind. typing_extensions rides along
# because pydantic 2.14 needs a recent one and the image's version is not known here.
WHEELS=(
    hjson==3.1.0                        # deepspeed
    pydantic==2.14.4                    # deepspeed's config models
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    hydra-core==1.3.8                   # run.py's config composition
    omegaconf==2.3.1
    math-verify==0.9.0                  # the math_rule reward
    latex2sympy2_extended==1.11.0
    jsonschema==4.26.0                  # Ray validates runtime_env and placement specs with it
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==2026.9.1
)
# sdist-only on PyPI: built into (pure-python) wheels here. DeepSpeed without its ops
# (DS_BUILD_OPS=0): on the GPU they JIT-build with nvcc when a config asks for one.
SDISTS=(
    deepspeed==0.19.8
    antlr4-python3-runtime==4.9.3       # hydra-core 1.3 pins 4.9.*
)
# Parts of Ray roll_ds never imports (ray.init(include_dashboard=False), actors, placement
# groups, ray.util, cluster_utils and runtime_env env_vars keep working without them: tested by
# scripts/gpu/test_carry.sh). Kept: core/ (gcs_server, raylet), _raylet.so, _private/ with the
# runtime-env agent and its vendored aiohttp (the raylet starts that agent), autoscaler/,
# dashboard/ (the agent's modules; only the web client goes), util/, experimental/, widgets/
# (ray._private.worker imports it), dist-info.
RAY_DROP=(jars rllib serve data train tune air llm workflow dashboard/client)

PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

echo "carry.sh: $TAG manylinux x86_64 into $OUT (pip of $($PYTHON -m pip --version | cut -d' ' -f1-2))"
rm -rf "$OUT"
mkdir -p "$OUT/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# pip, without the warnings about this box's missing local index folders
pip_quiet() { "$PYTHON" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }

pip_quiet download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORMS[@]}" -d "$OUT/wheels" "${WHEELS[@]}"
DS_BUILD_OPS=0 pip_quiet wheel -q --no-deps -w "$OUT/wheels" "${SDISTS[@]}"
for spec in "${WHEELS[@]}" "${SDISTS[@]}"; do   # every pin arrived, once
    name=${spec%%==*}
    pattern=$(echo "$name" | tr 'A-Z-' 'a-z_')
    found=$(find "$OUT/wheels" -maxdepth 1 -iname "${pattern}-*.whl" | wc -l)
    [ "$found" -eq 1 ] || { echo "carry.sh: $found wheels for $spec" >&2; exit 1; }
done

# Ray: the wheel unpacked, pruned, repacked as one xz tarball that unpacks into a site dir.
pip_quiet download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORMS[@]}" -d "$work" "ray==$RAY_VERSION"
ray_wheel=$(ls "$work"/ray-"$RAY_VERSION"-"$TAG"-*.whl)
mkdir "$work/ray"
"$PYTHON" - "$ray_wheel" "$work/ray" <<'EOF'
import os, sys, zipfile  # unzip keeping the modes (gcs_server, raylet must stay executable)

with zipfile.ZipFile(sys.argv[1]) as wheel:
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        if info.external_attr >> 16 & 0o777:
            os.chmod(path, info.external_attr >> 16 & 0o777)
EOF
for part in "${RAY_DROP[@]}"; do
    [ -e "$work/ray/ray/$part" ] || { echo "carry.sh: ray/$part not in the wheel" >&2; exit 1; }
    rm -rf "$work/ray/ray/$part"
done
find "$work/ray" -name __pycache__ -prune -exec rm -rf {} +
ray_tar="$OUT/ray-$RAY_VERSION-$TAG.tar.xz"
tar -C "$work/ray" -cf - ray "ray-$RAY_VERSION.dist-info" | xz -T0 -9 > "$ray_tar"
echo "ray: wheel $(du -m "$ray_wheel" | cut -f1) MB, unpacked without ${RAY_DROP[*]}:" \
    "$(du -sm "$work/ray" | cut -f1) MB, tarball $(du -m "$ray_tar" | cut -f1) MB"

{
    echo "python_tag $TAG"
    echo "ray $RAY_VERSION dropped: ${RAY_DROP[*]}"
    (cd "$OUT" && find . -type f ! -name MANIFEST -printf '%s %P\n' | sort -k2)
} > "$OUT/MANIFEST"
total=$(du -sb "$OUT" | cut -f1)
echo "carry.sh: $(ls "$OUT/wheels" | wc -l) wheels + ray tarball, total $((total / 1024)) KiB" \
    "($(awk "BEGIN {printf \"%.1f\", $total / 1048576}") MiB of the 64 MiB a call carries)"
