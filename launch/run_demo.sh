#!/usr/bin/env bash
# The README's demo command: set-up (idempotent), then the offline fine-tuning demo
# (tiny Llama, 2 CPU processes, deepspeed launcher, DGC + natural sparsity + scheme "auto").
# Extra arguments go to the demo, e.g. `bash launch/run_demo.sh --steps 100 --dense`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
# The venv's tools first: DeepSpeed JIT-builds its ops with the `ninja` on PATH, and two ninja versions
# sharing its build cache rebuild the op (40-70 s) each time they alternate.
export PATH="$root/.venv/bin:$PATH" OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
# The set-up installs without byte-compiling; keep what the demo's imports compile (launch/test.sh says why).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m zen_ext demo "$@"
