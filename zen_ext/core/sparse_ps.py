"""``sparse_ps``: parameter servers owning contiguous index ranges, COO push and pull (ZEN paper §2.2, §3.1).

The "Sparse PS" of the paper: [Point-to-point, Parallelism, Imbalanced]. Rank ``j`` serves the range
``[j·S, (j+1)·S)``, ``S = ⌈numel/n⌉`` (rows in row form). Every rank pushes the entries of each range to
its owner, the owner sums them, and pulls its aggregate back to every rank. Its partition is the one
ZEN replaces by hashing: embedding gradients are skewed (frequent tokens have small ids, ≥ 60 % of the
non-zeros fall into the first of 8 ranges, paper §2.1 C3), so the first owner receives and sends most
of the traffic. Thesis cost: ``2(n−1)(d + dⁿ)·s·M/n/B`` with skewness ``s``.

Bytes rank ``r`` sends: push ``Σ_{j≠r} (8 + K_r^j·(ib + W·vb))`` (``K_r^j`` of its entries fall into range
``j``); pull ``(n−1)·(8 + U_r·(ib + W·vb))`` for the ``U_r`` aggregated entries of its own range.

Wire format: push ``[offsets in the range (int32, or int64 if numel ≥ 2^31) | values]`` per owner, pull
the same for the owner's aggregate. Duplicates are pushed as they are and summed by the owner.

``range_push_pull`` is shared with ``omnireduce``, which runs the same protocol over 256-element blocks.

Legend: ``_K`` entries, ``_P`` owners (ranks), ``_S`` one range.
"""

from __future__ import annotations

import torch

from .. import ops
from ..comm.base import Communicator
from .coo import decode_coo, encode_coo, finish
from .cost import BLOCK_SIZE, Dims, ProfileView, Traffic, WorkCounts
from .hashing import contiguous_partition_of
from .scheme import PartitionFn, SyncScheme
from .timing import PhaseTimer
from .types import SparseGrad, acc_dtype, as_sparse


def range_size(numel: int, n: int) -> int:
    """``S``: the length of each owner's contiguous range (the last one may be shorter or empty)."""
    return max(1, -(-numel // n))


def range_push_pull(
    comm: Communicator, idx_K: torch.Tensor, val_K: torch.Tensor, numel: int, timer: PhaseTimer,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Push entries to the owners of their contiguous ranges, aggregate, pull every aggregate back.

    Args:
        comm: the ranks.
        idx_K: indices in ``[0, numel)`` (duplicates allowed).
        val_K: their values, ``[K]`` or ``[K, W...]``.
        numel: size of the index space.
        timer: records the phases (``partition_s``, ``push_s``, ``aggregate_s``, ``pull_s``, ``decode_s``).
        out: if given, the result is written into it (``numel·W`` elements of the gradient dtype; the
            inputs are consumed by then, so it may be the gradient itself).

    Returns:
        The sum over ranks as ``[numel, W...]`` in the gradient dtype (each owner sums in fp32 for half
        types and rounds once).
    """
    n, rank = comm.size, comm.rank
    dtype, device, row_shape = val_K.dtype, val_K.device, tuple(val_K.shape[1:])
    size = range_size(numel, n)

    # Step 1: partition by contiguous range (stable, so each owner sees entries in input order).
    timer.start("partition_s")
    owner_K = idx_K // size
    order = torch.argsort(owner_K, stable=True)
    idx_K, val_K, owner_K = idx_K[order], val_K[order], owner_K[order]
    bounds = torch.searchsorted(owner_K, torch.arange(n + 1, device=device)).tolist()

    # Step 2: push each range to its owner (offsets inside the range, so int32 always suffices there).
    timer.start("push_s")
    send = [encode_coo(idx_K[s:e] - j * size, val_K[s:e], numel) if e > s
            else torch.empty(0, dtype=torch.uint8, device=device)
            for j, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
    recv = comm.exchange_v(send)

    # Step 3: aggregate this rank's range (sum, never overwrite; fp32 for half types).
    timer.start("aggregate_s")
    mine = max(0, min(size, numel - rank * size))
    acc = torch.zeros((mine,) + row_shape, dtype=acc_dtype(dtype), device=device)
    touched = torch.zeros(mine, dtype=torch.bool, device=device)
    decoded = [decode_coo(b, numel, row_shape, dtype) for b in recv if b.numel()]
    if decoded:
        off = torch.cat([i for i, _ in decoded])
        acc.index_add_(0, off, torch.cat([v for _, v in decoded]).to(acc.dtype))
        touched[off] = True
    off_out = touched.nonzero().flatten()

    # Step 4: pull: the owner's aggregated entries go to every rank in the gradient dtype (ranges are
    # disjoint, so that is the one rounding of each sum).
    timer.start("pull_s")
    pulled = comm.all_gather_v(encode_coo(off_out, acc[off_out].to(dtype), numel))

    # Step 5: decode every owner's range into the dense result.
    timer.start("decode_s")
    if out is not None:
        out = ops.zero_(out).view((numel,) + row_shape)
    else:
        out = torch.zeros((numel,) + row_shape, dtype=dtype, device=device)
    for j, buf in enumerate(pulled):
        if buf.numel():
            off, vals = decode_coo(buf, numel, row_shape, dtype)
            out[off + j * size] = vals
    timer.stop()
    return out


def predict_range_traffic(p: ProfileView, counts_PP: torch.Tensor, union_per_range: list[float],
                          entry_bytes: float) -> Traffic:
    """The traffic of a range push-pull (``range_push_pull``): ``counts_PP[src, server]`` entries pushed,
    each server's ``union_per_range`` entries pulled by every rank; ``entry_bytes`` per entry."""
    tr = Traffic(p.n)
    tr.exchange_v(counts_PP * entry_bytes)
    tr.all_gather_v([u * entry_bytes for u in union_per_range])
    return tr


class SparsePSScheme(SyncScheme):
    """Contiguous-range parameter servers with COO push and pull (the skewed "Sparse PS" baseline)."""

    name = "sparse_ps"
    wire_phases = ("push_s", "pull_s")

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` losslessly.

        1. Partition: entry ``i`` belongs to owner ``i // ⌈numel/n⌉``.
        2. Push: each owner receives its range's entries from every rank.
        3. Aggregate: the owner sums them (duplicates included).
        4. Pull: the owner's aggregate goes to every rank as COO.
        5. Decode: every rank writes all ranges into the dense result.
        """
        sg = as_sparse(grad)
        timer = PhaseTimer(sg.values.device, enabled=timings is not None)
        # The result goes straight into the caller's buffer when there is one (no result-sized
        # temporary and copy, as in zen), so the comparison with zen is like for like.
        res = finish(range_push_pull(comm, sg.indices, sg.values, sg.numel, timer, out), sg.values.dtype, op,
                     comm.size)
        timer.write_into(timings)
        return out if out is not None else res

    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        return predict_range_traffic(p, p.counts_PP("range_counts"), p.union_per_range(), p.entry_bytes)

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        d = Dims.of(w)
        recv = w.server_recv_max if w.server_recv_max is not None else d.S / d.n
        return {"partition_s": {"sort_s_per_entry": d.K},
                "aggregate_s": {"fill_s_per_byte": d.N / d.n * d.W * d.ab, "scatter_s_per_elem": recv * d.W,
                                "sort_s_per_entry": recv},
                "decode_s": {"fill_s_per_byte": d.dense_out, "scatter_s_per_elem": d.U * d.W}}

    @classmethod
    def partition_fn(cls, numel: int, n: int, *, seed: int = 0, row_width: int = 1,
                     block_size: int = BLOCK_SIZE) -> PartitionFn | None:
        """Contiguous ranges of indices (rows)."""
        return lambda idx: contiguous_partition_of(idx, numel, n)
