"""Flat gradient buckets ↔ named GradSlices, and cutting them: re-bucketing and shards.

Engines hand over gradients as one flat buffer (DeepSpeed: up to 5e8 elements per dtype at once) or
as a list of tensors that they flatten. The Synchronizer needs to know which parameter each range is
(embedding rows → natural sparsity, dense weights → DGC), so:

* ``locate_slices`` maps tensors to names by storage address (``data_ptr``), which works for
  ``param.grad`` lists (ZeRO-0), for views into an optimizer's flat buffer (BF16_Optimizer, ZeRO-1/2
  contiguous buckets) and for a mix of both;
* ``split_to_cap`` cuts a flat range into buckets of at most ``cap`` elements at parameter boundaries
  (a parameter bigger than the cap is a bucket of its own, as in DDP), so ZEN's per-bucket state and
  message sizes match the paper's 128 MB buckets whatever the engine does;
* ``shard_bounds`` / ``clip_slices`` cut a bucket into one shard per local rank for hierarchical
  synchronization (paper §4), snapping cuts to embedding-row boundaries so row sparsity survives;
* ``piece_slices`` cuts one piece of a parameter into whole-row slices (row form) and partial rows
  (1-D): the one place that does, for FSDP2's chunks, ZeRO's owner segments and ``clip_slices``.

Elements covered by no slice (alignment padding) are reduced dense by the Synchronizer.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .plan import GradSlice


@dataclass(frozen=True)
class _Known:
    ptr: int
    numel: int
    name: str
    shape: tuple


def locate_slices(tensors: Sequence[torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> list[GradSlice]:
    """Slices of the flat buffer made by concatenating ``tensors``, named after ``named`` tensors.

    A tensor of ``tensors`` that *is* a named tensor (same address and size) gives one slice; a tensor
    that *contains* named tensors (a flat buffer whose views they are) gives one slice per view.
    Ranges no named tensor covers get no slice.

    Args:
        tensors: the bucket, in flattening order, all of one dtype.
        named: ``(name, tensor)`` pairs, e.g. parameter names with their gradients or gradient views.

    Returns:
        Slices sorted by offset, non-overlapping.
    """
    if not tensors:
        return []
    itemsize = tensors[0].element_size()
    known = sorted((_Known(t.data_ptr(), t.numel(), n, tuple(t.shape)) for n, t in named
                    if t is not None and t.numel() and t.element_size() == itemsize and t.is_contiguous()),
                   key=lambda k: k.ptr)
    ptrs = [k.ptr for k in known]
    out: list[GradSlice] = []
    offset = 0
    for t in tensors:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * itemsize
        i = bisect.bisect_left(ptrs, start)
        while i < len(known) and known[i].ptr < end:
            k = known[i]
            if k.ptr + k.numel * itemsize <= end:
                out.append(GradSlice(k.name, offset + (k.ptr - start) // itemsize, k.numel, k.shape))
            i += 1
        offset += t.numel()
    return _drop_overlaps(out)


def _drop_overlaps(slices: list[GradSlice]) -> list[GradSlice]:
    # Two names at one address (shared/tied parameters seen twice) must not be synchronized twice.
    out: list[GradSlice] = []
    for s in sorted(slices, key=lambda s: s.offset):
        if not out or s.offset >= out[-1].offset + out[-1].numel:
            out.append(s)
    return out


def split_to_cap(numel: int, slices: Sequence[GradSlice], cap: int,
                 isolate: frozenset[str] | set[str] = frozenset()) -> list[tuple[int, int, list[GradSlice]]]:
    """Cut ``[0, numel)`` into buckets of at most ``cap`` elements at slice boundaries.

    Args:
        numel: elements of the flat buffer.
        slices: the named parameters in it.
        cap: the bucket cap in elements.
        isolate: names of slices that get a bucket of their own (handled by another path).

    Returns:
        ``(start, end, slices)`` per bucket, covering ``[0, numel)`` in order, with slice offsets
        relative to ``start``. A slice larger than ``cap`` forms its own bucket.
    """
    if cap < 1:
        raise ValueError(f"bucket cap ({cap}) must be >= 1 element")
    buckets: list[tuple[int, int, list[GradSlice]]] = []
    start, members = 0, []
    for s in sorted(slices, key=lambda s: s.offset):
        end_s = s.offset + s.numel
        alone = s.name in isolate
        if members and (alone or end_s - start > cap):
            buckets.append((start, s.offset, members))
            start, members = s.offset, []
        if alone and s.offset > start:  # an uncovered gap before an isolated slice
            buckets.append((start, s.offset, []))
            start = s.offset
        members.append(s)
        if alone or end_s - start >= cap:  # isolated, full, or a single oversized slice
            buckets.append((start, end_s, members))
            start, members = end_s, []
    if start < numel or not buckets:
        buckets.append((start, numel, members))
    return [(a, b, [_rebase(s, a) for s in m]) for a, b, m in buckets]


def _rebase(s: GradSlice, base: int) -> GradSlice:
    return dataclasses.replace(s, offset=s.offset - base)


def row_width(s: GradSlice) -> int:
    """Elements of one row of a slice (its shape past dim 0; 1 for a 1-D slice)."""
    return math.prod(s.shape[1:]) if len(s.shape) >= 2 else 1


def shard_bounds(numel: int, slices: Sequence[GradSlice], parts: int) -> list[int]:
    """``parts + 1`` cut points splitting ``[0, numel)`` evenly, moved to row boundaries of 2-D slices.

    Row sparsity (one index per embedding row) survives only if no row is split across shards.
    """
    cuts = [numel * i // parts for i in range(parts + 1)]
    by_offset = sorted(slices, key=lambda s: s.offset)
    offsets = [s.offset for s in by_offset]
    for i in range(1, parts):
        j = bisect.bisect_right(offsets, cuts[i]) - 1
        if j >= 0:
            s = by_offset[j]
            w = row_width(s)
            if s.offset < cuts[i] < s.offset + s.numel and w > 1:
                cuts[i] = s.offset + round((cuts[i] - s.offset) / w) * w
    for i in range(1, parts + 1):  # keep cuts monotone after snapping
        cuts[i] = max(cuts[i], cuts[i - 1])
    return cuts


def piece_slices(name: str, shape: tuple, start: int, numel: int, offset: int, base: int = 0) -> list[GradSlice]:
    """The GradSlices of one piece of a tensor, cut so row sparsity survives (every engine's pieces:
    FSDP2's chunks, ZeRO's owner segments, node shards and bucket cuts all go through here).

    The piece is elements ``[start, start + numel)`` of a tensor of ``shape`` (a parameter, or a slice
    of one that starts at element ``base`` of its parameter), placed at ``offset`` of the bucket:

    * the whole tensor: one slice of its shape;
    * otherwise the whole rows it holds in row form ``(rows, *shape[1:])``, and the partial row it
      starts or ends in (if any) as a 1-D slice each; a tensor whose rows are single elements (1-D, or
      rows of width 1) gives one 1-D slice;
    * an empty piece of a non-empty tensor: no slice.

    Each slice's ``start`` is its offset inside the parameter (``base`` plus its offset inside the
    tensor): the key of its sparsifier memory (DGC residuals), so a piece is keyed alike whoever cuts it.
    """
    if numel == math.prod(shape):
        return [GradSlice(name, offset, numel, tuple(shape), start=base)]
    width = math.prod(shape[1:]) if len(shape) >= 2 else 1
    head = min(numel, (-start) % width) if width > 1 else 0  # the rest of the row the piece starts in
    rows = (numel - head) // width if width > 1 else 0
    cuts = [(start, head, None), (start + head, rows * width, (rows, *shape[1:])),
            (start + head + rows * width, numel - head - rows * width, None)]
    out, at = [], offset
    for s0, m, shp in cuts:
        if m:
            out.append(GradSlice(name, at, m, tuple(shp or (m,)), start=base + s0))
            at += m
    return out


def clip_slices(slices: Sequence[GradSlice], start: int, end: int) -> list[GradSlice]:
    """The parts of ``slices`` inside ``[start, end)``, rebased to ``start``, each cut by ``piece_slices``.

    A slice inside the range is kept as it is (rebased); a clipped one keeps its row shape over the
    whole rows it holds, and a partial row where a cut falls mid-row is 1-D. Names are kept and
    ``start`` records where the part begins in its parameter, so sparsifier memory (DGC residuals) is
    keyed by ``(name, start)``.
    """
    out = []
    for s in slices:
        a, b = max(s.offset, start), min(s.offset + s.numel, end)
        if a < b:
            out.extend(piece_slices(s.name, s.shape, a - s.offset, b - a, a - start, base=s.start))
    return out
