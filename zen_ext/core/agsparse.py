"""``agsparse``: all-gather the COO gradient of every rank and sum locally (ZEN paper §2.4, Table 3).

AGsparse is [One-shot aggregation, Centralization]: Horovod's sparse allgather and GRACE's
``Allgather`` communicator. It cannot use the overlap between ranks, so its volume grows linearly with
``n`` (paper Fig. 8: worse than dense all-reduce past ~40 GPUs for NMT, i.e. once ``n·d ≳ 1``).

Bytes rank ``r`` sends (its ``K_r`` entries of ``W`` values each, index ``ib`` and value ``vb`` bytes):
``(n−1)·(8 + K_r·(ib + W·vb))``; it receives the sum of the others' messages. Sizes travel first and the
payload is never padded (GRACE pads every rank to the largest one).

Wire format, one message per rank: ``[indices (int32, or int64 if numel ≥ 2^31) | values]`` — indices
are never packed into floats (Ok-Topk's float packing corrupts indices past 2^24). Row-form gradients
travel as rows, one index per row, as Horovod sends ``IndexedSlices``. Duplicates are sent as they are
(as Horovod does) and summed by the receiver with ``index_add_``, never overwritten (dragonn's batched
``scatter_`` lost them).

The COO codec (``encode_coo``, ``decode_coo``, ``finish``) is ``core/coo.py``, shared with ``sparse_ps``,
``sparcml`` and ``omnireduce``.

Legend: ``_K`` entries, ``_N`` dense length (rows in row form).
"""

from __future__ import annotations

import torch

from .. import ops
from ..comm.base import Communicator
from .coo import decode_coo, encode_coo, finish
from .cost import Dims, ProfileView, Traffic, WorkCounts
from .scheme import SyncScheme
from .timing import PhaseTimer
from .types import SparseGrad, acc_dtype, as_sparse


class AGSparseScheme(SyncScheme):
    """All-gather of COO, then a local sum of every rank's entries (the AGsparse baseline)."""

    name = "agsparse"
    wire_phases = ("allgather_s",)

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` losslessly.

        1. Encode: this rank's entries as one COO message, duplicates included.
        2. All-gather: every rank receives every other rank's message (sizes first, no padding).
        3. Aggregate: sum all entries in rank order with ``index_add_`` (same order on every rank, so
           every rank computes the same bits).
        """
        sg = as_sparse(grad)
        dtype, device, row_shape = sg.values.dtype, sg.values.device, tuple(sg.values.shape[1:])
        timer = PhaseTimer(device, enabled=timings is not None)

        # Step 1: encode.
        timer.start("encode_s")
        msg = encode_coo(sg.indices, sg.values, sg.numel)

        # Step 2: all-gather.
        timer.start("allgather_s")
        parts = comm.all_gather_v(msg)

        # Step 3: aggregate.
        timer.start("aggregate_s")
        into_out = out is not None and acc_dtype(dtype) == dtype
        if into_out:
            # Sum straight into the caller's buffer (the input was consumed in step 1): no result-sized
            # temporary and copy, as in zen, so the comparison with zen is like for like.
            acc = ops.zero_(out).view((sg.numel,) + row_shape)
        else:
            acc = torch.zeros((sg.numel,) + row_shape, dtype=acc_dtype(dtype), device=device)
        for p in parts:  # one message at a time: peak memory stays at one message, not n of them
            if p.numel():
                idx, vals = decode_coo(p, sg.numel, row_shape, dtype)
                acc.index_add_(0, idx, vals.to(acc.dtype))
        res = finish(acc, dtype, op, comm.size)
        timer.write_into(timings)
        return out if into_out else res

    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        tr = Traffic(p.n)
        tr.all_gather_v([q.raw_nnz * p.entry_bytes for q in p.locals])
        return tr

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        d = Dims.of(w)
        # fp32/fp64 sum straight into the result (zeroed once); half types zero an fp32 accumulator, then
        # cast it into the result.
        result_fill = d.N * d.W * d.vb if d.ab == d.vb else d.N * d.W * (2 * d.ab + d.vb)
        return {"encode_s": {"fill_s_per_byte": d.K * (d.ib + d.W * d.vb)},
                "aggregate_s": {"fill_s_per_byte": result_fill + d.S * 8, "scatter_s_per_elem": d.S * d.W}}
