#!/usr/bin/env bash
# One idempotent set-up for zen_ext: a virtualenv at .venv with torch 2.13.0 (never another torch),
# deepspeed 0.19.8, transformers 4.51.3, colossalai 0.5.0 (--no-deps plus only what it imports),
# test tools, and zen_ext itself (editable, with its C++ op built against the installed torch).
#
# Re-running is cheap: a stamp records the hash of everything that shapes the environment, and the
# script exits early when nothing changed. Set ZEN_SETUP_FORCE=1 to rebuild anyway.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${ZEN_PYTHON:-python3}"
stamp="$venv/.zen_setup_stamp"
# The stamp covers every source of the op, the CUDA kernels included, and whether nvcc is reachable
# (installing a CUDA toolkit later must rebuild with the CUDA kernel).
nvcc_at="$(command -v nvcc || ls "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" 2>/dev/null || true)"
want="$( (cat launch/setup.sh launch/constraints.txt pyproject.toml setup.py csrc/*.cpp csrc/*.h csrc/cpu/*.cpp csrc/cpu/*.h \
  csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.h 2>/dev/null; echo "nvcc=$nvcc_at") | sha256sum | cut -c1-16)"
if [[ -z "${ZEN_SETUP_FORCE:-}" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
t0=$SECONDS
log() { echo "[zen_ext setup +$((SECONDS - t0))s] $*"; }

# Step 1: the virtualenv. A machine whose python already has a CUDA torch keeps it (system site
# packages visible, torch pinned to that version); everywhere else torch 2.13.0 comes from the CPU wheel.
cuda_torch="$("$py" -c 'import torch; print(torch.__version__ if torch.version.cuda else "")' 2>/dev/null || true)"
if [[ ! -x "$venv/bin/python" ]]; then
  if [[ -n "$cuda_torch" ]]; then
    log "found CUDA torch $cuda_torch: creating .venv with system site packages to keep it"
    "$py" -m venv --system-site-packages "$venv"
  else
    log "creating .venv"
    "$py" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# --no-compile on every install: pip would byte-compile every file of every package (torch and
# transformers ship thousands); Python compiles the few modules a run imports, on first use.
constraints="$venv/constraints.txt"
if [[ -n "$cuda_torch" ]]; then
  echo "torch==$cuda_torch" >"$constraints"
else
  cp launch/constraints.txt "$constraints"
  if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    log "installing torch 2.13.0"
    "${pip[@]}" install --no-compile -c "$constraints" "torch==2.13.0"
  fi
fi

# Step 2: engines and tools, every install constrained so that nothing can replace torch.
log "installing deepspeed, transformers, datasets, test tools"
"${pip[@]}" install --no-compile -c "$constraints" "deepspeed==0.19.8" "transformers==4.51.3" datasets tokenizers \
  pytest pytest-timeout pytest-xdist hypothesis numpy tqdm psutil packaging rich click contexttimer ninja \
  safetensors einops pydantic sentencepiece protobuf "peft==0.13.2" accelerate matplotlib setuptools wheel

# Step 3: colossalai 0.5.0 pins torch<=2.5.1, so it goes in --no-deps; galore_torch and bitsandbytes
# are imported by colossalai.booster, the rest of its requirements are not needed for training.
if ! "$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("colossalai") == "0.5.0"' 2>/dev/null; then
  log "installing colossalai 0.5.0 (--no-deps)"
  "${pip[@]}" install --no-compile --no-deps --no-build-isolation "colossalai==0.5.0" galore-torch bitsandbytes
fi

# Step 4: zen_ext itself, editable, built against the installed torch (build isolation would pull
# the newest torch with GBs of CUDA packages into the build env).
log "building zen_ext (C++ op)"
"${pip[@]}" install -c "$constraints" --no-build-isolation --no-deps -e .
"$venv/bin/python" -c 'import zen_ext.ops as o; assert o.HAVE_CPP_OP, "zen_ext C++ op did not build"'
# Step 5: with a CUDA torch, say whether the CUDA kernel is in. CUDA torch wheels ship no nvcc; without
# one the op runs CUDA tensors through the pure-torch reference (correct, much slower, and it warns).
if [[ -n "$cuda_torch" ]]; then
  if "$venv/bin/python" -c 'import sys, torch, zen_ext.ops; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::hash_partition", "CUDA"))'; then
    log "CUDA kernel built (torch $cuda_torch)"
  else
    msg="CUDA torch $cuda_torch but no nvcc (CUDA_HOME=${CUDA_HOME:-unset}): the CUDA kernel was NOT built; CUDA gradients will use the slow pure-torch reference. Install the CUDA toolkit matching torch.version.cuda (apt cuda-toolkit-12-x, or conda install -c nvidia cuda-nvcc), set CUDA_HOME, then run ZEN_SETUP_FORCE=1 bash launch/setup.sh"
    if [[ "${ZEN_REQUIRE_CUDA_OP:-0}" == "1" ]]; then
      log "ERROR: $msg"
      exit 1
    fi
    log "WARNING: $msg"
  fi
fi
echo "$want" >"$stamp"
log "done"
