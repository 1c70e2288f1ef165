"""Node-level reduce-scatter (``zen.hierarchical`` under ZeRO-2's ``reduce_scatter``, ZeRO-3 and FSDP2):
dense inside the node, sparse across nodes, on the node's sum of the rank's own share.

A bucket is owned in ranges ``R_0 … R_{n−1}`` by the ``n = N·L`` data-parallel ranks (``N`` nodes of
``L``). Local rank ``l`` of every node serves the owners with local index ``l``: their ranges, in the
rank order of the inter-node group ``l`` (``torch.distributed.new_group`` orders by global rank), make
its shard ``T_l`` (``|T_l| ≈ |bucket|/L``).

* Step A, inside the node (fast links): the bucket reordered into ``[T_0 | … | T_{L−1}]`` (each
  padded to the longest), a dense reduce-scatter: local rank ``l`` holds the node's sum of ``T_l``. A
  bucket above half of ``zen.bucket_cap_mb`` is reordered and reduced in column windows of the blocks
  (every ``T_l``'s same window at once, at most half the cap in all), so the reordered copy never holds
  the whole bucket: Step A's transient memory is the cap plus the shard, not twice the bucket
  (``benchmarks/memory/results/rs_peak_memory.md``).
* Step B, across nodes (slow links): the reduce-scatter route (``reduction/scatter.py``) over the
  inter-node group ``l`` on that node sum, with ``T_l``'s slices and the inter-node owners' ranges in it
  (``NodeLayout.slices``, ``NodeLayout.ranges``), windowed to ``zen.bucket_cap_mb`` there: the
  sparsifiers (natural rows, DGC) compress the node sum of ``T_l``, so their per-element memory (DGC's
  residual, momentum) covers ``|T_l| ≈ P/L`` elements a rank instead of ``P``; each owner receives its
  range.

This module is the node level's layout and Step A; ``ScatterRoute`` (``reduction/scatter.py``) runs the
steps in order.

``op="mean"`` sums at both levels and divides the owner's range by ``n`` once at the end: the result
is the global sum over ``n`` exactly as the flat path's, and DGC sees sums of local gradients as it
does flat (its ``clip_norm`` rule ``c/√N`` then bounds the node sums as ``c/√n`` bounds the ranks').

Lossless schemes stay lossless: the node sum of sparse rows is still sparse rows, and both levels sum.

Legend: ``_N`` elements of the bucket, ``_T`` elements of this rank's shard ``T_l``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import torch

from .plan import GradSlice
from .slices import clip_slices

__all__ = ["NodeReduceScatter", "NodeLayout"]


@dataclasses.dataclass
class NodeLayout:
    """One bucket layout's node-level plan (built once per layout, the same on every rank of a node
    and every rank of an inter-node group)."""

    width: int
    """Elements of each local rank's block in Step A (the longest ``|T_l|``)."""
    pieces: list[list[tuple[int, int]]]
    """``pieces[l]``: the bucket ranges that make ``T_l``, in order."""
    lens: list[int]
    """``|T_l|`` for every ``l``."""
    rows: torch.Tensor | None
    """When every range has one length ``w`` and they tile the bucket: the owners in block order,
    so Step A's reorder is one ``index_select`` of ``[n, w]`` rows (no padding)."""
    shard_len: int
    """``|T_l|`` of this rank."""
    windows: list[tuple[int, int, list[tuple[int, int]]]]
    """Step A per column window ``[c0, c1)`` of the blocks: the parts to concatenate, ``(a, b)`` a range
    of the bucket or ``(-1, k)`` ``k`` zeros of padding; empty when one ``index_select`` (``rows``)
    reorders the whole bucket."""
    max_pad: int
    """The longest padding part of any window (one zero buffer serves them all)."""
    slices: list[GradSlice]
    """Step B's bucket, ``T_l`` of this rank: its pieces' slices side by side (offsets in ``T_l``)."""
    ranges: list[tuple[int, int]]
    """Step B's owners: the range of ``T_l`` each rank of the inter-node group owns, in its rank order."""


class NodeReduceScatter:
    """The node level of one rank's reduce-scatter route (``ScatterRoute`` holds it): layouts and Step A.

    Args:
        node: the node's dense part (``NodeShardedReduce``: its intra-node Communicator, local rank,
            ``L``, and ``owners``: ``owners[l]`` the data-parallel ranks with local index ``l`` in
            their inter-node group's rank order).
        inter_rank: this rank's place in its inter-node group.
        cap_bytes: the cap Step A's windows stay within (half of it: ``zen.bucket_cap_mb``).
    """

    def __init__(self, node, inter_rank: int, cap_bytes: int) -> None:
        owners = getattr(node, "owners", None)
        if not owners:
            raise NotImplementedError("zen.hierarchical with a reduce-scatter needs the node layout of the "
                                      "data-parallel group (NodeShardedReduce(owners=...), built by "
                                      "maybe_node_sharding); supported: node groups built by zen_ext")
        L = node.local_size
        if len(owners) != L or len({len(o) for o in owners}) != 1:
            raise NotImplementedError(f"zen.hierarchical with a reduce-scatter needs {L} local ranks per node, each "
                                      f"with one peer per node (owners {owners}); uneven nodes are not supported")
        self.node, self.cap_bytes = node, cap_bytes
        self.owners = [list(o) for o in owners]
        self.n = sum(len(o) for o in self.owners)
        self.me = self.owners[node.local_rank][inter_rank]
        """This rank's data-parallel rank (its place among the owners)."""
        if sorted(r for o in self.owners for r in o) != list(range(self.n)):
            raise ValueError(f"zen.hierarchical: the node layout's owners ({owners}) must name every data-parallel "
                             f"rank 0..{self.n - 1} once")
        self.layouts: dict[tuple, NodeLayout] = {}
        """Every bucket layout seen, planned once (bounded)."""

    def layout(self, flat_N: torch.Tensor, slices: Sequence[GradSlice], ranges: list[tuple[int, int]]) -> NodeLayout:
        """The bucket's node layout (``ranges``: validated, one per data-parallel rank, tiling the bucket):
        planned once per bucket layout and agreed inside the node the first time."""
        key = (flat_N.numel(), flat_N.element_size(), tuple(ranges),
               tuple((s.name, s.offset, s.numel, tuple(s.shape), s.start) for s in slices))
        lay = self.layouts.get(key)
        if lay is None:
            if len(self.layouts) > 4096:  # layouts change only on engine bucket rebuilds; bound the cache
                self.layouts.clear()
            self._agree(key, flat_N.dtype)
            lay = self.layouts[key] = self._plan(flat_N.numel(), slices, ranges, flat_N.element_size(), flat_N.device)
        return lay

    def node_sum(self, flat_N: torch.Tensor, lay: NodeLayout) -> torch.Tensor:
        """Step A, dense inside the node: the node's sum of this rank's ``T_l`` (``lay.shard_len`` elements).

        One reorder and reduce-scatter per column window (one cat of the owners' ranges and the padding:
        one kernel on a GPU), or one index_select when the even ranges fit in one window.
        """
        if lay.rows is not None:
            node_sum = self.node.intra.reduce_scatter(flat_N.view(self.n, -1).index_select(0, lay.rows).reshape(-1))
        else:
            pad = flat_N.new_zeros(lay.max_pad) if lay.max_pad else None
            node_sum = flat_N.new_empty(lay.width) if len(lay.windows) > 1 else None
            for c0, c1, parts in lay.windows:
                blocks = torch.cat([flat_N[a:b] if a >= 0 else pad[:b] for a, b in parts])
                if node_sum is None:
                    node_sum = self.node.intra.reduce_scatter(blocks)
                else:  # straight into the shard's window: no separate result buffer
                    self.node.intra.reduce_scatter(blocks, out=node_sum[c0:c1])
        return node_sum[: lay.shard_len]

    def _plan(self, numel: int, slices: Sequence[GradSlice], ranges: list[tuple[int, int]], itemsize: int,
              device) -> NodeLayout:
        """``T_l``'s pieces for every ``l``, Step A's windows, and this rank's ``T_l`` as Step B's bucket."""
        pieces = [[tuple(ranges[r]) for r in o] for o in self.owners]
        lens = [sum(b - a for a, b in p) for p in pieces]
        width, mine = max(lens), self.node.local_rank
        lengths = {b - a for a, b in ranges}
        cap = max(1, self.cap_bytes // itemsize)
        # Columns per Step A window: L·step elements ≤ half the cap, so the window's copy plus the
        # collective's own staging of it (a transport may reduce a copy) stay within the cap.
        step = max(1, cap // (2 * len(pieces)))
        rows, windows = None, []
        if width <= step and len(lengths) == 1 and width and ranges[0][0] == 0 and all(
                ranges[r][0] == r * (numel // self.n) for r in range(self.n)) and numel % self.n == 0:
            rows = torch.tensor([r for o in self.owners for r in o], dtype=torch.long, device=device)
        else:
            windows = [(c0, min(c0 + step, width), _window(pieces, c0, min(c0 + step, width)))
                       for c0 in range(0, width, step)]
        # This rank's shard T_l: its pieces' slices side by side, and each inter-node owner's range in it.
        t_slices, inter_ranges, at = [], [], 0
        for a, b in pieces[mine]:
            t_slices.extend(dataclasses.replace(s, offset=s.offset + at) for s in clip_slices(slices, a, b))
            inter_ranges.append((at, at + b - a))
            at += b - a
        max_pad = max((b for _, _, parts in windows for a, b in parts if a < 0), default=0)
        return NodeLayout(width=width, pieces=pieces, lens=lens, rows=rows, shard_len=lens[mine], windows=windows,
                          max_pad=max_pad, slices=t_slices, ranges=inter_ranges)

    def _agree(self, key: tuple, dtype) -> None:
        """A new layout shapes Step A's collective: the node's ranks compare it once (one object all-gather
        inside the node) and every rank raises, naming both, instead of mismatching sizes there."""
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()
        mine = {"numel": key[0], "dtype": str(dtype), "layout": digest}
        for r, theirs in enumerate(self.node.intra.all_gather_object(mine)):
            if theirs != mine:
                raise RuntimeError(f"zen.hierarchical: the ranks of a node disagree on a bucket's layout (numel, "
                                   f"dtype, owner ranges, slices): local rank {r} has {theirs}, local rank "
                                   f"{self.node.local_rank} has {mine}; every rank must pass the same layout")


def _window(pieces: list[list[tuple[int, int]]], c0: int, c1: int) -> list[tuple[int, int]]:
    """Step A's parts for columns ``[c0, c1)`` of every block ``T_l`` in turn: the bucket ranges that fall
    there (``pieces[l]`` laid end to end), then ``(-1, k)`` for the ``k`` columns past ``|T_l|``."""
    parts = []
    for block in pieces:
        at = 0
        for a, b in block:
            lo, hi = max(c0, at), min(c1, at + b - a)
            if hi > lo:
                parts.append((a + lo - at, a + hi - at))
            at += b - a
        if c1 > max(c0, at):
            parts.append((-1, c1 - max(c0, at)))
    return parts
