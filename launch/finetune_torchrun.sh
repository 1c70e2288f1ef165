#!/usr/bin/env bash
# recipes/finetune_llm.py through torchrun: NPROC ranks per node (default 2). For several nodes run it
# on each with NNODES, NODE_RANK and MASTER_ADDR set (MASTER_PORT defaults to 29500).
# Usage: bash launch/finetune_torchrun.sh <ds_config.json> [recipe arguments]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$1"
shift
export PATH="$root/.venv/bin:$PATH" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$root/.venv/bin/torchrun" --nproc_per_node "${NPROC:-2}" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  "$root/recipes/finetune_llm.py" --deepspeed_config "$config" "$@"
