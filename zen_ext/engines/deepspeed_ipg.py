"""DeepSpeed ZeRO-1/2 with ``overlap_comm`` and ``zen.async_sync``: whole IPG buckets on the worker.

ZeRO's ``overlap_comm`` keeps two IPG buffers: the backward pass fills one while the other is reduced.
``engine.optimizer.reduce_ipg_grads`` is replaced by ``AsyncIPG.reduce_ipg_grads``, which hands a full
IPG bucket to the communication worker; the worker reduces it and runs DeepSpeed's own per-parameter
copy into the gradient partition, in bucket order, so the results equal the blocking path's bit for
bit. Part of the DeepSpeed adapter (``ZenDeepSpeed`` holds one, ``zen.async_ipg``, where
``async_ipg_off_reason`` finds none); checked on ``deepspeed_compat.TESTED_DEEPSPEED``.
"""

from __future__ import annotations

import functools

import torch

from .deepspeed_compat import async_ipg_unsupported, copy_grads_in_partition


def async_ipg_off_reason(opt, *, async_sync: bool, worker, zero_reduces: bool, stage: int) -> str | None:
    """Why the ZeRO IPG buckets cannot be handed to the worker whole, or None when they can.

    The hand-over needs DeepSpeed's double IPG buffer (``overlap_comm`` with contiguous gradients:
    the backward pass fills one buffer while the other is reduced) and the per-parameter copy into
    the gradient partition (``copy_grads_in_partition``), which the worker runs after the reduction;
    CPU offload and fp32 gradient accumulation of bf16 parameters copy through other paths.

    Args:
        opt: the engine's optimizer; ``async_sync``: ``zen.async_sync``; ``worker``: the attachment's
            communication worker (None without one); ``zero_reduces``: a ZeRO-1/2 optimizer reduces its
            own buckets; ``stage``: the ZeRO stage.
    """
    if not async_sync:
        return "zen.async_sync is off"
    if worker is None:
        return "no communication worker (node sharding or a tensor-parallel group)"
    if not zero_reduces or stage == 3:
        return ("not a ZeRO-1/2 optimizer (ZeRO-3 consumes its gradient partitions inside DeepSpeed right "
                "after the reduce-scatter)")
    if not getattr(opt, "overlap_comm", False):
        return "zero_optimization.overlap_comm is false (one IPG buffer)"
    if not getattr(opt, "contiguous_gradients", False):
        return "zero_optimization.contiguous_gradients is false"
    if getattr(opt, "cpu_offload", False):
        return "ZeRO CPU offload"
    if getattr(opt, "zenflow", False):
        return "ZenFlow"
    use_compact = getattr(opt, "_use_compact_grad_partition_buffer", None)
    if use_compact is not None and any(use_compact(i) for i in range(len(opt.bit16_groups))):
        return "fp32 gradient accumulation of 16-bit parameters (compact gradient partitions)"
    missing = [a for a in ("ipg_buckets", "params_already_reduced", "is_param_in_current_partition",
                           "copy_grads_in_partition", "clear_grad_attribute", "extra_large_param_to_reduce",
                           "reduce_ipg_grads", "partition_gradients") if not hasattr(opt, a)]
    if missing:
        return f"this DeepSpeed's ZeRO optimizer lacks {', '.join(missing)}"
    return async_ipg_unsupported(opt)


class AsyncIPG:
    """ZeRO-1/2's IPG hand-over that ``ZenDeepSpeed`` holds (``zen.async_ipg``): ``install`` replaces
    ``opt.reduce_ipg_grads`` with ``reduce_ipg_grads``.

    Args:
        opt: the engine's ZeRO-1/2 optimizer.
        worker: the attachment's communication worker.
        names: ``id(parameter)`` → parameter name.
        job: ``job(flat, bucket, comm_dtype)`` → the callable that reduces the IPG bucket ``flat`` in place
            on the worker, built on the training thread while the bucket is intact (the attachment's
            all-reduce, or its reduce-scatter of DeepSpeed's recorded owner segments).
    """

    def __init__(self, opt, worker, names: dict, job) -> None:
        self.opt, self.worker, self.names, self.job = opt, worker, names, job
        self.buckets = 0
        """IPG buckets handed to the worker so far."""
        self._at_last_step = 0
        self._last_job = None
        self._orig_reduce_ipg = None

    def install(self) -> None:
        self._orig_reduce_ipg, self.opt.reduce_ipg_grads = self.opt.reduce_ipg_grads, self.reduce_ipg_grads

    def step_buckets(self) -> int:
        """IPG buckets handed to the worker since the last call (one optimizer step's)."""
        n, self._at_last_step = self.buckets - self._at_last_step, self.buckets
        return n

    def forget(self) -> None:
        """Drop the reference to the last job (the worker's drain finishes it)."""
        self._last_job = None

    def reduce_ipg_grads(self, comm_dtype=None):
        """ZeRO ``reduce_ipg_grads`` with ``overlap_comm`` and ``zen.async_sync``: the worker reduces the
        full IPG bucket and copies it into the gradient partition while the backward pass fills the
        other IPG buffer.

        1. A bucket that holds one oversized parameter (reduced from its own gradient, not the IPG
           buffer) goes DeepSpeed's blocking way, after the worker drained.
        2. Snapshot the bucket on this thread: its view of the IPG buffer, its parameters and their
           slices; mark them reduced and clear the bucket, as DeepSpeed does after reducing it (the
           backward pass refills it next).
        3. Hand the worker the reduction, then DeepSpeed's own per-parameter copy into the partition
           (``copy_grads_in_partition``) or release of a gradient outside it, in bucket order: the
           order and the operations of the blocking path, so results are bitwise equal.
        4. Wait for the job before it: its IPG buffer is the one the backward pass fills next. At the
           epilogue (no ``comm_dtype``) wait for every job, since the optimizer step reads them all.
        """
        from deepspeed.runtime.torch_autocast import sort_dtypes

        opt = self.opt
        dtypes = sort_dtypes(list(opt.ipg_buckets.keys())) if comm_dtype is None else [comm_dtype]
        for dt in dtypes:
            bucket = opt.ipg_buckets[dt]
            # Step 1: an oversized parameter.
            if dt in opt.extra_large_param_to_reduce:
                self.wait()
                self._orig_reduce_ipg(comm_dtype=dt)
                continue
            if not bucket.params:
                bucket.clear()
                continue
            # Step 2: snapshot, bookkeeping.
            flat = bucket.buffer[bucket.index].narrow(0, 0, bucket.elements)
            members = [(opt.bit16_groups[i][j], i, pid) for i, j, pid in bucket.params]
            reduce = self.job(flat, bucket, dt)
            for p, _, pid in members:
                if opt.params_already_reduced[pid]:
                    raise RuntimeError(f"zen: parameter {self.names[id(p)]} was handed to the gradient reduction "
                                       "twice in one step (DeepSpeed supports one reduction per parameter)")
                opt.params_already_reduced[pid] = True
            bucket.clear()
            # Step 3: the worker reduces and copies.
            self.buckets += 1
            job = self.worker.submit(functools.partial(self.finish, reduce, members), [flat])
            # Step 4: the previous bucket's buffer is refilled next.
            prev, self._last_job = self._last_job, job
            if prev is not None:
                prev.wait()
        if comm_dtype is None:
            self.wait()

    def finish(self, reduce, members) -> None:
        """The worker's half of ``reduce_ipg_grads``: ``reduce()`` the bucket in place (the all-reduce, its
        ZEN buckets in turn since this already runs on the worker; or, with ``reduce_scatter``, the
        reduce-scatter of DeepSpeed's recorded owner segments, this rank's landing in place), then
        DeepSpeed's per-parameter step of ``reduce_ipg_grads``."""
        opt = self.opt
        reduce()
        for p, group_idx, pid in members:
            mine = opt.is_param_in_current_partition[pid]
            if opt.partition_gradients and not mine:
                opt.clear_grad_attribute(p)  # ZeRO-2: another rank owns this gradient
            elif mine:
                copy_grads_in_partition(opt, p, group_idx)

    def wait(self) -> None:
        """Wait for every IPG bucket handed to the worker (FIFO: the last one implies the others);
        re-raises a job's failure (CUDA: the current stream then waits on the worker's)."""
        job, self._last_job = self._last_job, None
        if job is not None:
            job.wait()
