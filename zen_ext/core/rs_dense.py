"""``dense`` reduce-scatter: the Communicator's reduce-scatter of the densified gradient (the oracle
every lossless reduce-scatter is checked against).

Uneven ranges are padded to equal blocks of the longest range (the collective NCCL and gloo offer takes
equal blocks): bytes per rank ``(n − 1) · max_r |R_r| · itemsize`` each way (ring), whatever the
density; for FSDP2's even chunks that is ``(n − 1)/n · N · itemsize``.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from .reduce_scatter import ReduceScatterScheme, register_reduce_scatter
from .timing import PhaseTimer
from .types import SparseGrad


def predict_dense_bytes(n: int, range_lengths: list[int], itemsize: int) -> dict:
    """Bytes and messages each rank sends (and receives) in the dense reduce-scatter; one round."""
    block = max(range_lengths) if range_lengths else 0
    return {"bytes": (n - 1) * block * itemsize if n > 1 else 0, "msgs": n - 1, "rounds": 1 if n > 1 else 0}


@register_reduce_scatter
class DenseReduceScatter(ReduceScatterScheme):
    """Reduce-scatter of the densified gradient, uneven ranges padded to equal blocks."""

    name = "dense"

    def _reduce_scatter_group(self, comm, grads, ranges, op, outs, timings, keys):
        return [self._one(comm, g, rs, op, t) for g, rs, t in zip(grads, ranges, timings)]

    def _one(self, comm: Communicator, grad: SparseGrad | torch.Tensor, ranges: list[tuple[int, int]], op: str,
             timings: dict | None) -> torch.Tensor:
        """1. Densify (a SparseGrad is scattered, duplicates summed; a dense tensor is read flat).
        2. Lay it out as ``n`` equal blocks (padded with zeros where the ranges are uneven).
        3. The Communicator's reduce-scatter; keep this rank's range; ``mean`` divides by ``n``."""
        n, rank = comm.size, comm.rank
        # Step 1: densify.
        flat = grad.to_dense() if isinstance(grad, SparseGrad) else grad.reshape(-1)
        timer = PhaseTimer(flat.device, enabled=timings is not None)
        timer.start("comm_s")
        lengths = [e - s for s, e in ranges]
        block = max(lengths)
        # Step 2: equal blocks.
        if all(length == block for length in lengths):
            buf = flat
        else:
            buf = torch.zeros(n * block, dtype=flat.dtype, device=flat.device)
            for r, (s, e) in enumerate(ranges):
                buf[r * block : r * block + e - s] = flat[s:e]
        # Step 3: reduce-scatter.
        if n == 1:
            res = buf.clone()
        elif block == 0:
            res = buf.new_empty(0)
        else:
            res = comm.reduce_scatter(buf)
        res = res[: lengths[rank]]
        if op == "mean":
            res = res.div_(n)
        timer.write_into(timings)
        if timings is not None:
            timings["scheme"] = self.name
        return res
