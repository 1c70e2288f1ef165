#!/usr/bin/env bash
# recipes/finetune_llm.py through the deepspeed launcher: NPROC ranks on this node (default 2), or
# every node of HOSTFILE. Usage: [HOSTFILE=launch/hostfile.example] bash launch/finetune_deepspeed.sh \
#   <ds_config.json> [recipe arguments: --model --data --tokenizer --seq_len --steps --output_dir ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$1"
shift
export PATH="$root/.venv/bin:$PATH" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${HOSTFILE:-}" ]]; then
  hosts=(--hostfile "$HOSTFILE")
else
  hosts=(--num_gpus "${NPROC:-2}")
fi
exec "$root/.venv/bin/deepspeed" "${hosts[@]}" "$root/recipes/finetune_llm.py" --deepspeed_config "$config" "$@"
