#!/usr/bin/env bash
# The peers benchmark's own packages (benchmarks/quality/bench_peers.py): torchft 0.2.0 for DiLoCo. Its wheel
# (cp311, manylinux2014 x86_64) asks for torch>=2.7 and opentelemetry; the constraints file keeps torch at
# the project's pin, so nothing zen_ext uses changes. Not part of launch/setup.sh's default path.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The pin of pyproject.toml's "peers" extra (pip install -e ".[peers]" does the same plus zen_ext itself).
.venv/bin/pip install -c launch/constraints.txt "torchft==0.2.0"
.venv/bin/python -c "import torch, torchft.local_sgd; print('torchft', 'ok with torch', torch.__version__)"
