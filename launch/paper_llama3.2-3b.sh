#!/usr/bin/env bash
# The ZEN paper's llama3.2-3b fine-tuning setup (OSDI'25 §5: TP 8 via AutoTP, ZeRO-1, bf16, batch 1 per TP
# group, sequence 1024, RedPajama sample, DGC top-5 % per 128 MB bucket). VARIANT=dense runs the all-reduce baseline.
# Needs GPUs, the HF model (access granted for gated ones) and the data set on the hosts of HOSTFILE.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/finetune_deepspeed.sh" "$here/../configs/llama3.2-3b_autotp8_zero1_bf16_${VARIANT:-zen_dgc5}.json" \
  --model meta-llama/Llama-3.2-3B --tokenizer meta-llama/Llama-3.2-3B --data hf:togethercomputer/RedPajama-Data-1T-Sample \
  --seq_len 1024 --steps "${STEPS:-1000}" --eval_every 100 --save_every 500 --output_dir "runs/llama3.2-3b_${VARIANT:-zen_dgc5}" "$@"
