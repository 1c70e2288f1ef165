"""``dense``: the all-reduce every lossless scheme is checked against (the oracle).

Bytes per rank (ring): ``2·(n−1)/n · numel · itemsize`` each way, whatever the density.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from .cost import Dims, ProfileView, Traffic, WorkCounts
from .scheme import SyncScheme
from .timing import PhaseTimer
from .types import SparseGrad, as_dense


class DenseScheme(SyncScheme):
    """Dense all-reduce of the densified gradient."""

    name = "dense"
    wire_phases = ("comm_s",)

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = as_dense(grad)
        timer = PhaseTimer(out.device, enabled=timings is not None)
        timer.start("comm_s")
        comm.all_reduce(out)
        if op == "mean":
            out.div_(comm.size)
        timer.write_into(timings)
        return out

    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        tr = Traffic(p.n)
        tr.all_reduce(p.numel * p.row_width * p.value_bytes)
        return tr

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        return {"comm_s": {"fill_s_per_byte": Dims.of(w).dense_out}}
