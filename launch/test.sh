#!/usr/bin/env bash
# The README's test command: set-up (idempotent), then the whole test suite (what CI runs).
#   bash launch/test.sh            every test
#   bash launch/test.sh --quick    the quick tier for work in progress: tests/unit and tests/ops without
#                                  the tests marked slow or nvcc (CUDA compile checks); a few minutes
# Extra arguments go to pytest, e.g. `bash launch/test.sh -m "not slow"` or `bash launch/test.sh tests/unit`.
# Test files run on ZEN_TEST_WORKERS pytest-xdist workers (default: the CPU count, at most 4; 1 runs
# them in this process). A file's tests stay on one worker, in order (--dist loadfile), so a module's
# fixtures run once; most tests wait on subprocesses (launchers, gloo ranks, nvcc) and leave a core idle.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
quick=()
if [[ "${1:-}" == "--quick" ]]; then
  shift
  quick=(tests/unit tests/ops -m "not slow and not nvcc")
fi
bash launch/setup.sh
# The venv's tools first: DeepSpeed JIT-builds its ops with the `ninja` on PATH, and two ninja versions
# sharing its build cache rebuild the op (40-70 s) each time they alternate.
export PATH="$root/.venv/bin:$PATH" OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
# The set-up installs without byte-compiling (pip --no-compile): the suite's first imports compile what
# it uses and keep it. Where the environment says PYTHONDONTWRITEBYTECODE, every one of the suite's
# ~300 Python processes would compile torch, DeepSpeed and transformers from source again (18 s against
# 8 s per process to import them), so the suite writes its bytecode.
unset PYTHONDONTWRITEBYTECODE
workers="${ZEN_TEST_WORKERS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}"  # not nproc: it obeys OMP_NUM_THREADS
(( workers > 4 )) && workers=4
xdist=()
# --no-loadscope-reorder: pytest-xdist (3.8 in the set-up) otherwise hands out files by their number of
# tests, most first, so the few-test end-to-end files that take minutes each started last and ended
# the run on one worker; in collection order, tests/conftest.py's LONG_FILES go first.
(( workers > 1 )) && xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
exec .venv/bin/python -m pytest -ra --durations=15 "${xdist[@]}" "${quick[@]}" "$@"
