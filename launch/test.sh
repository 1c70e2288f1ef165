#!/usr/bin/env bash
# The README's test command: set-up (idempotent), then the whole test suite.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m "not slow"` or `bash launch/test.sh tests/unit`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
