"""Run a function on local gloo processes: ``run_workers(fn, world_size, *args)`` (tests, demos).

Each worker gets ``fn(rank, world_size, *args)`` after ``init_process_group("gloo")`` and must return
a picklable result; results come back in rank order. A worker's exception fails the test with its
traceback; a hung worker fails it after ``timeout_s``. Workers end with ``destroy_process_group()``
and ``os._exit`` because DDP + gloo on torch 2.13 aborts at interpreter exit in ~5–10 % of runs
(docs/colossalai.md, "Ending a run").

Workers start from a fork server that has imported ``FORKSERVER_PRELOAD`` once (torch, zen_ext): a
worker costs a fork, not an interpreter start and torch's import (~0.1 s instead of 2–7 s for four
ranks on 2 cores). A worker runs with the caller's environment as it is at the call (the fork server's
own was fixed when it started), and imports ``fn``'s module itself, as under ``spawn``. Variables read
at import time (``ZEN_DISABLE_CPP_OP``) keep the value they had when the fork server started. Callers
that know their workers import more (a test suite running DeepSpeed) extend ``FORKSERVER_PRELOAD``
before the first call.

With ``ZEN_NCCL_GUARD=1`` in the environment (``tests/conftest.py`` sets it), each worker runs under
``zen_ext.comm.nccl_guard``: a lone ``isend``/``irecv`` or a tensor on the wrong device fails the test.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp

# What the fork server imports once, before it forks any worker (read at the first run_workers call).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "zen_ext"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env):
    # The caller's environment at the call, not the fork server's from its start.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    code = 0
    try:
        from .nccl_guard import maybe_install

        maybe_install()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle: torch's queue pickler would pass tensors as shared-memory handles that the
        # parent fetches from this process, which may already have exited (ConnectionResetError).
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 — reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    # os._exit skips the queue's feeder thread: flush it first, or a large result never arrives.
    queue.close()
    queue.join_thread()
    os._exit(code)


def run_workers(fn, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception as exc:  # queue.Empty: a worker hung or died without reporting
        errors.append(f"workers did not report within {timeout_s}s ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("gloo worker failed: " + "\n".join(errors))
    return [results[r] for r in range(world_size)]
