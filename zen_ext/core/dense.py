"""``dense``: the all-reduce every lossless scheme is checked against (the oracle).

Bytes per rank (ring): ``2·(n−1)/n · numel · itemsize`` each way, whatever the density.
"""

from __future__ import annotations

import time

import torch

from ..comm.base import Communicator
from .scheme import SyncScheme, register_scheme
from .types import SparseGrad, as_dense


@register_scheme
class DenseScheme(SyncScheme):
    """Dense all-reduce of the densified gradient."""

    name = "dense"

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        out = as_dense(grad)
        comm.all_reduce(out)
        if op == "mean":
            out.div_(comm.size)
        if timings is not None:
            timings["comm_s"] = time.perf_counter() - t0
        return out
