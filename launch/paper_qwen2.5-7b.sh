#!/usr/bin/env bash
# The ZEN paper's qwen2.5-7b fine-tuning setup (OSDI'25 §5: TP 8 via AutoTP, ZeRO-1, bf16, batch 1 per TP
# group, sequence 1024, RedPajama sample, natural sparsity of the untied embedding only (lossless)). VARIANT=dense runs the all-reduce baseline.
# Needs GPUs, the HF model (access granted for gated ones) and the data set on the hosts of HOSTFILE.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/finetune_deepspeed.sh" "$here/../configs/qwen2.5-7b_autotp8_zero1_bf16_${VARIANT:-zen_natural}.json" \
  --model Qwen/Qwen2.5-7B --tokenizer Qwen/Qwen2.5-7B --data hf:togethercomputer/RedPajama-Data-1T-Sample \
  --seq_len 1024 --steps "${STEPS:-1000}" --eval_every 100 --save_every 500 --output_dir "runs/qwen2.5-7b_${VARIANT:-zen_natural}" "$@"
