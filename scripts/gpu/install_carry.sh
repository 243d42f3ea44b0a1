#!/usr/bin/env bash
# Install what scripts/gpu/carry.sh put in a carry folder into one site directory, offline:
#
#     bash scripts/gpu/install_carry.sh .gpu_carry /tmp/site        # then PYTHONPATH=/tmp/site
#
# The wheels go in with pip (--no-index --no-deps --target), Ray's pruned tarball is unpacked
# beside them. PYTHON (default python3) is the interpreter whose pip installs; the carry's python
# tag must be its own. check.sh calls this on the device; test_carry.sh calls it here.
set -euo pipefail

carry=${1:?usage: install_carry.sh CARRY_DIR SITE_DIR}
site=${2:?usage: install_carry.sh CARRY_DIR SITE_DIR}
PYTHON=${PYTHON:-python3}

tag=$(awk '$1 == "python_tag" {print $2}' "$carry/MANIFEST")
have=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ "$tag" != "$have" ]; then
    echo "install_carry.sh: $carry was built for $tag, $PYTHON is $have;" \
        "rebuild it with scripts/gpu/carry.sh --python-version ${have:2:1}.${have:3}" >&2
    exit 1
fi
mkdir -p "$site"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$site" "$carry"/wheels/*.whl
tar -xJf "$carry"/ray-*-"$tag".tar.xz -C "$site"
echo "install_carry.sh: $(ls "$carry"/wheels | wc -l) wheels and ray into $site" \
    "($(du -sm "$site" | cut -f1) MB)"
