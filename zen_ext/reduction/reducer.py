"""One engine bucket, end to end: ``BucketReducer`` (re-bucketing, node or TP shards, the non-finite
guard, the communication worker's pipeline, statistics). Engine adapters call it with a flat buffer and
its slices and know nothing of what happens inside."""

from __future__ import annotations

from typing import Sequence

import torch

from .plan import GradSlice
from .hierarchy import NodeShardedReduce
from .scatter import ScatterRoute
from .slices import clip_slices, row_width, shard_bounds, split_to_cap


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
        tp_shared: parameters of a ``row_sparse`` kind replicated across the TP group with identical
            gradients (AutoTP keeps the embedding replicated): each TP rank synchronizes ``1/tp`` of
            their rows over its DP group and the TP ranks exchange the (sparse) results, so the
            embedding is synchronized once per DP group instead of ``tp`` times.
        guard_comm: a group spanning every rank that reduces (DP × TP). When set, a non-finite
            gradient on any rank turns every rank's bucket into NaN without synchronizing it, so a
            loss scaler sees the overflow everywhere and skips the step (a sparsifier would
            otherwise drop NaN/Inf that fall under its threshold), and no residual memory is
            polluted.
        worker: a communication worker (``zen_ext.reduction.CommWorker``, ``zen.async_sync``) or
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
        self._rows_cache: dict[tuple, list[tuple[str, GradSlice]]] = {}
        self._route: ScatterRoute | None = None

    @property
    def route(self) -> ScatterRoute:
        """The reduce-scatter route (``reduction/scatter.py``), built on first use: the all-reduce path never
        needs it (and a node without its owners' layout is refused only here)."""
        if self._route is None:
            self._route = ScatterRoute(self.sync, self.cap_bytes, self.node)
        return self._route

    @staticmethod
    def _empty() -> dict:
        return {"reduce_calls": 0, "dense_bytes": 0, "intra_bytes_sent": 0, "tp_share_bytes_sent": 0,
                "nonfinite_steps": 0, "rows": {}}

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

    def reduce_scatter_(self, flat: torch.Tensor, slices: Sequence[GradSlice], ranges: Sequence[tuple[int, int]],
                        op: str, out: torch.Tensor) -> torch.Tensor:
        """Write this rank's range ``ranges[dp rank]`` of ``flat``'s reduction over the data-parallel group
        into ``out`` (ZeRO-2's ``reduce_scatter``, ZeRO-3, FSDP2); ``flat`` is not modified.

        1. Guard as ``reduce_``: a non-finite gradient on any rank NaN-fills ``out`` on every rank.
        2. The reduce-scatter route (``reduction/scatter.py`` ``ScatterRoute``): windows of ``cap_bytes``
           at parameter boundaries, each routed as ``sync_flat`` routes a bucket and reduce-scattered by
           the Synchronizer's ``rs_scheme`` into its place in ``out``, in turn on this thread; with node
           sharding (``zen.hierarchical``) dense inside the node first, the route across the nodes on the
           node's sum of this rank's share.

        Raises:
            NotImplementedError: TP-shared parameters (supported: a data-parallel group, flat or by node).
        """
        if self.tp_shared:
            raise NotImplementedError("reduce_scatter_: TP-shared parameters are not served with a reduce-scatter; "
                                      "supported: a data-parallel group (flat, or node-level with zen.hierarchical)")
        self.calls += 1
        st = self._stats
        st["reduce_calls"] += 1
        flat_N = flat.view(-1)
        if self.dp_size > 1:
            st["dense_bytes"] += (self.dp_size - 1) * max(e - s for s, e in ranges) * flat_N.element_size()
        # Step 1: non-finite guard.
        if self.guard_comm is not None:
            bad = (~torch.isfinite(flat_N).all()).to(device=self.guard_comm.device, dtype=torch.float32).reshape(1)
            if float(self.guard_comm.all_reduce(bad, "max")[0]) > 0:
                out.fill_(float("nan"))
                st["nonfinite_steps"] += 1
                self.sync.discard_step()
                return out
        # Step 2: the route.
        before = self.node.bytes_sent if self.node is not None else 0
        self.route(flat_N, slices, ranges, op, out)
        if self.node is not None:
            st["intra_bytes_sent"] += self.node.bytes_sent - before
        return out

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
                nat = self._row_slices(members)
                if nat:
                    self._add_rows(0, chunk, nat)
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
                    self._add_rows(1, out, nat)
            if first is not None:
                raise first

    def _reduce_dp(self, chunk: torch.Tensor, members: list[GradSlice], op: str) -> torch.Tensor:
        nat = self._row_slices(members)
        if nat:
            self._add_rows(0, chunk, nat)
        if self.node is not None and chunk.numel():
            before = self.node.bytes_sent
            out = self.node.reduce(chunk, members, op, self.sync.sync_flat)
            self._stats["intra_bytes_sent"] += self.node.bytes_sent - before
        else:
            # The reduced bucket goes straight back into the engine's buffer: no bucket-sized
            # temporary and no copy (sync_flat reads every range before writing it).
            out = self.sync.sync_flat(chunk, list(members), op, out=chunk)
        if nat:
            self._add_rows(1, out, nat)
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
        width = row_width(s)
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
        rec.update({k: v for k, v in st.items() if k != "rows"})
        kinds = sorted(st["rows"])
        counts = _read_counts(*(c for k in kinds for c in st["rows"][k]))  # one read per step
        for i, kind in enumerate(kinds):
            local, union = counts[2 * i], counts[2 * i + 1]
            if local:
                # γ of the paper (densification): union of non-zero rows after the sync over one rank's.
                rec[f"gamma_{kind}"] = union / local
        return rec

    def _row_slices(self, members) -> list[tuple[str, GradSlice]]:
        """The slices of a bucket whose kind is ``row_sparse`` (γ's rows are counted on them), with
        their kinds, found once per layout."""
        key = tuple(members)
        found = self._rows_cache.get(key)
        if found is None:
            if len(self._rows_cache) > 4096:  # layouts change only on bucket rebuilds; bound the cache
                self._rows_cache.clear()
            kinds = self.sync.param_kinds
            found = self._rows_cache[key] = [(kinds[s.name], s) for s in members
                                             if kinds.get(s.name) in self.sync.row_kinds and len(s.shape) >= 2]
        return found

    def _add_rows(self, when: int, flat_N: torch.Tensor, found: list[tuple[str, GradSlice]]) -> None:
        """Add the non-zero rows of the slices ``found`` of ``flat_N`` to their kind's count ``when``
        (0: this rank's, before the sync; 1: the union, after), on the bucket's device: counted per
        bucket, read once per step (``pop_stats``), never a host sync per bucket."""
        for kind, s in found:
            if s.numel:  # an empty share (fewer rows than TP ranks) has none
                rows = flat_N[s.offset : s.offset + s.numel].view(s.shape[0], -1)
                counts = self._stats["rows"].setdefault(kind, [0, 0])
                counts[when] = counts[when] + rows.ne(0).any(1).sum()


def _read_counts(*counts) -> list[int]:
    """Counts that are ints or device tensors, as ints, with one host read for all the tensors."""
    tensors = [c for c in counts if isinstance(c, torch.Tensor)]
    if not tensors:
        return [int(c) for c in counts]
    read = iter(torch.stack(tensors).tolist())  # every count lives on the buckets' device
    return [next(read) if isinstance(c, torch.Tensor) else int(c) for c in counts]
