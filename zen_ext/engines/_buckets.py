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
import os
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

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
HOST_ENV = "ZEN_EXT_HOST"
"""Overrides the host name a rank reports for the hierarchy decision: set it per machine when host
names do not tell machines apart (identical container names), or per emulated node in tests."""


def local_host_facts() -> tuple[str, int]:
    """This process's ``(host, local rank)``: ``$ZEN_EXT_HOST`` or the host name, and ``$LOCAL_RANK``
    (-1 when the launcher sets none)."""
    import socket

    return os.environ.get(HOST_ENV) or socket.gethostname(), int(os.environ.get("LOCAL_RANK", "-1"))


def node_layout(dp_ranks: Sequence[int], node_of: "int | Sequence[Hashable]") -> list[list[int]]:
    """The data-parallel ranks grouped by node, nodes ordered by their lowest rank.

    Args:
        dp_ranks: the group's global ranks.
        node_of: each global rank's host (a sequence indexed by global rank), or, for a launcher
            that numbers ranks node by node with equal nodes, the ranks per node (``rank // node_of``).
    """
    nodes: dict[Hashable, list[int]] = {}
    for r in sorted(dp_ranks):
        nodes.setdefault(r // node_of if isinstance(node_of, int) else node_of[r], []).append(r)
    return sorted(nodes.values(), key=lambda members: members[0])


def hierarchy_applies(nodes: list[list[int]]) -> bool:
    """Node sharding needs several nodes, each holding the same number (> 1) of the group's ranks."""
    sizes = {len(n) for n in nodes}
    return len(nodes) > 1 and len(sizes) == 1 and sizes.pop() > 1


def decide_hierarchy(setting: "bool | str", hosts: Sequence[Hashable], dp_groups: Iterable[Sequence[int]],
                     local_ranks: Sequence[int] | None = None) -> tuple[dict | None, str]:
    """Whether to reduce node by node, from facts every rank holds alike (a pure function).

    Every rank must reach the same answer, because creating the node groups is a collective over
    the whole world: so the decision reads gathered facts (each rank's host and local rank, every
    data-parallel group), never a rank's own environment (``LOCAL_WORLD_SIZE`` differs between the
    nodes of an uneven hostfile), and node membership is the actual host membership.

    1. Host names must identify machines: two ranks reporting the same host and local rank mean
       they do not (set ``ZEN_EXT_HOST`` per machine).
    2. Every data-parallel group must span several nodes with the same number (> 1) of its ranks on
       each; uneven nodes are not supported (shards would differ in length across nodes).

    Args:
        setting: ``zen.hierarchical``: True, False or ``"auto"``.
        hosts: each global rank's host (index = global rank).
        dp_groups: every data-parallel group (global ranks; repeats are fine).
        local_ranks: each global rank's launcher local rank (-1 unknown), for step 1.

    Returns:
        ``(layouts, reason)``: ``layouts`` maps each DP group (a sorted tuple) to its nodes, or is
        None when flat ZEN runs; ``reason`` says why, in words.

    Raises:
        ValueError: ``setting`` is True and there are not several multi-rank nodes, or the hosts are
            ambiguous.
        NotImplementedError: ``setting`` is True and a group's nodes hold different numbers of ranks.
    """
    if setting is False:
        return None, "zen.hierarchical is false"
    required = setting is True
    # Step 1: host names must tell machines apart.
    seen: dict[tuple, int] = {}
    for r, (host, lr) in enumerate(zip(hosts, local_ranks or [-1] * len(hosts))):
        if lr >= 0 and (host, lr) in seen:
            reason = (f"ranks {seen[(host, lr)]} and {r} both report host {host!r} with local rank {lr}, so host "
                      f"names do not identify machines (set {HOST_ENV} to a per-machine name)")
            if required:
                raise ValueError(f'zen.hierarchical (True) must be false or "auto" here: {reason}')
            return None, reason
        seen[(host, lr)] = r
    # Step 2: every group over several equal multi-rank nodes.
    layouts = {g: node_layout(g, hosts) for g in sorted({tuple(sorted(g)) for g in dp_groups})}
    for g, nodes in layouts.items():
        if hierarchy_applies(nodes):
            continue
        where = ", ".join(f"{hosts[n[0]]}: {n}" for n in nodes)
        sizes = {len(n) for n in nodes}
        if len(nodes) > 1 and len(sizes) > 1 and max(sizes) > 1:
            reason = f"the data-parallel group {list(g)} spans nodes of different sizes ({where})"
            if required:
                raise NotImplementedError(
                    f"zen.hierarchical (True) supports data-parallel groups spread evenly over several nodes (the "
                    f"same number, > 1, of ranks on each); {reason}; use \"auto\" (flat ZEN here) or false")
        else:
            reason = f"the data-parallel group {list(g)} does not span several nodes with several ranks each ({where})"
            if required:
                raise ValueError(f'zen.hierarchical (True) must be false or "auto" here: {reason}')
        return None, reason
    nodes = next(iter(layouts.values()))
    return layouts, f"{len(nodes)} nodes of {len(nodes[0])} ranks per data-parallel group"


def create_node_groups(layouts: dict, rank: int):
    """Create the intra-node and inter-node groups of every data-parallel group (a collective).

    ``torch.distributed.new_group`` must be called by every rank for every group in the same order:
    ``layouts`` (from ``decide_hierarchy``, the same on every rank) is walked in sorted order.

    Returns:
        ``(NodeShardedReduce, inter_node_group)`` of this rank.
    """
    import torch.distributed as dist

    node = inter_group = None
    for g in sorted(layouts):
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


def build_node_sharding(dp_ranks: Sequence[int], all_dp_groups: Iterable[Sequence[int]],
                        node_of: "int | Sequence[Hashable]", rank: int, required: bool = False):
    """Decide (``decide_hierarchy``) and create the node groups (a collective over the world).

    Args:
        dp_ranks: this rank's data-parallel group (global ranks).
        all_dp_groups: every data-parallel group, as seen by any rank.
        node_of: each global rank's host, or the ranks per node (see ``node_layout``).
        rank: this rank's global rank.
        required: ``zen.hierarchical`` true (raise when it cannot apply) instead of ``"auto"``.

    Returns:
        ``(NodeShardedReduce, inter_node_group)``, or ``(None, None)`` when node sharding does not apply.

    Raises:
        ValueError, NotImplementedError: ``required`` and node sharding cannot apply (``decide_hierarchy``).
    """
    groups = [tuple(g) for g in all_dp_groups]
    if isinstance(node_of, int):
        node_of = [r // node_of for r in range(max(max(g) for g in groups) + 1)]
    layouts, _ = decide_hierarchy(True if required else "auto", node_of, groups)
    return create_node_groups(layouts, rank) if layouts is not None else (None, None)


def maybe_node_sharding(setting: "bool | str", dp_ranks: Sequence[int], rank: int, log=None):
    """The engine's hierarchy step: gather the facts once, decide, create the groups.

    One object all-gather over the world (each rank's setting, host, local rank and data-parallel
    group), at attach time only, even when the setting is false: a rank configured differently must
    not skip a collective its peers enter. The decision is then identical on every rank by
    construction, so either every rank creates the node groups or none does.

    Args:
        setting: ``zen.hierarchical``.
        dp_ranks: this rank's data-parallel group.
        rank: this rank's global rank.
        log: a logger for the one line that says why ``"auto"`` runs flat (rank 0 only), or None.

    Returns:
        ``(NodeShardedReduce | None, inter_node_group | None, reason)``.

    Raises:
        RuntimeError: ranks are configured with different ``zen.hierarchical`` (naming both).
        ValueError, NotImplementedError: see ``decide_hierarchy`` (on every rank alike).
    """
    import torch.distributed as dist

    facts = [None] * dist.get_world_size()
    dist.all_gather_object(facts, (setting, *local_host_facts(), tuple(dp_ranks)))
    for r, f in enumerate(facts):
        if f[0] != setting or type(f[0]) is not type(setting):  # True == 1 must not pass
            raise RuntimeError(f"zen: ranks disagree on zen.hierarchical: rank {r} has {f[0]!r}, rank {rank} has "
                               f"{setting!r}; every rank must use the same value")
    hosts, local_ranks, groups = [f[1] for f in facts], [f[2] for f in facts], [f[3] for f in facts]
    layouts, reason = decide_hierarchy(setting, hosts, groups, local_ranks)
    if layouts is None:
        if log is not None and rank == 0 and setting == "auto":
            log.info('zen: hierarchical "auto" runs flat ZEN over each data-parallel group: %s', reason)
        return None, None, reason
    return (*create_node_groups(layouts, rank), reason)


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
        # An empty shard is synchronized too: the Synchronizer agrees each new layout over the TP group,
        # and a TP peer with a longer bucket may hold a non-empty shard here. An empty part of the
        # bucket's first slice names the layout, so it is new for each bucket, as on the peers.
        part = clip_slices(slices, a, b)
        if not part and slices:
            first = min(slices, key=lambda s: s.offset)
            part = [GradSlice(first.name, 0, 0, (0,), start=first.start)]
        mine[: b - a] = sync_shard(shard, part, op)
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
        worker: a communication worker (``zen_ext.engines.ddp.CommWorker``, ``zen.async_sync``) or
            None. With it, an engine bucket that re-buckets into several ZEN buckets is pipelined:
            the worker synchronizes bucket ``k`` (the data-parallel collectives, in bucket order)
            while this thread compresses bucket ``k + 1`` (DGC, natural rows). Used without node
            sharding and without a TP group (whose collectives DGC's thresholds need on this thread);
            results are bitwise equal to the sequential path.
    """

    def __init__(self, sync, *, cap_bytes: int, dp_size: int, node: "NodeShardedReduce | None" = None,
                 tp_comm=None, tp_shared: frozenset[str] = frozenset(), guard_comm=None, worker=None) -> None:
        self.sync = sync
        self.worker = worker if node is None and not (tp_comm is not None and tp_comm.size > 1) else None
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

    def reduce_(self, flat: torch.Tensor, slices: Sequence[GradSlice], op: str, *, pipelined: bool = True) -> None:
        """Replace ``flat`` (this rank's bucket) by its reduction over the data-parallel group.

        ``pipelined=False`` reduces the ZEN buckets in turn on the calling thread even with a worker:
        a job that already runs on the worker (DeepSpeed's asynchronous IPG path) must not wait on
        jobs queued behind itself.

        1. Guard: agree whether any rank holds a non-finite gradient; if so, NaN-fill and stop.
        2. Re-bucket to ``cap_bytes`` at parameter boundaries (TP-shared parameters alone).
        3. Reduce each bucket: TP-shared rows split across TP ranks, the rest by node shards or
           directly through the Synchronizer (pipelined over the worker when there is one).
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
            # The flag is built on the communicator's device (NCCL refuses CPU tensors) without a host
            # sync; reading the agreed flag is the guard's one host synchronization.
            bad = (~torch.isfinite(flat_N).all()).to(device=self.guard_comm.device, dtype=torch.float32).reshape(1)
            if float(self.guard_comm.all_reduce(bad, "max")[0]) > 0:
                flat_N.fill_(float("nan"))
                st["nonfinite_steps"] += 1
                self.sync.discard_step()  # earlier buckets of this step must not keep their DGC updates
                return
        # Step 2: re-bucket.
        cap = max(1, self.cap_bytes // flat_N.element_size())
        chunks = list(split_to_cap(flat_N.numel(), slices, cap, self.tp_shared))
        if pipelined and self.worker is not None and len(chunks) > 1:
            self._reduce_pipelined(flat_N, chunks, op)
            return
        for a, b, members in chunks:
            chunk = flat_N[a:b]
            # Step 3: reduce.
            if len(members) == 1 and members[0].name in self.tp_shared:
                out = self._reduce_tp_shared(chunk, members[0], op)
            else:
                out = self._reduce_dp(chunk, members, op)
            if out.data_ptr() != chunk.data_ptr():  # the direct path already wrote into the chunk
                chunk.copy_(out)

    def _reduce_pipelined(self, flat_N: torch.Tensor, chunks: list, op: str) -> None:
        """Step 3 with the worker: compress bucket ``k + 1`` here while the worker synchronizes ``k``.

        1. Plan every bucket first: a new layout's agreement is a data-parallel collective, and from
           step 2 on only the worker talks to the data-parallel group (one FIFO: bucket order, the
           same on every rank).
        2. Per bucket: prepare (all reads of the bucket, DGC memory) here, then hand the
           communicating half to the worker; its result lands in the bucket itself.
        3. Wait for every handed-over bucket, also when a later prepare failed (no job outlives the
           call), and re-raise the first failure.
        """
        # Step 1: plans.
        for a, b, members in chunks:
            self.sync.plan_flat(flat_N[a:b], list(members), op)
        # Step 2: prepare here, finish on the worker.
        pending = []
        try:
            for a, b, members in chunks:
                chunk = flat_N[a:b]
                nat = [s for s in members if self.sync.param_kinds.get(s.name) == "natural" and len(s.shape) >= 2]
                if nat:
                    self._stats["natural_local_rows"] += sum(_nonzero_rows(chunk, s) for s in nat)
                prep = self.sync.prepare_flat(chunk, list(members), op, out=chunk)
                # CUDA: the prepared tensors come from this stream and are read on the worker's.
                job = self.worker.submit(lambda prep=prep: self.sync.finish_flat(prep), [chunk, *prep.tensors()])
                pending.append((job, chunk, nat))
        finally:
            # Step 3: drain.
            first = None
            for fut, chunk, nat in pending:
                try:
                    out = fut.wait()
                except BaseException as e:  # noqa: BLE001 - every job is waited for; the first error wins
                    first = first or e
                    continue
                if nat:
                    self._stats["natural_union_rows"] += sum(_nonzero_rows(out, s) for s in nat)
            if first is not None:
                raise first

    def _reduce_dp(self, chunk: torch.Tensor, members: list[GradSlice], op: str) -> torch.Tensor:
        nat = [s for s in members if self.sync.param_kinds.get(s.name) == "natural" and len(s.shape) >= 2]
        if nat:
            self._stats["natural_local_rows"] += sum(_nonzero_rows(chunk, s) for s in nat)
        if self.node is not None and chunk.numel():
            before = self.node.bytes_sent
            out = self.node.reduce(chunk, members, op, self.sync.sync_flat)
            self._stats["intra_bytes_sent"] += self.node.bytes_sent - before
        else:
            # The reduced bucket goes straight back into the engine's buffer: no bucket-sized
            # temporary and no copy (sync_flat reads every range before writing it).
            out = self.sync.sync_flat(chunk, list(members), op, out=chunk)
        if nat:
            self._stats["natural_union_rows"] += sum(_nonzero_rows(out, s) for s in nat)
        return out

    def _reduce_tp_shared(self, chunk: torch.Tensor, s: GradSlice, op: str) -> torch.Tensor:
        """Synchronize this TP rank's share of the rows over DP, then gather the shares over TP."""
        tp = self.tp_comm
        cuts = shard_bounds(chunk.numel(), [s], tp.size)
        a, b = cuts[tp.rank], cuts[tp.rank + 1]
        # An empty share (fewer rows than TP ranks) still goes through the Synchronizer, which agrees
        # every new layout with the TP peers; skipping it would leave them waiting. Its empty slice keeps
        # the parameter's name, so the layout is new for each parameter, as on the peers.
        part = clip_slices([s], a, b) or [GradSlice(s.name, 0, 0, (0, *s.shape[1:]), start=s.start + a - s.offset)]
        mine = self._reduce_dp(chunk[a:b], part, op)
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
    if not s.numel:  # an empty share (fewer rows than TP ranks)
        return 0
    rows = flat_N[s.offset: s.offset + s.numel].view(s.shape[0], -1)
    return int(rows.ne(0).any(1).sum())
