#!/usr/bin/env bash
# Set up (if needed) and run the checks CI runs: ruff lint + format check, then pytest.
#
#   bash scripts/test.sh                  # unit + integration tests (what CI runs)
#   bash scripts/test.sh -m "not integration"   # extra arguments go to pytest
#   ROLL_DS_SLOW=1 bash scripts/test.sh   # also the slow end-to-end tests
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh cpu
venv="${ROLL_DS_VENV:-.venv}"

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .

marker=(-m "not slow")
[ "${ROLL_DS_SLOW:-0}" = 1 ] && marker=()
[ "$#" -gt 0 ] && marker=()
exec "$venv/bin/python" -m pytest "${marker[@]}" "$@"
