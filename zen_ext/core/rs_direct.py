"""``direct`` reduce-scatter: each rank sends each owner the COO entries that fall in the owner's range,
in one exchange, and each owner sums what it receives.

One round and only each rank's own non-zeros on the wire, but the load follows the data: under skew
(embedding rows of frequent tokens) the owners of hot ranges receive far more than the others (ZEN's
hash partition exists to avoid exactly that). Bytes rank ``j`` sends: ``Σ_{r≠j} min(C_jr·(i + v),
|R_r|·v)`` (``C_jr`` its entries in ``R_r``, ``i``/``v`` index/value bytes: a range denser than its COO
goes dense, pre-summed), plus an 8-byte count per peer; an owner receives the same sum over senders.

Wire format per (sender, owner): ``[positions in R_r (int32, or int64 past 2^31) | values]``, or
``|R_r|`` dense values when that is not larger (the size tells them apart: a COO payload is strictly
smaller than the dense one by this rule).

Legend: ``_K`` entries, ``_R`` this rank's range (in index units: rows of a row-form gradient).
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from .coo import finish
from .reduce_scatter import ReduceScatterScheme, RSProfile, as_units, register_reduce_scatter
from .timing import PhaseTimer
from .types import acc_dtype, index_dtype
from .wire import exchange_packed, pack, view_as


def predict_direct_bytes(p: RSProfile) -> dict:
    """Bytes the busiest rank sends or receives (``bytes``), its messages, and the rounds (1)."""
    n = p.n
    cost = [[min(p.counts[j][r] * (p.idx_bytes + p.val_bytes), p.lengths[r] * p.val_bytes) if j != r else 0
             for r in range(n)] for j in range(n)]
    sent = [sum(row) + 8 * (n - 1) for row in cost]
    recv = [sum(cost[j][r] for j in range(n)) + 8 * (n - 1) for r in range(n)]
    msgs = max(sum(1 for r in range(n) if cost[j][r]) for j in range(n)) + n - 1
    return {"bytes": max(sent + recv), "msgs": msgs, "rounds": 1 if n > 1 else 0}


@register_reduce_scatter
class DirectReduceScatter(ReduceScatterScheme):
    """COO entries straight to the owner of their range, one exchange."""

    name = "direct"

    def _reduce_scatter_group(self, comm, grads, ranges, op, outs, timings, keys):
        """1. Per gradient: each entry's owner (binary search over the range ends), grouped by owner.
        2. One host read of every gradient's per-owner counts (they cut the payloads).
        3. One exchange for the group (packed, ``exchange_packed``): to each owner each gradient's entries
           (or its range dense, if smaller).
        4. The owner sums what it received in rank order (fp32 for half types), casts, divides for mean.
        """
        n, rank = comm.size, comm.rank
        prepared = []
        # Step 1: owners.
        for g, rs, t in zip(grads, ranges, timings):
            sg, urs = as_units(g, rs)
            timer = PhaseTimer(sg.values.device, enabled=t is not None)
            timer.start("owner_s")
            device = sg.values.device
            ends = torch.tensor([e for _, e in urs], dtype=torch.int64, device=device)
            owner_K = torch.searchsorted(ends, sg.indices, right=True)
            owner_sorted, order_K = torch.sort(owner_K, stable=True)
            counts = torch.bincount(owner_sorted, minlength=n)
            prepared.append((sg, urs, timer, owner_sorted, order_K, counts))
        # Step 2: one host read for the group.
        all_counts = torch.stack([p[5] for p in prepared]).tolist() if prepared else []
        # Step 3: one (packed) exchange for the group.
        sends, facts = [], []
        for (sg, urs, timer, _, order_K, _), counts in zip(prepared, all_counts):
            timer.start("exchange_s")
            device, dtype, width = sg.values.device, sg.values.dtype, sg.row_width
            row_shape = tuple(sg.values.shape[1:])
            idt = index_dtype(sg.numel)
            isz, vsz = torch.empty(0, dtype=idt).element_size(), sg.values.element_size() * width
            facts.append((device, dtype, width, row_shape, idt, isz, vsz))
            idx_K, vals_K = sg.indices[order_K], sg.values[order_K]
            send, at = [], 0
            for r, k in enumerate(counts):
                s, e = urs[r]
                if k == 0:
                    send.append(torch.empty(0, dtype=torch.uint8, device=device))
                elif k * (isz + vsz) >= (e - s) * vsz:
                    local = torch.zeros((e - s,) + row_shape, dtype=acc_dtype(dtype), device=device)
                    local.index_add_(0, idx_K[at : at + k] - s, vals_K[at : at + k].to(local.dtype))
                    send.append(pack(local.to(dtype)))
                else:
                    send.append(pack((idx_K[at : at + k] - s).to(idt), vals_K[at : at + k]))
                at += k
            sends.append(send)
        received = exchange_packed(comm, sends)
        # Step 4: sum in rank order.
        results = []
        for (sg, urs, timer, *_), (device, dtype, width, row_shape, idt, isz, vsz), recv, timing in zip(
                prepared, facts, received, timings):
            timer.start("aggregate_s")
            lo, hi = urs[rank]
            acc = torch.zeros((hi - lo,) + row_shape, dtype=acc_dtype(dtype), device=device)
            for buf in recv:
                nbytes = buf.numel()
                if nbytes == 0:
                    continue
                if nbytes == (hi - lo) * vsz:
                    acc += view_as(buf, 0, (hi - lo) * width, dtype).view(acc.shape).to(acc.dtype)
                    continue
                k = nbytes // (isz + vsz)
                pos = view_as(buf, 0, k, idt).to(torch.int64)
                acc.index_add_(0, pos, view_as(buf, k * isz, k * width, dtype).view((k,) + row_shape).to(acc.dtype))
            timer.write_into(timing)
            if timing is not None:
                timing["scheme"] = self.name
            results.append(finish(acc, dtype, op, n))
        return results
