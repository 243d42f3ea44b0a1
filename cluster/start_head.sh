#!/usr/bin/env bash
# Start the Ray head on this machine. Run once, on the machine that becomes node 0 when it has
# GPUs (roll_ds orders GPU nodes head first, then by IP; see README.md).
#
#   NUM_GPUS=8 bash cluster/start_head.sh
#
# Env: RAY_PORT (6379), NUM_GPUS (Ray's autodetect if unset), NUM_CPUS (autodetect),
#      DASHBOARD=1 to serve the dashboard on 0.0.0.0:8265, OBJECT_STORE_GB (Ray's default).
set -euo pipefail

port=${RAY_PORT:-6379}
args=(--head --port="$port" --disable-usage-stats)
[[ -n ${NUM_GPUS:-} ]] && args+=(--num-gpus="$NUM_GPUS")
[[ -n ${NUM_CPUS:-} ]] && args+=(--num-cpus="$NUM_CPUS")
[[ -n ${OBJECT_STORE_GB:-} ]] && args+=(--object-store-memory=$((OBJECT_STORE_GB * 1024 ** 3)))
if [[ ${DASHBOARD:-0} == 1 ]]; then
  args+=(--include-dashboard=true --dashboard-host=0.0.0.0)
else
  args+=(--include-dashboard=false)
fi

ray start "${args[@]}"
ip=$(python -c 'import ray._private.services as s; print(s.get_node_ip_address())')
cat <<MSG

Head is up. On every other node:
    HEAD_ADDRESS=$ip:$port NUM_GPUS=<gpus on that node> bash cluster/start_worker.sh
Then, on this node:
    RAY_ADDRESS=$ip:$port python run.py --config-name <config>
(or set ray.address=$ip:$port in the config). Check with: ray status
MSG
