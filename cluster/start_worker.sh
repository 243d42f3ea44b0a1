#!/usr/bin/env bash
# Join this machine to a running Ray head as a worker node.
#
#   HEAD_ADDRESS=10.0.0.1:6379 NUM_GPUS=8 bash cluster/start_worker.sh
#
# Env: HEAD_ADDRESS (required, ip:port printed by start_head.sh), NUM_GPUS, NUM_CPUS
#      (autodetect if unset), OBJECT_STORE_GB. Every node must have the same roll_ds checkout
#      and Python environment as the head (same path), since actors import roll_ds.
set -euo pipefail

: "${HEAD_ADDRESS:?set HEAD_ADDRESS=ip:port of the Ray head (printed by start_head.sh)}"
args=(--address="$HEAD_ADDRESS" --disable-usage-stats)
[[ -n ${NUM_GPUS:-} ]] && args+=(--num-gpus="$NUM_GPUS")
[[ -n ${NUM_CPUS:-} ]] && args+=(--num-cpus="$NUM_CPUS")
[[ -n ${OBJECT_STORE_GB:-} ]] && args+=(--object-store-memory=$((OBJECT_STORE_GB * 1024 ** 3)))

ray start "${args[@]}"
echo "Joined $HEAD_ADDRESS. 'ray status' on the head should list this node's GPUs."
