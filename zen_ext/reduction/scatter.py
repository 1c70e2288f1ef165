"""``Synchronizer.reduce_scatter_flat``: one flat bucket routed as ``sync_flat`` routes it (dense slices,
natural rows, DGC), then reduce-scattered: each rank keeps the reduced values of its own contiguous
range of the bucket (ZeRO-2's ``reduce_scatter``, ZeRO-3's partitions, FSDP2's chunks).

Every part of the bucket (the dense buffer, each natural slice, each fused DGC group) spans one or more
segments of the bucket; an owner's bucket range maps to one contiguous range of the part (the part's
elements before the range's start, before its end), so each part is reduce-scattered with the
configured ``ReduceScatterScheme`` over those mapped ranges, and this rank's piece lands at its place
in the shard. The dense buffer goes through the ``dense`` reduce-scatter, the sparse parts through one
``reduce_scatter_group`` call of the configured scheme (host reads once per bucket).

It reduces over one group (``sync.dp_comm``); the node-level form (``zen.hierarchical``) calls it across
nodes on the node's sum (``reduction/node_scatter.py``). It reads and reports through the Synchronizer's
public surface (``prepare_flat``, ``rs_scheme``, ``after_sync_kinds``, ``note_dense``, ``note_part``,
``note_bucket``).
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
from .plan import GradSlice

_DENSE_RS = build_reduce_scatter("dense")


def reduce_scatter_flat(sync, flat: torch.Tensor, slices: list[GradSlice], ranges: Sequence[tuple[int, int]],
                        op: str = "mean", out: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce the bucket ``flat`` over ``sync.dp_comm`` and return this rank's range of the result.

    1. Validate ``ranges`` (one per data-parallel rank, tiling ``[0, flat.numel())``) and ``out``.
    2. Prepare as ``sync_flat`` does (plan and its agreement, dense gather, sparsifiers' compression).
    3. Dense part: the ``dense`` reduce-scatter of the gathered buffer over the mapped ranges.
    4. Sparse parts: one ``reduce_scatter_group`` of the Synchronizer's reduce-scatter scheme, each
       part over its mapped ranges, written into the shard (a part of one segment writes in place).
    5. Statistics, next to what the dense reduce-scatter of the bucket would have sent.

    Args:
        sync: the Synchronizer (its ``rs_scheme`` reduce-scatters the sparse parts).
        flat: this rank's bucket (contiguous; read as flat; not modified).
        slices: the parameters in the bucket (as for ``sync_flat``).
        ranges: ``ranges[r] = (start, end)``, data-parallel rank ``r``'s range of the bucket.
        op: ``"sum"`` or ``"mean"``.
        out: where this rank's range goes (contiguous 1-D, ``end − start`` elements of ``flat``'s dtype
            and device). Default: a new tensor.

    Raises:
        ValueError: bad ranges, out, slices or op.
        NotImplementedError: a sparsifier that reads the result back.
        RuntimeError: ranks disagree on the bucket layout, configuration or ranges.
    """
    t_start = time.perf_counter()
    dp, n = sync.dp_comm, sync.dp_comm.size
    # Step 1: validate.
    if not flat.is_contiguous():
        raise ValueError("reduce_scatter_flat needs a contiguous bucket")
    flat_N = flat.reshape(-1)
    rs = check_ranges(ranges, n, flat_N.numel(), "Synchronizer.reduce_scatter_flat")
    lo, hi = rs[dp.rank]
    if out is not None:
        if out.dim() != 1 or not out.is_contiguous() or out.numel() != hi - lo or out.dtype != flat_N.dtype \
                or out.device != flat_N.device:
            raise ValueError(f"reduce_scatter_flat: out ({tuple(out.shape)} {out.dtype} on {out.device}) must be a "
                             f"contiguous 1-D tensor of {hi - lo} {flat_N.dtype} elements on {flat_N.device}")
        out_R = out
    else:
        out_R = torch.empty(hi - lo, dtype=flat_N.dtype, device=flat_N.device)
    refused = sync.after_sync_kinds
    if refused:
        raise NotImplementedError(f"reduce_scatter_flat: sparsifier(s) {refused} read the synchronized gradient back "
                                  f"(after_sync), which a rank holding only its range cannot serve; supported "
                                  f"with reduce-scatter: sparsifiers without after_sync (natural, dgc)")
    scheme = sync.rs_scheme
    # Step 2: prepare (out=flat: no bucket-sized output is allocated; nothing writes it).
    prep = sync.prepare_flat(flat, slices, op, out=flat, scheme=scheme)
    plan = prep.plan
    dp_before = dp.stats.snapshot()

    # Step 3: the dense part.
    if prep.dense_buf is not None:
        segs = plan.dense_ranges
        res = _DENSE_RS.reduce_scatter(dp, prep.dense_buf, map_ranges(segs, rs), op)
        place(res, segs, lo, hi, out_R)
        sync.note_dense(prep.dense_buf.numel())

    # Step 4: every sparse part in one group call.
    parts = sparse_parts(prep.parts)
    if parts:
        outs = []
        for part in parts:
            a, b = max(part.segs[0][0], lo), min(part.segs[0][1], hi)
            outs.append(out_R[a - lo : b - lo] if len(part.segs) == 1 and a <= b else None)
        timings: list[dict] = [{} for _ in parts]
        with dp.slot(("reduce_scatter", plan.slot)):
            results = scheme.reduce_scatter_group(dp, [p.grad() for p in parts], [map_ranges(p.segs, rs) for p in parts],
                                                  op, outs=outs, timings=timings, keys=[p.key for p in parts])
        for part, o, res, t in zip(parts, outs, results, timings):
            if o is None:
                place(res, part.segs, lo, hi, out_R)
            t.setdefault("scheme", scheme.name)  # the reduce-scatter scheme ran it, not the all-reduce one
            sync.note_part(part.kind, part.numel, part.nnz, t, part.key)

    # Step 5: statistics.
    dense = predict_dense_bytes(n, [e - s for s, e in rs], flat_N.element_size())["bytes"]
    sync.note_bucket(dp.stats - dp_before, dense, time.perf_counter() - t_start)
    return out_R


@dataclasses.dataclass
class _SparsePart:
    """One reduce-scatter input of a bucket: a fused group, a parameter, or a parameter's pieces."""

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


def sparse_parts(prepared: list) -> list[_SparsePart]:
    """The bucket's sparse inputs, with the pieces of one parameter merged into one gradient.

    FSDP2's chunk layout puts each parameter in the bucket once per rank (``GradSlice.start`` = the
    piece's offset in the parameter). Pieces of one name that follow each other in the parameter, in
    bucket order, with row-aligned starts, are one gradient over the parameter whose owner ranges are
    the pieces: a reduce-scatter of it costs two rounds whatever ``n``, where one per piece would cost
    ``2·n``. (Each piece is whole rows of its parameter, so the pieces' rows concatenate.)
    """
    out: list[_SparsePart] = []
    last: dict[str, tuple[_SparsePart, int]] = {}  # name -> (its part, the parameter offset it reaches)
    for p in prepared:
        g, s = p.group, p.slice
        if s is None:
            spanned = g.tiled and p.grad.numel == g.hi - g.lo  # spardl's memory is over the concatenation
            segs = [(g.lo, g.hi)] if spanned else [(x.offset, x.offset + x.numel) for x in g.slices]
            out.append(_SparsePart(p.key, g.kind, segs, [p.grad], [0], p.numel))
            continue
        width = p.grad.row_width
        seg = (s.offset, s.offset + s.numel)
        prev = last.get(s.name)
        if prev is not None and prev[1] == s.start and prev[0].grads[0].row_width == width:
            part = prev[0]
            part.shifts.append(part.shifts[-1] + part.grads[-1].numel)
            part.grads.append(p.grad)
            part.segs.append(seg)
            part.numel += p.numel
        else:
            part = _SparsePart(p.key, g.kind, [seg], [p.grad], [0], p.numel)
            out.append(part)
        last[s.name] = (part, s.start + s.numel)
    return out


def map_ranges(segs: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each bucket range as a range of the part made of ``segs`` (disjoint, in bucket order, concatenated):
    its start and end become the number of the part's elements before them."""
    def before(x: int) -> int:
        return sum(min(max(x - a, 0), b - a) for a, b in segs)

    return [(before(s), before(e)) for s, e in ranges]


def place(res: torch.Tensor, segs: list[tuple[int, int]], lo: int, hi: int, out_R: torch.Tensor) -> None:
    """Copy a part's reduced piece of ``[lo, hi)`` (its segments' elements inside it, in order) into the shard."""
    at = 0
    for a, b in segs:
        pa, pb = max(a, lo), min(b, hi)
        if pa < pb:
            out_R[pa - lo : pb - lo] = res[at : at + pb - pa]
            at += pb - pa

