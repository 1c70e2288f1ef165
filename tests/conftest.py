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

# DeepSpeed's CPU shared-memory all-reduce (its deepspeed_shm_comm op) creates one /dev/shm buffer per
# rank, named by the master port, and never unlinks it (about 69 MB each). The tests launch DeepSpeed on a
# free port each time, so a run of the suite would leave about 1 GB of RAM behind in /dev/shm, and
# repeated runs on one machine end in the OOM killer. The session removes the buffers it created.
_DS_SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


def pytest_sessionstart(session):
    import glob

    session.config._zen_shm_before = set(glob.glob(_DS_SHM))


def pytest_sessionfinish(session, exitstatus):
    import glob

    for path in set(glob.glob(_DS_SHM)) - getattr(session.config, "_zen_shm_before", set()):
        try:
            os.unlink(path)
        except OSError:  # another process removed it first
            pass
