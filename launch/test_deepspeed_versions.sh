#!/usr/bin/env bash
# The DeepSpeed adapter's tests against other DeepSpeed releases, each in an environment of its own with the
# venv's torch (docs/deepspeed.md, "DeepSpeed versions"):
#   bash launch/test_deepspeed_versions.sh 0.18.9 [0.17.6 ...] [-- extra pytest arguments]
# For each version: `pip install --no-deps --target .venv-deepspeed/<version>` (DeepSpeed 0.17-0.19 need
# the same packages as the venv's 0.19.8, which the venv has), then pytest with PYTHONPATH putting that
# folder first, so it shadows the venv's deepspeed in this process and in every rank the tests start.
# Each version JIT-builds DeepSpeed's CPU ops into a cache of its own (.venv-deepspeed/<version>/ops), so
# the default cache of the venv's DeepSpeed is not rebuilt when versions alternate. One version at a time,
# each under ZEN_DS_VERSION_TIMEOUT seconds (default 3600). CI runs the default version only
# (launch/test.sh); this command is for checking a release before serving it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
versions=()
while (( $# )) && [[ "$1" != "--" ]]; do versions+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
if (( ${#versions[@]} == 0 )); then
  echo "usage: bash launch/test_deepspeed_versions.sh VERSION [VERSION ...] [-- pytest args]" >&2
  exit 2
fi
# The adapter's tests: every file that builds a DeepSpeed engine with ZEN, or checks the version gate or
# the ZeRO layouts (tests/e2e/test_deepspeed_tp.py, the slowest, is included; the recipe and HF Trainer
# files test the launcher and transformers around the same overrides and are left to the default version).
TESTS=(
  tests/unit/test_deepspeed_versions.py
  tests/unit/test_zero_layout.py
  tests/multiproc/test_engine_buckets.py
  tests/e2e/test_deepspeed_engine.py
  tests/e2e/test_deepspeed_zero3.py
  tests/e2e/test_dgc_deepspeed_fp16.py
  tests/e2e/test_deepspeed_without_zen.py
  tests/e2e/test_deepspeed_tp.py
)
export PATH="$root/.venv/bin:$PATH" OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
status=0
for v in "${versions[@]}"; do
  target="$root/.venv-deepspeed/$v"
  if [[ ! -f "$target/deepspeed/__init__.py" ]]; then
    .venv/bin/python -m pip install -q --no-deps --no-compile --target "$target" "deepspeed==$v"
  fi
  mkdir -p "$target/ops"
  found="$(PYTHONPATH="$target:$root" .venv/bin/python -c 'import deepspeed; print(deepspeed.__version__, deepspeed.__file__)' 2>/dev/null | tail -1)"
  echo "== deepspeed $v: importing $found"
  [[ "$found" == "$v $target/"* ]] || { echo "deepspeed $v does not shadow the venv's" >&2; exit 1; }
  # DeepSpeed before 0.19 on torch 2.13's CPU gloo: two all-gather bugs of its own, fixed in 0.19 (the
  # shim's docstring); the shim applies those fixes so the tests reach, and measure, the adapter's hooks.
  shim=""
  minor="${v#0.}"; minor="${minor%%.*}"
  if [[ "$v" == 0.* ]] && (( minor < 19 )); then
    shim="$root/launch/deepspeed_gloo_shim:"
    echo "== deepspeed $v: with launch/deepspeed_gloo_shim (DeepSpeed 0.19's detached flat buffers and waited ZeRO-3 gathers)"
  fi
  start=$SECONDS
  rc=0
  PYTHONPATH="$shim$target:$root" TORCH_EXTENSIONS_DIR="$target/ops" timeout "${ZEN_DS_VERSION_TIMEOUT:-3600}" \
    .venv/bin/python -m pytest -q -ra -p no:cacheprovider --durations=5 "${TESTS[@]}" "$@" || rc=$?
  echo "== deepspeed $v: pytest exit $rc after $((SECONDS - start)) s"
  (( rc == 0 )) || status=$rc
done
exit $status
