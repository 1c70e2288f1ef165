"""DeepSpeed ZeRO-3, and ZeRO-1/2 with ``reduce_scatter: true``: ZEN's reduce-scatter in place of ZeRO's.

Each rank needs only the reduced gradient of the elements it owns, so the bucket is reduce-scattered
(``BucketReducer.reduce_scatter_``, the route of ``reduction/scatter.py``, docs/reduce_scatter.md) instead
of all-reduced. The overrides (instance attributes of ``engine.optimizer``, checked on
``deepspeed_compat.TESTED_DEEPSPEED``):

=====================  =====================================================  ==========================
who reduces            overridden                                             what DeepSpeed does there
=====================  =====================================================  ==========================
ZeRO-3                 ``__avg_scatter_grads(params, comm_dtype)`` (name-     ``reduce_scatter_coalesced``
                       mangled ``_DeepSpeedZeroOptimizer_Stage3__...``)       of the parameters' full
                                                                              gradients: rank r gets
                                                                              chunk r (``ceil(numel/n)``
                                                                              elements) of each
ZeRO-1/2 with          ``average_tensor(tensor, comm_dtype)`` wrapped;        an all-reduce of the
``reduce_scatter``     ``allreduce_and_scatter`` (default) and                bucket's owner segments,
                       ``allreduce_no_retain(..., rank=dst)`` (with           each owner keeping its
                       ``use_multi_rank_bucket_allreduce`` false) record the  own (default), or one
                       owner segments they are handed instead of reducing     ``dist.reduce`` per owner
                       them; one ZEN reduce-scatter serves them all
=====================  =====================================================  ==========================

ZeRO's owners are not contiguous in the bucket (ZeRO-3 chunks every parameter; ZeRO-2's bucket runs in
backward order across partitions), while the reduce-scatter takes one contiguous range per rank. So
each owner segment is laid out rank-major (one copy of the bucket, as ``reduce_scatter_coalesced``'s
own ``torch.cat``, without its padding: ranges may be uneven or empty), each piece a ``GradSlice`` with
its offset inside the parameter (``start``: DGC memory is keyed per piece), embedding pieces cut at row
boundaries so natural sparsity keeps its rows. The values are DeepSpeed's, pre-divided as DeepSpeed
divides them, and summed (``op="sum"``): natural-only ZEN equals the plain engine bit for bit where the
sums' order does not matter (2 ranks; integer-valued gradients).

DeepSpeed keeps everything else: partition buffers, gradient accumulation across micro-batches, the
optimizer state (sharded), overflow checks and clipping on the partitions, checkpoints.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from ..reduction import locate_slices, piece_slices
from ..reduction.plan import GradSlice
from . import deepspeed_compat as compat

_Z3_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def sharded_refusals(opt, stage: int) -> None:
    """Refuse what the reduce-scatter path cannot serve, before training starts (``opt``: the engine's
    optimizer)."""
    if stage == 3 and not hasattr(opt, _Z3_AVG_SCATTER):
        raise NotImplementedError(f"zen with ZeRO-3 overrides {type(opt).__name__}.__avg_scatter_grads, which "
                                  f"this DeepSpeed lacks; supported: {compat.served_text()}")
    if stage == 3 and not getattr(opt, "reduce_scatter", True):
        raise NotImplementedError("zen with ZeRO-3 needs zero_optimization.reduce_scatter = true (ZEN replaces "
                                  "the reduce-scatter); build the engine with zen_ext.deepspeed.initialize, or "
                                  "zen_ext.deepspeed.enable(), which keep it")
    if getattr(opt, "all2all_process_group", None) is not None:
        raise NotImplementedError("zen with ZeRO-3 does not serve zero_quantized_gradients (ZeRO++ qgZ, a lossy "
                                  "INT4 all-to-all); remove it, or remove \"zen\"")


class ShardedReduce:
    """The reduce-scatter overrides ``ZenDeepSpeed`` holds (``zen.sharded_reduce``) for ZeRO-3 and ZeRO-1/2
    with ``reduce_scatter``: ``install`` replaces the optimizer's methods (the table above), which then
    reduce through the attachment's reducer.

    Args:
        engine: the DeepSpeedEngine; ``stage`` its ZeRO stage.
        sync, reducer, stats: the attachment's Synchronizer, BucketReducer and StepStats.
        names: ``id(parameter)`` → parameter name.
        is_dp_group: whether a process group is the data-parallel group (others go to DeepSpeed).
        dp_size, dp_rank: the data-parallel group's size and this rank's place in it (the Synchronizer's
            group is the inter-node one with node-level reduction).
    """

    def __init__(self, engine, stage: int, *, sync, reducer, stats, names: dict, is_dp_group, dp_size: int,
                 dp_rank: int) -> None:
        self.engine, self.stage = engine, stage
        self.sync, self.reducer, self.stats, self.names = sync, reducer, stats, names
        self.is_dp_group, self.dp_size, self.dp_rank = is_dp_group, dp_size, dp_rank
        self.calls = 0
        """Reduce-scatters run (``ZenDeepSpeed.end_step`` checks that the overrides ran)."""
        self._rs_layouts: dict[tuple, tuple] = {}
        self._rs_pending = None

    def install(self) -> None:
        """Replace the optimizer's reduction methods (ZeRO-3's ``__avg_scatter_grads``; ZeRO-1/2's
        ``average_tensor``, ``allreduce_no_retain``, ``allreduce_and_scatter``) with this object's."""
        opt = self.engine.optimizer
        self.stats.dense_name = "DeepSpeed's dense reduce-scatter"  # what dense_bytes counts on this path
        if self.stage == 3:
            self._orig_avg_scatter = getattr(opt, _Z3_AVG_SCATTER)
            setattr(opt, _Z3_AVG_SCATTER, self._avg_scatter_grads)
        else:
            self._orig_average_tensor, self._orig_no_retain = opt.average_tensor, opt.allreduce_no_retain
            self._orig_and_scatter = opt.allreduce_and_scatter
            opt.average_tensor, opt.allreduce_no_retain = self._average_tensor, self._allreduce_no_retain
            opt.allreduce_and_scatter = self._allreduce_and_scatter

    # --- ZeRO-3 -------------------------------------------------------------------------------------------
    def _avg_scatter_grads(self, params, communication_data_type):
        """ZeRO-3's ``__avg_scatter_grads``, its arithmetic step for step, with ZEN's reduce-scatter.

        1. The full gradients in the communication dtype, with DeepSpeed's optional pre-divide factor.
        2. Rank-major pieces: chunk r of each parameter (``ceil(numel / n)`` elements, the last ones
           shorter or empty) goes to rank r's range; divided by n, as ``reduce_scatter_coalesced``.
        3. ZEN's reduce-scatter (sum); this rank's chunks are consecutive in its shard.
        4. DeepSpeed's post-scaling and the gradient-accumulation dtype.
        """
        opt = self.engine.optimizer
        group = compat.z3_partition_group(opt, params[0])
        if not self.is_dp_group(group):
            return self._orig_avg_scatter(params, communication_data_type)
        # Step 1: full gradients.
        grads = [p.grad for p in params]
        if communication_data_type != opt.dtype:
            grads = [g.to(communication_data_type) for g in grads]
        if opt.postscale_gradients and opt.gradient_predivide_factor != 1.0:
            grads = [g.div(opt.gradient_predivide_factor) for g in grads]
        # Step 2: pieces, rank-major.
        n = self.dp_size
        chunks = [math.ceil(g.numel() / n) for g in grads]
        segments = []
        for r in range(n):
            for p, g, c in zip(params, grads, chunks):
                a, b = min(r * c, g.numel()), min((r + 1) * c, g.numel())
                segments.append((r, g.reshape(-1)[a:b], self.names[id(p)], a, tuple(p.ds_shape)))
        # Step 3: reduce-scatter.
        shard, mine = self._reduce_scatter_segments(segments, divide_by=n)
        parts, at = [], 0
        for (_, view, *_rest) in mine:
            parts.append(shard.narrow(0, at, view.numel()))
            at += view.numel()
        # Step 4: post-scaling, as DeepSpeed.
        if opt.postscale_gradients and opt.gradient_predivide_factor != 1.0 and opt.gradient_predivide_factor != n:
            parts = [g.mul(opt.gradient_predivide_factor) for g in parts]
        averaging = compat.z3_averaging_world_size(opt, params, n)
        if averaging != n:
            parts = [g.mul(n / float(averaging)) for g in parts]
        if communication_data_type != compat.z3_result_dtype(opt):
            parts = [g.to(compat.z3_result_dtype(opt)) for g in parts]
        return parts

    # --- ZeRO-1/2 with reduce_scatter -------------------------------------------------------------------
    def _average_tensor(self, tensor, communication_data_type):
        """ZeRO's ``average_tensor`` (stream waits, pre-divide, owner segments), with the per-owner reduces
        recorded (``_allreduce_no_retain``) and then served by one ZEN reduce-scatter of the bucket."""
        self._rs_pending = []
        try:
            self._orig_average_tensor(tensor, communication_data_type)
            pending = self._rs_pending
        finally:
            self._rs_pending = None
        if pending:
            from deepspeed.accelerator import get_accelerator

            opt = self.engine.optimizer
            stream = opt.reduction_stream if opt.overlap_comm else get_accelerator().current_stream()
            named = self.zero2_named(communication_data_type)
            with get_accelerator().stream(stream):
                self.reduce_zero2_bucket(tensor, pending, communication_data_type, named)

    def record_zero2_segments(self, tensor, communication_data_type) -> list:
        """Run DeepSpeed's ``average_tensor`` on ``tensor`` recording its owner segments (its pre-divide
        included) without reducing them; the asynchronous IPG hand-over reduces them on the worker."""
        from deepspeed.accelerator import get_accelerator

        self._rs_pending = []
        try:
            self._orig_average_tensor(tensor, communication_data_type)
            opt = self.engine.optimizer
            # Its pre-divide ran on the reduction stream: the worker's reads follow it (as DeepSpeed's own
            # waits, only on accelerators with streams).
            if opt.overlap_comm and not get_accelerator().resolves_data_dependency():
                get_accelerator().current_stream().wait_stream(opt.reduction_stream)
            return self._rs_pending
        finally:
            self._rs_pending = None

    def zero2_job(self, flat, comm_dtype):
        """The asynchronous IPG hand-over's job for the IPG bucket ``flat``: its owner segments recorded
        and its parameters named here, on the training thread (before DeepSpeed clears the bucket);
        the returned callable reduce-scatters them on the worker."""
        pending = self.record_zero2_segments(flat, comm_dtype)
        return functools.partial(self.reduce_zero2_bucket, flat, pending, comm_dtype, self.zero2_named(comm_dtype))

    def zero2_named(self, comm_dtype) -> list:
        """``(name, gradient)`` of the current IPG bucket's parameters (read before the bucket is cleared)."""
        opt = self.engine.optimizer
        bucket = opt.ipg_buckets[comm_dtype]
        return [(self.names[id(opt.bit16_groups[i][j])], g) for (i, j, _), g in zip(bucket.params, bucket.grads)]

    def _allreduce_no_retain(self, bucket, communication_data_type, numel_per_bucket=500000000, rank=None, log=None,
                             divide=True, process_group=None, output_bucket=None):
        """Inside ``_average_tensor``: record rank ``rank``'s segments (already pre-divided) instead of
        reducing them to it (``use_multi_rank_bucket_allreduce`` false); anything else goes to DeepSpeed."""
        if not self._recording(rank is not None and not divide, process_group):
            return compat.call_allreduce_no_retain(self._orig_no_retain, bucket, communication_data_type,
                                                   numel_per_bucket, rank, log, divide, process_group, output_bucket)
        self._rs_pending.extend((rank, v, o) for v, o in zip(bucket, output_bucket or [None] * len(bucket)))

    def _allreduce_and_scatter(self, bucket, communication_data_type, numel_per_bucket=500000000, log=None,
                               divide=True, process_group=None):
        """Inside ``_average_tensor``: record each segment with its one owner instead of all-reducing them
        (``use_multi_rank_bucket_allreduce``, DeepSpeed's default); segments several ranks consume (Muon's
        split matrices) go to DeepSpeed."""
        elems = [compat.scatter_entry(e) for e in bucket]
        if not self._recording(not divide and all(len(r) == 1 for r, _, _ in elems), process_group):
            return self._orig_and_scatter(bucket, communication_data_type, numel_per_bucket, log, divide,
                                          process_group)
        self._rs_pending.extend((next(iter(r)), v, o) for r, v, o in elems)

    def _recording(self, servable: bool, process_group) -> bool:
        opt = self.engine.optimizer
        return self._rs_pending is not None and servable and self.is_dp_group(
            process_group if process_group is not None else opt.dp_process_group)

    def reduce_zero2_bucket(self, tensor, pending, comm_dtype, named) -> None:
        """The recorded owner segments of ``tensor`` (one ZeRO IPG bucket, or one oversized gradient),
        named by the parameters they cut (``named``: ``zero2_named``), reduce-scattered; this rank's land
        back in place (and in DeepSpeed's compact partition buffer where it keeps one)."""
        opt = self.engine.optimizer
        whole = locate_slices([tensor], named)
        base, size, me = tensor.data_ptr(), tensor.element_size(), self.dp_rank
        segments, compact = [], []
        for dst, view, output in pending:
            a = (view.data_ptr() - base) // size
            b = a + view.numel()
            for s in whole:  # the parameters the segment cuts (DeepSpeed merges neighbours of one owner)
                pa, pb = max(a, s.offset), min(b, s.offset + s.numel)
                if pa < pb:
                    segments.append((dst, tensor.view(-1)[pa:pb], s.name, s.start + pa - s.offset, s.shape))
            if output is not None and dst == me:
                compact.append((view, output))
        segments.sort(key=lambda seg: seg[0])  # stable: bucket order inside each owner
        shard, mine = self._reduce_scatter_segments(segments, divide_by=1, comm_dtype=comm_dtype)
        at = 0
        for _, view, *_rest in mine:
            view.copy_(shard[at : at + view.numel()])
            at += view.numel()
        for view, output in compact:  # fp32 accumulation of 16-bit gradients: DeepSpeed's own add
            opt._add_to_grad_partition_buffer(output, view)

    # --- shared -------------------------------------------------------------------------------------------
    def _reduce_scatter_segments(self, segments, divide_by: int, comm_dtype=None):
        """Reduce-scatter owner segments ``(owner, view, name, start, param_shape)``, given in rank order.

        1. Lay the views out rank-major (one copy; the layout's slices and ranges are built once).
        2. Divide by ``divide_by`` (DeepSpeed's pre-divide), in the communication dtype.
        3. ``BucketReducer.reduce_scatter_`` with ``op="sum"``: its guard (fp16: a NaN/Inf on any rank
           NaN-fills every shard, so the loss scaler skips the step everywhere), re-bucketing to
           ``zen.bucket_cap_mb`` and the Synchronizer's routing (the route, ``reduction/scatter.py``).

        Returns:
            ``(shard, mine)``: this rank's reduced range, and its segments in that order.
        """
        t0 = time.perf_counter()
        self.calls += 1
        key = tuple((r, name, start, v.numel()) for r, v, name, start, _ in segments)
        layout = self._rs_layouts.get(key)
        if layout is None:
            if len(self._rs_layouts) > 4096:  # layouts change only when DeepSpeed rebuilds its buckets
                self._rs_layouts.clear()
            layout = self._rs_layouts[key] = _layout(segments, self.dp_size)
        slices, ranges = layout
        # Steps 1 and 2: the rank-major bucket.
        flat = torch.cat([v.reshape(-1) for _, v, *_rest in segments])
        if comm_dtype is not None and flat.dtype != comm_dtype:
            flat = flat.to(comm_dtype)
        if divide_by != 1:
            flat.div_(divide_by)
        lo, hi = ranges[self.dp_rank]
        mine = [s for s in segments if s[0] == self.dp_rank]
        shard = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.engine.fp16_enabled() else None
        if scale is not None:  # DGC memory follows the fp16 loss scale (docs/sparsifiers.md)
            self.sync.set_grad_scale(scale)
        # Step 3: the reducer's guard, re-bucketing to zen.bucket_cap_mb, ZEN's reduce-scatter.
        self.reducer.reduce_scatter_(flat, slices, ranges, "sum", out=shard)
        self.stats.add(reduce_s=time.perf_counter() - t0)
        return shard, mine


def _layout(segments, n: int) -> tuple[list[GradSlice], list[tuple[int, int]]]:
    """The slices and ranges of the rank-major bucket made of ``segments`` (sorted by owner).

    Each piece is cut by ``piece_slices``: a 2-D (or higher) parameter's whole rows in row form
    (natural sparsity keeps one index per row), the partial rows at either end 1-D, each keyed by its
    offset inside the parameter.
    """
    slices, counts, at = [], [0] * n, 0
    for r, v, name, start, shape in segments:
        numel = v.numel()
        counts[r] += numel
        slices.extend(piece_slices(name, tuple(shape), start, numel, at))
        at += numel
    ranges, lo = [], 0
    for c in counts:
        ranges.append((lo, lo + c))
        lo += c
    return slices, ranges
