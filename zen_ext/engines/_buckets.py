"""Flat gradient buckets ↔ named GradSlices, re-bucketing to ``bucket_cap_mb``, and node sharding.

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
  synchronization (paper §4), snapping cuts to embedding-row boundaries so row sparsity survives.

Elements covered by no slice (alignment padding) are reduced dense by the Synchronizer.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..core.synchronizer import GradSlice


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


def _row_width(s: GradSlice) -> int:
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
            w = _row_width(s)
            if s.offset < cuts[i] < s.offset + s.numel and w > 1:
                cuts[i] = s.offset + round((cuts[i] - s.offset) / w) * w
    for i in range(1, parts + 1):  # keep cuts monotone after snapping
        cuts[i] = max(cuts[i], cuts[i - 1])
    return cuts


def clip_slices(slices: Sequence[GradSlice], start: int, end: int) -> list[GradSlice]:
    """The parts of ``slices`` inside ``[start, end)``, rebased to ``start``.

    A clipped 2-D slice keeps its row shape when the part is whole rows; any other part is 1-D.
    Names are kept and ``start`` records where the part begins in its parameter, so sparsifier
    memory (DGC residuals) is keyed by ``(name, start)``.
    """
    out = []
    for s in slices:
        a, b = max(s.offset, start), min(s.offset + s.numel, end)
        if a >= b:
            continue
        if (a, b) == (s.offset, s.offset + s.numel):
            out.append(_rebase(s, start))
            continue
        w = _row_width(s)
        whole_rows = w > 1 and (a - s.offset) % w == 0 and (b - a) % w == 0
        shape = ((b - a) // w, *s.shape[1:]) if whole_rows else (b - a,)
        out.append(GradSlice(s.name, a - start, b - a, tuple(shape), start=s.start + a - s.offset))
    return out


# --- hierarchical synchronization (paper §4) --------------------------------------------------------
def node_layout(dp_ranks: Sequence[int], local_size: int) -> list[list[int]]:
    """The data-parallel ranks grouped by node (global rank // ``local_size``), nodes in order.

    Both the ``deepspeed`` launcher and torchrun number ranks node by node, so a node holds the
    global ranks ``[node·local_size, (node+1)·local_size)``.
    """
    nodes: dict[int, list[int]] = {}
    for r in sorted(dp_ranks):
        nodes.setdefault(r // local_size, []).append(r)
    return [nodes[k] for k in sorted(nodes)]


def hierarchy_applies(nodes: list[list[int]]) -> bool:
    """Node sharding needs several nodes, each holding the same number (> 1) of the group's ranks."""
    sizes = {len(n) for n in nodes}
    return len(nodes) > 1 and len(sizes) == 1 and sizes.pop() > 1


def build_node_sharding(dp_ranks: Sequence[int], all_dp_groups: Iterable[Sequence[int]], local_size: int,
                        rank: int, required: bool = False):
    """Create the intra-node and inter-node groups of every data-parallel group (a collective).

    ``torch.distributed.new_group`` must be called by every rank for every group in the same order,
    so each rank passes all DP groups (e.g. all-gathered), which are walked in sorted order.

    Args:
        dp_ranks: this rank's data-parallel group (global ranks).
        all_dp_groups: every data-parallel group, as seen by any rank.
        local_size: ranks per node (the launcher's LOCAL_WORLD_SIZE / LOCAL_SIZE).
        rank: this rank's global rank.
        required: raise instead of returning None when node sharding cannot apply.

    Returns:
        ``(NodeShardedReduce, inter_node_group)``, or ``(None, None)`` when some DP group does not
        span several nodes with the same number (> 1) of ranks on each.

    Raises:
        ValueError: ``required`` and node sharding does not apply.
    """
    import torch.distributed as dist

    groups = sorted({tuple(g) for g in all_dp_groups})
    layouts = {g: node_layout(g, local_size) for g in groups}
    if not all(hierarchy_applies(nodes) for nodes in layouts.values()):
        if required:
            raise ValueError(f"zen.hierarchical (True) must be false or \"auto\" here: the data-parallel group "
                             f"{list(dp_ranks)} does not span several nodes with several ranks each (local size "
                             f"{local_size})")
        return None, None
    node = inter_group = None
    for g in groups:
        nodes = layouts[g]
        for members in nodes:
            grp = dist.new_group(members)
            if rank in members:
                node = NodeShardedReduce(grp, members.index(rank), len(members))
        for i in range(len(nodes[0])):
            across = [n[i] for n in nodes]
            grp = dist.new_group(across)
            if rank in across:
                inter_group = grp
    return node, inter_group


class NodeShardedReduce:
    """Dense reduce-scatter inside the node, a sparse sync across nodes per shard, all-gather back.

    With ``L`` ranks per node and ``N`` nodes, a bucket of ``M`` elements costs each rank about
    ``2·(L−1)/L·M`` dense elements on the fast intra-node links and one sparse synchronization of
    ``M/L`` elements over ``N`` ranks on the slow inter-node links (paper §4: ZEN runs on the
    inter-node level, where the bandwidth is).

    Args:
        intra_group: the torch.distributed group of this rank's node (within its DP group).
        local_rank: this rank's index in ``intra_group``.
        local_size: ``L``.
    """

    def __init__(self, intra_group, local_rank: int, local_size: int) -> None:
        self.intra_group = intra_group
        self.local_rank = local_rank
        self.local_size = local_size
        self.bytes_sent = 0

    def reduce(self, flat: torch.Tensor, slices: Sequence[GradSlice], op: str, sync_shard) -> torch.Tensor:
        """Reduce ``flat`` over all ranks of all nodes; ``sync_shard(shard, shard_slices, op)`` reduces
        one shard across the nodes (the Synchronizer over the inter-node group).

        1. Cut the bucket into ``L`` shards at row boundaries and pad them to one length.
        2. Reduce-scatter inside the node (sum): rank ``l`` holds the node's sum of shard ``l``.
        3. Synchronize shard ``l`` across the nodes (sparse; the mean divides by ``L`` first).
        4. All-gather the shards inside the node and drop the padding.
        """
        import torch.distributed as dist

        # torch 2.13 renamed the *_tensor collectives to *_single (the old names warn).
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        L, flat_N = self.local_size, flat.reshape(-1)
        # Step 1: shards.
        cuts = shard_bounds(flat_N.numel(), slices, L)
        width = max(b - a for a, b in zip(cuts, cuts[1:]))
        padded = torch.zeros(L, width, dtype=flat_N.dtype, device=flat_N.device)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            padded[i, : b - a] = flat_N[a:b]
        # Step 2: reduce-scatter inside the node.
        mine = torch.empty(width, dtype=flat_N.dtype, device=flat_N.device)
        reduce_scatter(mine, padded.reshape(-1), group=self.intra_group)
        self.bytes_sent += (L - 1) * width * flat_N.element_size()
        # Step 3: across nodes, on this rank's shard.
        a, b = cuts[self.local_rank], cuts[self.local_rank + 1]
        shard = mine[: b - a]
        if op == "mean":
            shard.div_(L)
        reduced = sync_shard(shard, clip_slices(slices, a, b), op) if b > a else shard
        mine[: b - a] = reduced
        # Step 4: all-gather inside the node.
        gathered = torch.empty(L * width, dtype=flat_N.dtype, device=flat_N.device)
        all_gather(gathered, mine, group=self.intra_group)
        self.bytes_sent += (L - 1) * width * flat_N.element_size()
        rows = gathered.view(L, width)
        out = torch.empty_like(flat_N)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            out[a:b] = rows[i, : b - a]
        return out.view_as(flat)


# --- one engine bucket, end to end ------------------------------------------------------------------
class BucketReducer:
    """Reduce one engine bucket in place: re-bucket, shard by node or by TP rank, guard, account.

    This is what every engine override calls (DeepSpeed's ``allreduce_bucket`` and ZeRO's
    ``gradient_reduction_w_predivide``); it knows nothing about the engine.

    Args:
        sync: the Synchronizer (over the data-parallel group, or over the inter-node group when
            ``node`` is set).
        cap_bytes: the bucket cap (``zen.bucket_cap_mb``).
        dp_size: ranks of the whole data-parallel group (the dense baseline's ring size).
        node: node-sharded reduction (paper §4) or None.
        tp_comm: the tensor-parallel group, or None.
        tp_shared: parameters replicated across the TP group with identical gradients (AutoTP keeps
            the embedding replicated): each TP rank synchronizes ``1/tp`` of their rows over its DP
            group and the TP ranks exchange the (sparse) results, so the embedding is synchronized
            once per DP group instead of ``tp`` times.
        guard_comm: a group spanning every rank that reduces (DP × TP). When set, a non-finite
            gradient on any rank turns every rank's bucket into NaN without synchronizing it, so a
            loss scaler sees the overflow everywhere and skips the step (a sparsifier would
            otherwise drop NaN/Inf that fall under its threshold), and no residual memory is
            polluted.
    """

    def __init__(self, sync, *, cap_bytes: int, dp_size: int, node: "NodeShardedReduce | None" = None,
                 tp_comm=None, tp_shared: frozenset[str] = frozenset(), guard_comm=None) -> None:
        self.sync = sync
        self.cap_bytes = cap_bytes
        self.dp_size = dp_size
        self.node = node
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        self.tp_shared = frozenset(tp_shared) if self.tp_comm is not None else frozenset()
        self.guard_comm = guard_comm
        self.calls = 0
        self._stats = self._empty()

    @staticmethod
    def _empty() -> dict:
        return {"reduce_calls": 0, "dense_bytes": 0, "intra_bytes_sent": 0, "tp_share_bytes_sent": 0,
                "nonfinite_steps": 0, "natural_local_rows": 0, "natural_union_rows": 0}

    def reduce_(self, flat: torch.Tensor, slices: Sequence[GradSlice], op: str) -> None:
        """Replace ``flat`` (this rank's bucket) by its reduction over the data-parallel group.

        1. Guard: agree whether any rank holds a non-finite gradient; if so, NaN-fill and stop.
        2. Re-bucket to ``cap_bytes`` at parameter boundaries (TP-shared parameters alone).
        3. Reduce each bucket: TP-shared rows split across TP ranks, the rest by node shards or
           directly through the Synchronizer.
        """
        self.calls += 1
        st = self._stats
        st["reduce_calls"] += 1
        flat_N = flat.view(-1)
        n = self.dp_size
        if n > 1:
            st["dense_bytes"] += 2 * (n - 1) * flat_N.numel() * flat_N.element_size() // n
        # Step 1: non-finite guard.
        if self.guard_comm is not None:
            bad = torch.tensor([0.0 if bool(torch.isfinite(flat_N).all()) else 1.0])
            if float(self.guard_comm.all_reduce(bad, "max")[0]) > 0:
                flat_N.fill_(float("nan"))
                st["nonfinite_steps"] += 1
                self.sync.discard_step()  # earlier buckets of this step must not keep their DGC updates
                return
        # Step 2: re-bucket.
        cap = max(1, self.cap_bytes // flat_N.element_size())
        for a, b, members in split_to_cap(flat_N.numel(), slices, cap, self.tp_shared):
            chunk = flat_N[a:b]
            # Step 3: reduce.
            if len(members) == 1 and members[0].name in self.tp_shared:
                out = self._reduce_tp_shared(chunk, members[0], op)
            else:
                out = self._reduce_dp(chunk, members, op)
            chunk.copy_(out)

    def _reduce_dp(self, chunk: torch.Tensor, members: list[GradSlice], op: str) -> torch.Tensor:
        nat = [s for s in members if self.sync.param_kinds.get(s.name) == "natural" and len(s.shape) >= 2]
        if nat:
            self._stats["natural_local_rows"] += sum(_nonzero_rows(chunk, s) for s in nat)
        if self.node is not None:
            before = self.node.bytes_sent
            out = self.node.reduce(chunk, members, op, self.sync.sync_flat)
            self._stats["intra_bytes_sent"] += self.node.bytes_sent - before
        else:
            out = self.sync.sync_flat(chunk, list(members), op)
        if nat:
            self._stats["natural_union_rows"] += sum(_nonzero_rows(out, s) for s in nat)
        return out

    def _reduce_tp_shared(self, chunk: torch.Tensor, s: GradSlice, op: str) -> torch.Tensor:
        """Synchronize this TP rank's share of the rows over DP, then gather the shares over TP."""
        tp = self.tp_comm
        cuts = shard_bounds(chunk.numel(), [s], tp.size)
        a, b = cuts[tp.rank], cuts[tp.rank + 1]
        mine = self._reduce_dp(chunk[a:b], clip_slices([s], a, b), op) if b > a else chunk[a:b]
        width = _row_width(s)
        rows = mine.reshape(-1, width)
        before = tp.stats.snapshot()
        # Only the non-zero rows travel: the synchronized embedding is as sparse as the batch's tokens.
        idx = rows.ne(0).any(1).nonzero().flatten()
        all_idx = tp.all_gather_v(idx)
        all_val = tp.all_gather_v(rows[idx].reshape(-1))
        self._stats["tp_share_bytes_sent"] += (tp.stats - before).bytes_sent
        out = torch.zeros_like(chunk).view(-1, width)
        for r, (ix, val) in enumerate(zip(all_idx, all_val)):
            if ix.numel():
                out[cuts[r] // width + ix] = val.view(-1, width)
        return out.view(-1)

    def pop_stats(self) -> dict:
        """This step's numbers (since the last call), merged with the Synchronizer's."""
        st, self._stats = self._stats, self._empty()
        sync = self.sync.pop_step_stats()
        rec = {k: v for k, v in sync.items() if k not in ("bytes_sent", "bytes_recv", "dense_bytes_sent")}
        rec["dp_bytes_sent"] = sync.get("bytes_sent", 0)
        rec["dp_bytes_recv"] = sync.get("bytes_recv", 0)
        rec["bytes_sent"] = (rec["dp_bytes_sent"] + sync.get("tp_bytes_sent", 0) + st["intra_bytes_sent"]
                             + st["tp_share_bytes_sent"])
        rec["tp_bytes_sent"] = sync.get("tp_bytes_sent", 0) + st["tp_share_bytes_sent"]
        rec.update({k: v for k, v in st.items() if not k.startswith("natural_")})
        if st["natural_local_rows"]:
            # γ of the paper (densification): union of non-zero rows after the sync over one rank's.
            rec["gamma_natural"] = st["natural_union_rows"] / st["natural_local_rows"]
        return rec


def _nonzero_rows(flat_N: torch.Tensor, s: GradSlice) -> int:
    rows = flat_N[s.offset: s.offset + s.numel].view(s.shape[0], -1)
    return int(rows.ne(0).any(1).sum())
