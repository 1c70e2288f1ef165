import os
import sys

# Tests import the repo's own package (also when run without the editable install) and the
# multiproc launcher helpers.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Multi-process tests run under the NCCL rules (zen_ext/comm/nccl_guard.py): spawned workers inherit
# the variable and fail on a lone isend/irecv or a tensor on a device the backend would refuse.
os.environ.setdefault("ZEN_NCCL_GUARD", "1")
