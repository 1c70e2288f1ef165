"""The reduce-scatter route: one engine bucket, from the adapter's layout to the scheme, each rank keeping
the reduced values of its own contiguous range (ZeRO-2's ``reduce_scatter``, ZeRO-3's partitions,
FSDP2's chunks). ``BucketReducer.reduce_scatter_`` guards the bucket and hands it here; ``ScatterRoute``
is the whole flow, top to bottom.

Coordinates: one system, the bucket's, from the adapter to the scheme. The adapter lays the bucket out
(``flat``, its ``GradSlice`` s, ``ranges[r]`` the range data-parallel rank ``r`` owns, ``out`` this rank's
range), and everything below is said in those offsets: a window of ``zen.bucket_cap_mb`` is a span
``[a, b)`` of the bucket (the Synchronizer plans the window it is handed; the route adds ``a`` to the
plan's offsets where it reads them, in ``bucket_parts``), each part of a window (the dense buffer, a
natural parameter, a fused DGC group) is a list of segments of the bucket, and its result is placed at
its segments in ``out``. A part is re-based once, at the scheme: its owner ranges become counts of its
own elements (``clip``, the one place where segments meet ranges, for both ``part_ranges`` and
``place``); the scheme then reads them in its index units (``core/rs_base.py`` ``as_units``: rows of
a row-form gradient). The owner ranges are never clipped to a window: a range's elements outside a
part simply do not count.

The node level (``zen.hierarchical``, ``reduction/node_scatter.py``) adds one layout in front: Step A
reduce-scatters the bucket inside the node, and the node's sum of the rank's share ``T_l`` (the owners'
ranges with its local index, side by side) is the bucket the route reduces across the nodes, with
``T_l``'s slices and the inter-node owners' ranges in it.

Not served: sparsifiers that read the synchronized gradient back (``after_sync``, e.g. EF21): a rank
holds only its range of it.

Legend: ``_N`` elements of the bucket, ``_R`` this rank's range.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from ..core.reduce_scatter import build_reduce_scatter
from ..core.rs_base import check_ranges
from ..core.rs_dense import predict_dense_bytes
from ..core.types import SparseGrad
from .node_scatter import NodeReduceScatter
from .plan import GradSlice
from .slices import split_to_cap

__all__ = ["ScatterRoute", "bucket_parts", "clip", "part_ranges", "place", "reduce_scatter_flat"]

_DENSE_RS = build_reduce_scatter("dense")


class ScatterRoute:
    """The reduce-scatter of one engine bucket over every data-parallel rank (``BucketReducer`` holds one).

    Args:
        sync: the Synchronizer: its group (the data-parallel one, or the inter-node one with ``node``),
            its routing (``prepare_flat``), its reduce-scatter scheme (``rs_scheme``) and its statistics.
        cap_bytes: the window cap (``zen.bucket_cap_mb``); None: the bucket is one window.
        node: the node's dense part (``NodeShardedReduce`` with its ``owners``) for the node level, or None.
    """

    def __init__(self, sync, cap_bytes: int | None = None, node=None) -> None:
        self.sync, self.cap_bytes = sync, cap_bytes
        self.node = NodeReduceScatter(node, sync.dp_comm.rank, cap_bytes or 1 << 62) if node is not None else None
        self.n = self.node.n if self.node is not None else sync.dp_comm.size
        """Data-parallel ranks: the owners of ``ranges``."""
        self.me = self.node.me if self.node is not None else sync.dp_comm.rank
        """This rank's data-parallel rank: ``ranges[me]`` is its range."""

    def __call__(self, flat: torch.Tensor, slices: Sequence[GradSlice], ranges: Sequence[tuple[int, int]],
                 op: str = "mean", out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce ``flat`` over every data-parallel rank; write this rank's range ``ranges[me]`` into ``out``.

        1. Validate: the ranges tile the bucket (one per data-parallel rank), ``out`` fits this rank's
           range, no sparsifier reads the result back.
        2. Node level: Step A, dense inside the node (``node_scatter.py``); from here the bucket is the
           node's sum of ``T_l``, with its slices and the inter-node owners' ranges, and sums.
        3. Per window of the cap, at parameter boundaries (``across``): prepare, map each part's owner
           ranges, reduce-scatter the dense part and the sparse parts, place them into ``out``.
        4. Node level: a mean divides ``out`` by the data-parallel size once.

        Args:
            flat: this rank's bucket (contiguous; read as flat; not modified).
            slices: the parameters in the bucket (as for ``Synchronizer.sync_flat``).
            ranges: ``ranges[r] = (start, end)``, data-parallel rank ``r``'s range of the bucket.
            op: ``"sum"`` or ``"mean"``.
            out: where this rank's range goes (contiguous 1-D, ``end − start`` elements of ``flat``'s
                dtype and device). Default: a new tensor.

        Raises:
            ValueError: bad ranges, out, slices or op.
            NotImplementedError: a sparsifier that reads the result back.
            RuntimeError: ranks disagree on the bucket layout, configuration or ranges.
        """
        t_start = time.perf_counter()
        # Step 1: validate.
        if not flat.is_contiguous():
            raise ValueError("zen.reduce_scatter needs a contiguous bucket")
        flat_N = flat.reshape(-1)
        ranges = check_ranges(ranges, self.n, flat_N.numel(), "reduce-scatter route")
        lo, hi = ranges[self.me]
        if out is None:
            out = torch.empty(hi - lo, dtype=flat_N.dtype, device=flat_N.device)
        elif out.dim() != 1 or not out.is_contiguous() or out.numel() != hi - lo or out.dtype != flat_N.dtype \
                or out.device != flat_N.device:
            raise ValueError(f"zen.reduce_scatter out ({tuple(out.shape)} {out.dtype} on {out.device}) must be a "
                             f"contiguous 1-D tensor of {hi - lo} {flat_N.dtype} elements on {flat_N.device}")
        refused = self.sync.after_sync_kinds
        if refused:
            raise NotImplementedError(f"zen.reduce_scatter: sparsifier(s) {refused} read the synchronized gradient "
                                      f"back (after_sync), which a rank holding only its range cannot serve; "
                                      f"supported with reduce-scatter: sparsifiers without after_sync (natural, dgc)")
        if self.node is None:
            self.across(flat_N, list(slices), ranges, op, out, t_start)
            return out
        # Step 2: Step A, inside the node.
        lay = self.node.layout(flat_N, slices, ranges)
        if lay.width == 0:
            return out  # an empty bucket: nothing to reduce on any rank (the layout is the same everywhere)
        node_sum_T = self.node.node_sum(flat_N, lay)
        # Step 3: across the nodes, on the node's sum of T_l (an empty T_l: the same on the whole group).
        if lay.shard_len:
            self.across(node_sum_T, lay.slices, lay.ranges, "sum", out, time.perf_counter())
        # Step 4: the mean.
        if op == "mean":
            out.div_(self.n)
        return out

    def across(self, flat_N: torch.Tensor, slices: list[GradSlice], ranges: list[tuple[int, int]], op: str,
               out_R: torch.Tensor, t_start: float) -> None:
        """Step 3: reduce-scatter ``flat_N`` over the Synchronizer's group, window by window, into ``out_R``
        (its owner's range ``ranges[group rank]``).

        a. Prepare the window (``Synchronizer.prepare_flat`` for ``rs_scheme``: its plan and agreement,
           the dense gather, the sparsifiers' compression, DGC handing its memory over to a scheme that
           selects its own entries).
        b. Its parts, with their segments in bucket offsets (``bucket_parts``).
        c. The dense part: the ``dense`` reduce-scatter over the owner ranges mapped onto its segments.
        d. The sparse parts: one ``reduce_scatter_group`` of ``rs_scheme``, each part over its mapped
           ranges, written into ``out_R`` (a part of one segment in place).
        e. Statistics, next to what the dense reduce-scatter of the window would have sent.
        """
        sync = self.sync
        dp, n = sync.dp_comm, sync.dp_comm.size
        scheme = sync.rs_scheme
        lo, hi = ranges[dp.rank]
        cap = max(1, self.cap_bytes // flat_N.element_size()) if self.cap_bytes else None
        windows = split_to_cap(flat_N.numel(), slices, cap) if cap is not None else [(0, flat_N.numel(), slices)]
        for a, b, members in windows:
            # Step a: prepare (out= the window itself: nothing writes it, and no output is allocated).
            window = flat_N[a:b]
            prep = sync.prepare_flat(window, list(members), op, out=window, scheme=scheme)
            dp_before = dp.stats.snapshot()
            # Step b: the parts.
            dense_segs, parts = bucket_parts(prep, a)
            # Step c: the dense part.
            if prep.dense_buf is not None:
                res = _DENSE_RS.reduce_scatter(dp, prep.dense_buf, part_ranges(dense_segs, ranges), op)
                place(res, dense_segs, lo, hi, out_R)
                sync.note_dense(prep.dense_buf.numel())
            # Step d: every sparse part in one group call.
            if parts:
                outs = [_in_place(p.segs, lo, hi, out_R) for p in parts]
                timings: list[dict] = [{} for _ in parts]
                with dp.slot(("reduce_scatter", prep.plan.slot)):
                    results = scheme.reduce_scatter_group(dp, [p.grad() for p in parts],
                                                          [part_ranges(p.segs, ranges) for p in parts], op,
                                                          outs=outs, timings=timings, keys=[p.key for p in parts])
                for p, o, res, t in zip(parts, outs, results, timings):
                    if o is None:
                        place(res, p.segs, lo, hi, out_R)
                    t.setdefault("scheme", scheme.name)  # the reduce-scatter scheme ran it, not the all-reduce one
                    sync.note_part(p.kind, p.numel, p.nnz, t, p.key)
            # Step e: statistics.
            dense = predict_dense_bytes(n, [max(0, min(e, b) - max(s, a)) for s, e in ranges],
                                        flat_N.element_size())["bytes"]
            sync.note_bucket(dp.stats - dp_before, dense, time.perf_counter() - t_start)
            t_start = time.perf_counter()


def reduce_scatter_flat(sync, flat: torch.Tensor, slices: list[GradSlice], ranges: Sequence[tuple[int, int]],
                        op: str = "mean", out: torch.Tensor | None = None) -> torch.Tensor:
    """The route for one window: ``flat`` reduced over ``sync.dp_comm``, this rank's range ``ranges[rank]``
    returned (``out`` when given); no re-bucketing, no node level (``ScatterRoute`` without a cap)."""
    return ScatterRoute(sync)(flat, slices, ranges, op, out)


# --- a window's parts in bucket offsets ------------------------------------------------------------------
@dataclasses.dataclass
class SparsePart:
    """One sparse reduce-scatter input of a window: a fused group, a parameter, or a parameter's pieces."""

    key: str
    kind: str
    segs: list[tuple[int, int]]
    """Its spans of the bucket, in bucket order (its elements, concatenated, are the gradient's)."""
    grads: list[SparseGrad]
    shifts: list[int]
    """Where each piece's indices start in the merged gradient (index units)."""
    numel: int

    @property
    def nnz(self) -> int:
        return sum(g.nnz * g.row_width for g in self.grads)

    def grad(self) -> SparseGrad:
        if len(self.grads) == 1:
            return self.grads[0]
        g0 = self.grads[0]
        idx = torch.cat([g.indices + shift for g, shift in zip(self.grads, self.shifts)])
        vals = torch.cat([g.values for g in self.grads])
        return SparseGrad(idx, vals, self.shifts[-1] + self.grads[-1].numel, in_range=g0.in_range)


def bucket_parts(prep, base: int) -> tuple[list[tuple[int, int]], list[SparsePart]]:
    """A prepared window's parts with their segments in bucket offsets (the plan's plus ``base``, the
    window's start): the dense buffer's segments, and the sparse inputs, the pieces of one parameter
    merged into one gradient.

    FSDP2's chunk layout puts each parameter in the bucket once per rank (``GradSlice.start`` = the
    piece's offset in the parameter). Pieces of one name that follow each other in the parameter, in
    bucket order, with row-aligned starts, are one gradient over the parameter whose owner ranges are
    the pieces: a reduce-scatter of it costs two rounds whatever ``n``, where one per piece would cost
    ``2·n``. (Each piece is whole rows of its parameter, so the pieces' rows concatenate.)
    """
    dense_segs = [(base + s, base + e) for s, e in prep.plan.dense_ranges]
    out: list[SparsePart] = []
    last: dict[str, tuple[SparsePart, int]] = {}  # name -> (its part, the parameter offset it reaches)
    for p in prep.parts:
        g, s = p.group, p.slice
        if s is None:
            spanned = g.tiled and p.grad.numel == g.hi - g.lo  # spardl's memory is over the concatenation
            segs = [(base + g.lo, base + g.hi)] if spanned else [(base + x.offset, base + x.offset + x.numel)
                                                                 for x in g.slices]
            out.append(SparsePart(p.key, g.kind, segs, [p.grad], [0], p.numel))
            continue
        width = p.grad.row_width
        seg = (base + s.offset, base + s.offset + s.numel)
        prev = last.get(s.name)
        if prev is not None and prev[1] == s.start and prev[0].grads[0].row_width == width:
            part = prev[0]
            part.shifts.append(part.shifts[-1] + part.grads[-1].numel)
            part.grads.append(p.grad)
            part.segs.append(seg)
            part.numel += p.numel
        else:
            part = SparsePart(p.key, g.kind, [seg], [p.grad], [0], p.numel)
            out.append(part)
        last[s.name] = (part, s.start + s.numel)
    return dense_segs, out


# --- segments meet ranges: the one clipping ------------------------------------------------------------
def clip(segs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """A part's elements inside the bucket range ``[lo, hi)``: ``(start, end, at)`` per segment that meets
    it, in order, ``(start, end)`` in bucket offsets and ``at`` the part's elements before ``start``."""
    found, at = [], 0
    for a, b in segs:
        pa, pb = max(a, lo), min(b, hi)
        if pa < pb:
            found.append((pa, pb, at + pa - a))
        at += b - a
    return found


def part_ranges(segs: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The owner ranges of a part made of ``segs`` (disjoint, in bucket order, concatenated) in its own
    elements: each bucket range becomes the span of the part's elements inside it (the ranges tile the
    bucket in order, so those spans tile the part)."""
    out, at = [], 0
    for lo, hi in ranges:
        inside = sum(e - s for s, e, _ in clip(segs, lo, hi))
        out.append((at, at + inside))
        at += inside
    return out


def place(res: torch.Tensor, segs: list[tuple[int, int]], lo: int, hi: int, out_R: torch.Tensor) -> None:
    """Copy a part's reduced piece of ``[lo, hi)`` (its elements inside it, in order) into the shard."""
    found = clip(segs, lo, hi)
    if found:
        first = found[0][2]
        for s, e, at in found:
            out_R[s - lo : e - lo] = res[at - first : at - first + e - s]


def _in_place(segs: list[tuple[int, int]], lo: int, hi: int, out_R: torch.Tensor) -> torch.Tensor | None:
    """The view of ``out_R`` a part of one segment writes into (its elements inside ``[lo, hi)``, possibly
    none); None for a part of several segments (its result is placed afterwards)."""
    if len(segs) != 1:
        return None
    found = clip(segs, lo, hi)
    return out_R[found[0][0] - lo : found[0][1] - lo] if found else out_R[:0]
