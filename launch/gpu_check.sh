#!/usr/bin/env bash
# zen_ext on a GPU machine, one command, no internet: bash launch/gpu_check.sh [options]
#
#   bash launch/gpu_check.sh                 # single GPU: report in benchmarks/gpu/results/gpu_check.md
#   bash launch/gpu_check.sh --parts hash    # a subset (hash,schemes,synchronizer,deepspeed,gloo)
#   bash launch/gpu_check.sh --multi [N]     # N GPUs of this node over NCCL (default: all visible);
#                                            # report in benchmarks/gpu/results/gpu_check_multi.md
#
# Needs what launch/setup.sh installs (run it first, with nvcc reachable, so the CUDA kernel is built;
# see docs/gpu.md). Without a GPU it exits with status 2 at once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${ZEN_PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py="python3"; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "--multi" ]]; then
  shift
  n=""
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then n="$1"; shift; fi
  if [[ -z "$n" ]]; then
    n="$("$py" -c 'import torch; print(torch.cuda.device_count())')"
  fi
  if [[ "$n" -lt 2 ]]; then
    echo "gpu_check --multi: needs at least 2 GPUs on this node (found $n); one GPU: bash launch/gpu_check.sh" >&2
    exit 2
  fi
  exec "$py" -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/gpu/gpu_check.py --multi "$@"
fi
exec "$py" benchmarks/gpu/gpu_check.py "$@"
