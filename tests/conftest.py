import os
import sys

# Tests import the repo's own package (also when run without the editable install) and the
# multiproc launcher helpers.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process the tests start finds the venv's tools first. DeepSpeed JIT-builds its shm comm op with
# whichever `ninja` is on PATH; the venv's (1.13) and a system one (1.11) hash the same command
# differently in the shared .ninja_log, so runs that alternate between them rebuilt the op each time
# (40–70 s per rebuild, several per session).
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")
# Multi-process tests run under the NCCL rules (zen_ext/comm/nccl_guard.py): spawned workers inherit
# the variable and fail on a lone isend/irecv or a tensor on a device the backend would refuse.
os.environ.setdefault("ZEN_NCCL_GUARD", "1")

# DeepSpeed's CPU shared-memory all-reduce (its deepspeed_shm_comm op) creates one /dev/shm buffer per
# rank, named by the master port, and never unlinks it (about 69 MB each). The tests launch DeepSpeed on a
# free port each time, so a run of the suite would leave about 1 GB of RAM behind in /dev/shm, and
# repeated runs on one machine end in the OOM killer. The session removes the buffers it created: the
# whole session, so under pytest-xdist only the controller (a worker that finished first would unlink
# the buffers of a DeepSpeed run still going on another worker).
_DS_SHM = "/dev/shm/deepspeed_allreduce_buffer_*"


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    import glob

    session.config._zen_shm_before = set(glob.glob(_DS_SHM))


def pytest_sessionfinish(session, exitstatus):
    import glob

    if _xdist_worker(session.config):
        return
    for path in set(glob.glob(_DS_SHM)) - getattr(session.config, "_zen_shm_before", set()):
        try:
            os.unlink(path)
        except OSError:  # another process removed it first
            pass


# The heaviest files by measured time (`--durations=0`, whole suite on 2 xdist workers, 2026-12-06),
# heaviest first: collected first, so that pytest-xdist (launch/test.sh: --dist loadfile
# --no-loadscope-reorder hands out files in collection order) starts them early and a worker that ends
# the run alone does so on a short file. Order inside a file is kept. Each took over 100 s there (a
# loaded machine: several times their time on 2 quiet cores).
LONG_FILES = ("tests/e2e/test_recipe_pretrained_start.py", "tests/e2e/test_deepspeed_recipe.py",
              "tests/e2e/test_deepspeed_zero3.py", "tests/e2e/test_deepspeed_zero3_node.py",
              "tests/e2e/test_readme_snippets.py", "tests/ops/test_cuda_compile.py",
              "tests/e2e/test_deepspeed_hf_trainer.py", "tests/e2e/test_deepspeed_spardl_recipe.py",
              "tests/e2e/test_colossalai_recipe.py", "tests/e2e/test_deepspeed_rs_overlap.py",
              "tests/e2e/test_deepspeed_engine.py", "tests/e2e/test_fsdp_recipe.py",
              "tests/multiproc/test_ddp_hook.py", "tests/e2e/test_deepspeed_tp.py",
              "tests/e2e/test_deepspeed_zero3_recipe.py", "tests/multiproc/test_fsdp_hsdp.py",
              "tests/unit/test_gpu_check.py", "tests/multiproc/test_fsdp.py",
              "tests/e2e/test_colossalai_plugins.py", "tests/multiproc/test_fsdp_float_sums.py",
              "tests/e2e/test_deepspeed_offload.py", "tests/multiproc/test_fsdp_node.py",
              "tests/e2e/test_dgc_deepspeed_fp16.py")


def pytest_collection_modifyitems(config, items):
    """Long files first (``LONG_FILES``). Multi-process tests fork their gloo workers from one fork server
    (``zen_ext.comm.local``): when the session has engine tests, the server imports the engines once
    too, so that no worker pays their import (2–5 s each per rank on 2 cores)."""
    from zen_ext.comm import local

    def rank(item) -> int:
        path = os.path.relpath(str(item.fspath), ROOT)
        return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)

    items[:] = sorted(items, key=rank)  # stable: collection order otherwise

    # Not colossalai: one test file uses it in workers, and the other engines' workers never had it loaded.
    engines = ("deepspeed", "transformers")
    if any("/e2e/" in str(item.fspath) or "/multiproc/" in str(item.fspath) for item in items):
        import importlib.util

        local.FORKSERVER_PRELOAD += [m for m in engines
                                     if m not in local.FORKSERVER_PRELOAD and importlib.util.find_spec(m)]
