#!/usr/bin/env bash
# Set up (if needed) and run the checks CI runs: ruff lint + format check, the docs build, then
# pytest.
#
#   bash scripts/test.sh                  # unit + integration tests (what CI runs)
#   bash scripts/test.sh -m "not integration"   # extra arguments go to pytest
#   ROLL_DS_SLOW=1 bash scripts/test.sh   # also the slow end-to-end tests
#   bash scripts/test.sh -m gpu           # every GPU test, on a CUDA machine (docs/cluster.md)
#
# Selecting the gpu marker (`-m gpu`, `-m "gpu and not slow"`) on a machine with an NVIDIA GPU
# sets up the GPU flavour (scripts/setup.sh gpu: upstream vLLM); anything else, and any machine
# without one, the CPU flavour, where the GPU tests skip, each with its reason.
# ROLL_DS_FLAVOUR=cpu|gpu overrides.
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=cpu
prev=
for arg in "$@"; do
  case "$prev|$arg" in
    -m\|*gpu*|*\|-m*gpu*) [[ $arg == *"not gpu"* ]] || flavour=gpu ;;
  esac
  prev=$arg
done
if [ "$flavour" = gpu ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "roll_ds: no NVIDIA GPU here; the GPU tests will skip (CPU environment kept)"
  flavour=cpu
fi
flavour="${ROLL_DS_FLAVOUR:-$flavour}"
venv="${ROLL_DS_VENV:-.venv}"
# DeepSpeed's JIT-built ops (deepspeed_shm_comm at every trainer start, cpu_adam, ...) cached with
# the venv they are built against. In the shared default cache a build records its venv's paths,
# so two checkouts' venvs on one machine rebuild each op whenever the other used it last: the
# ninja logs there showed cpu_adam rebuilt 9 times, 60-260 s each, alternating between 3 venvs,
# each rebuild charged to whichever test started a trainer next. Set before the setup, which
# builds deepspeed_shm_comm into it.
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(realpath -m "$venv")/torch_extensions}"
export TORCH_EXTENSIONS_DIR
bash scripts/setup.sh "$flavour"

# The host first: CPUs differ between days in what they run (fp16/bf16/AMX kernels) and in speed,
# and a run's log should say which one it had (roll_ds/host.py).
"$venv/bin/python" -m roll_ds.host

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# The documentation site (docs/, mkdocs.yml): any warning fails, a broken link or anchor too.
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet

marker=(-m "not slow")
[ "${ROLL_DS_SLOW:-0}" = 1 ] && marker=()
[ "$#" -gt 0 ] && marker=()
# the 25 slowest tests at the end: where CI's time goes
exec "$venv/bin/python" -m pytest --durations=25 "${marker[@]}" "$@"
