"""``BucketReducer`` with a communication worker (``zen.async_sync`` under DeepSpeed): the ZEN buckets
of one engine bucket are pipelined — bucket ``k + 1`` is compressed on the calling thread while the
worker synchronizes bucket ``k`` — with results bitwise equal to the sequential path."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.unit.test_synchronizer import DGC, KINDS, SLICES, bucket_inputs
from zen_ext import SimWorld, build_scheme
from zen_ext.reduction.synchronizer import Synchronizer
from zen_ext.reduction import BucketReducer
from zen_ext.reduction import CommWorker

CAP_BYTES = 4 * 1000  # SLICES re-bucket into several ZEN buckets at this cap


class SlowScheme:
    """A scheme whose every call takes at least ``delay_s`` (a slow link), recording its thread."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s, self.threads = inner, delay_s, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __repr__(self):
        return repr(self.inner)

    def sync(self, comm, grad, op="sum", timings=None, key=None, out=None):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        return self.inner.sync(comm, grad, op, timings=timings, key=key, out=out)


def _run(n: int, pipelined: bool, steps: int = 3, delay_s: float = 0.0):
    inputs = [bucket_inputs(n, seed=7 * n + s) for s in range(steps)]

    def fn(comm):
        scheme = SlowScheme(build_scheme("zen"), delay_s)
        sync = Synchronizer(dp_comm=comm, scheme=scheme, param_kinds=KINDS, dgc=DGC, natural={})
        worker = CommWorker(torch.device("cpu"), name=f"zen-test-{comm.rank}") if pipelined else None
        reducer = BucketReducer(sync, cap_bytes=CAP_BYTES, dp_size=n, worker=worker)
        log = []
        prepare, finish = sync.prepare_flat, sync.finish_flat

        def timed_prepare(flat, *a, **k):
            log.append(("prepare", flat.data_ptr(), time.perf_counter()))
            return prepare(flat, *a, **k)

        def timed_finish(prep):
            out = finish(prep)
            log.append(("finished", prep.flat.data_ptr(), time.perf_counter()))
            return out

        sync.prepare_flat, sync.finish_flat = timed_prepare, timed_finish
        outs, buckets = [], []
        try:
            for step in inputs:
                flat = step[comm.rank].clone()
                reducer.reduce_(flat, SLICES, "mean")
                outs.append(flat.clone())
                buckets.append(sync.pop_step_stats()["buckets"])
                sync.end_step()
        finally:
            if worker is not None:
                worker.close()
        return outs, buckets, log, scheme.threads

    return SimWorld(n).run(fn)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_pipelined_equals_sequential_bitwise(n):
    want = _run(n, pipelined=False)
    got = _run(n, pipelined=True)
    for r in range(n):
        assert all(b > 1 for b in got[r][1]), "the engine bucket must re-bucket into several ZEN buckets"
        assert got[r][1] == want[r][1]
        for a, b in zip(got[r][0], want[r][0]):
            assert torch.equal(a, b)
        assert all(name.startswith("zen-test-") for name in got[r][3]), "the schemes ran on the worker"


def test_next_bucket_is_compressed_while_the_previous_one_syncs():
    """With a slow link (every scheme call ≥ 50 ms) the calling thread prepares bucket k + 1 before the
    worker has finished bucket k: the pipeline overlaps."""
    res = _run(2, pipelined=True, steps=1, delay_s=0.05)
    for _, _, log, _ in res:
        prepared = [t for ev, _, t in log if ev == "prepare"]
        finished = [t for ev, _, t in log if ev == "finished"]
        assert len(prepared) == len(finished) > 1
        assert any(prepared[k + 1] < finished[k] for k in range(len(finished) - 1)), log


def test_a_failing_bucket_reaches_the_caller_and_every_job_is_waited_for():
    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
        worker = CommWorker(torch.device("cpu"), name="zen-test-fail")
        reducer = BucketReducer(sync, cap_bytes=CAP_BYTES, dp_size=1, worker=worker)
        finish = sync.finish_flat
        calls = []

        def failing(prep):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("boom in the first bucket")
            return finish(prep)

        sync.finish_flat = failing
        try:
            with pytest.raises(ValueError, match="boom in the first bucket"):
                reducer.reduce_(bucket_inputs(1, seed=3)[0].clone(), SLICES, "mean")
            assert worker._queue.empty()
        finally:
            worker.close()
        return len(calls)

    # After the first failure the worker fails every later job fast (no collective its peers miss).
    assert SimWorld(1).run(fn) == [1]


def test_every_prepared_tensor_is_handed_to_the_worker():
    """On CUDA the worker's stream reads what ``prepare_flat`` allocated on the caller's stream, so the
    reducer passes all of it to ``submit`` (``record_stream``): the dense buffer, the natural rows and
    the DGC entries of every ZEN bucket, besides the bucket itself."""

    class RecordingWorker(CommWorker):
        def submit(self, fn, tensors=()):
            handed.append({t.data_ptr() for t in tensors if t.numel()})
            seen.append(fn.__defaults__[0])  # the _Prepared the job finishes
            return super().submit(fn, tensors)

    handed, seen = [], []

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
        worker = RecordingWorker(torch.device("cpu"), name="zen-test-record")
        try:
            BucketReducer(sync, cap_bytes=CAP_BYTES, dp_size=1, worker=worker).reduce_(
                bucket_inputs(1, seed=5)[0].clone(), SLICES, "mean")
        finally:
            worker.close()

    SimWorld(1).run(fn)
    assert len(seen) > 1
    kinds = set()
    for ptrs, prep in zip(handed, seen):
        want = [prep.flat, prep.out_N]
        if prep.dense_buf is not None:
            want.append(prep.dense_buf)
            kinds.add("dense")
        for part in prep.parts:  # natural rows per slice, DGC entries per bucket
            want += [part.grad.indices, part.grad.values]
            kinds.add(part.group.kind)
        assert {t.data_ptr() for t in want if t.numel()} <= ptrs
    assert kinds == {"dense", "natural", "dgc"}
