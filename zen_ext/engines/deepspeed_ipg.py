"""DeepSpeed ZeRO-1/2 with ``overlap_comm`` and ``zen.async_sync``: whole IPG buckets on the worker.

ZeRO's ``overlap_comm`` keeps two IPG buffers: the backward pass fills one while the other is reduced.
``engine.optimizer.reduce_ipg_grads`` is replaced (``ZenDeepSpeed._install``) by
``_reduce_ipg_async``, which hands a full IPG bucket to the communication worker; the worker reduces
it and runs DeepSpeed's own per-parameter copy into the gradient partition, in bucket order, so the
results equal the blocking path's bit for bit. Part of the DeepSpeed adapter (``ZenDeepSpeed``
inherits it); checked on ``deepspeed_compat.TESTED_DEEPSPEED``.
"""

from __future__ import annotations

import functools

import torch

from .deepspeed_compat import async_ipg_unsupported, copy_grads_in_partition


class AsyncIPGMixin:
    """``ZenDeepSpeed``'s IPG hand-over (uses its ``engine``, ``cfg``, ``worker``, ``zero_reduces``,
    ``names``, ``_reduce`` and ``_orig_reduce_ipg``)."""

    def _async_ipg_off_reason(self) -> str | None:
        """Why the ZeRO IPG buckets cannot be handed to the worker whole, or None when they can.

        The hand-over needs DeepSpeed's double IPG buffer (``overlap_comm`` with contiguous gradients:
        the backward pass fills one buffer while the other is reduced) and the per-parameter copy into
        the gradient partition (``copy_grads_in_partition``), which the worker runs after the reduction;
        CPU offload and fp32 gradient accumulation of bf16 parameters copy through other paths.
        """
        opt = self.engine.optimizer
        if not self.cfg.async_sync:
            return "zen.async_sync is off"
        if self.worker is None:
            return "no communication worker (node sharding or a tensor-parallel group)"
        if not self.zero_reduces or self.stage == 3:
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

    def _reduce_ipg_async(self, comm_dtype=None):
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

        opt = self.engine.optimizer
        dtypes = sort_dtypes(list(opt.ipg_buckets.keys())) if comm_dtype is None else [comm_dtype]
        for dt in dtypes:
            bucket = opt.ipg_buckets[dt]
            # Step 1: an oversized parameter.
            if dt in opt.extra_large_param_to_reduce:
                self._wait_ipg_jobs()
                self._orig_reduce_ipg(comm_dtype=dt)
                continue
            if not bucket.params:
                bucket.clear()
                continue
            # Step 2: snapshot, bookkeeping.
            flat = bucket.buffer[bucket.index].narrow(0, 0, bucket.elements)
            members = [(opt.bit16_groups[i][j], i, pid) for i, j, pid in bucket.params]
            if self.sharded:  # reduce_scatter true: DeepSpeed's owner segments, recorded here, reduced there
                reduce = functools.partial(self._reduce_zero2_bucket, flat, self._record_zero2_segments(flat, dt), dt,
                                           self._zero2_named(dt))
            else:
                reduce = functools.partial(self._reduce, flat, self._ipg_slices(flat, bucket), dt, pipelined=False)
            for p, _, pid in members:
                if opt.params_already_reduced[pid]:
                    raise RuntimeError(f"zen: parameter {self.names[id(p)]} was handed to the gradient reduction "
                                       "twice in one step (DeepSpeed supports one reduction per parameter)")
                opt.params_already_reduced[pid] = True
            bucket.clear()
            # Step 3: the worker reduces and copies.
            self.async_ipg_buckets += 1
            job = self.worker.submit(functools.partial(self._finish_ipg, reduce, members), [flat])
            # Step 4: the previous bucket's buffer is refilled next.
            prev, self._ipg_last_job = self._ipg_last_job, job
            if prev is not None:
                prev.wait()
        if comm_dtype is None:
            self._wait_ipg_jobs()

    def _finish_ipg(self, reduce, members) -> None:
        """The worker's half of ``_reduce_ipg_async``: ``reduce()`` the bucket in place (the all-reduce, its
        ZEN buckets in turn since this already runs on the worker; or, with ``reduce_scatter``, the
        reduce-scatter of DeepSpeed's recorded owner segments, this rank's landing in place), then
        DeepSpeed's per-parameter step of ``reduce_ipg_grads``."""
        opt = self.engine.optimizer
        reduce()
        for p, group_idx, pid in members:
            mine = opt.is_param_in_current_partition[pid]
            if opt.partition_gradients and not mine:
                opt.clear_grad_attribute(p)  # ZeRO-2: another rank owns this gradient
            elif mine:
                copy_grads_in_partition(opt, p, group_idx)

    def _wait_ipg_jobs(self) -> None:
        """Wait for every IPG bucket handed to the worker (FIFO: the last one implies the others);
        re-raises a job's failure (CUDA: the current stream then waits on the worker's)."""
        job, self._ipg_last_job = self._ipg_last_job, None
        if job is not None:
            job.wait()
