"""``spardl`` reduce-scatter: SparDL's Spar-Reduce-Scatter alone (Zhao et al.), the form ZeRO-2/3 and FSDP2
take (``core/spardl.py`` has the algorithm, its residuals and why it is lossy).

The blocks are the owners' ranges (uneven or empty ones allowed; ``k_b = ⌈density·|R_b|⌉``), so after
``⌈log2 P⌉`` fixed-size rounds each rank holds its own range, reduced and sparsified to ``k_b`` entries.
No all-gather follows, so no rank learns the result's indices of the other ranges: the residual keeps
every dropped value on the rank that dropped it (``ξ``), which conserves exactly as Algorithm 1 does.
Gradients without memory (anything but an ``AccumulatedGrad``) go through ``zen``'s reduce-scatter,
losslessly.

Bytes per rank: ``Σ_{b≠own} k_b·(index + value bytes)`` in ``⌈log2 P⌉`` messages (``predict_spardl_bytes``).
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from .cost import Traffic
from .coo import entry_bytes
from .rs_base import ReduceScatterScheme
from .rs_zen import ZenReduceScatter
from .spardl import SparDLConfig, SparDLScheme, predict_spardl_rounds, spardl_reduce
from .timing import PhaseTimer
from .types import AccumulatedGrad


def predict_spardl_bytes(n: int, lengths: list[int], density: float, numel: int, dtype: torch.dtype) -> dict:
    """Bytes the busiest rank sends or receives (``bytes``), its messages and the rounds."""
    tr = Traffic(n)
    ranges, at = [], 0
    for length in lengths:
        ranges.append((at, at + length))
        at += length
    predict_spardl_rounds(tr, ranges, density, entry_bytes(numel, 1, dtype), False)
    st = tr.stats
    return {"bytes": max([s.bytes_sent for s in st] + [s.bytes_recv for s in st]),
            "msgs": max(s.msgs_sent for s in st), "rounds": max(s.rounds for s in st)}


class SparDLReduceScatter(ReduceScatterScheme):
    """Spar-Reduce-Scatter over the owners' ranges, residuals kept where they are dropped."""

    name = SparDLScheme.name  # the reduce-scatter form of the all-reduce scheme, under its name
    lossless = False
    takes_accumulated = True

    def __init__(self, residual: str = "global", seed: int = 0, pull_format: str = "auto") -> None:
        SparDLConfig(residual)  # validates
        self.residual, self.seed, self.pull_format = residual, seed, pull_format
        self.lossless_scheme = ZenReduceScatter(seed=seed, pull_format=pull_format)

    def options(self) -> dict:
        return {"residual": self.residual, "seed": self.seed, "pull_format": self.pull_format}

    def _reduce_scatter_group(self, comm: Communicator, grads, ranges, op, outs, timings, keys):
        """Each ``AccumulatedGrad`` by the SRS (steps 1–3 of ``core/spardl.py``), written into its range;
        the rest in one ``zen`` reduce-scatter group."""
        results: list = [None] * len(grads)
        plain = [i for i, g in enumerate(grads) if not isinstance(g, AccumulatedGrad)]
        if plain:
            got = self.lossless_scheme.reduce_scatter_group_validated(
                comm, [grads[i] for i in plain], [ranges[i] for i in plain], op, [outs[i] for i in plain],
                [timings[i] for i in plain], [keys[i] for i in plain])
            for i, res in zip(plain, got):
                results[i] = res
        for i, g in enumerate(grads):
            if results[i] is not None:
                continue
            timer = PhaseTimer(g.memory.device, enabled=timings[i] is not None)
            pos, val = spardl_reduce(comm, g, ranges[i], self.residual, False, timer)
            lo, hi = ranges[i][comm.rank]
            res = outs[i].zero_() if outs[i] is not None else torch.zeros(hi - lo, dtype=g.dtype, device=val.device)
            res.index_put_((pos - lo,), val)
            if op == "mean":
                res.div_(comm.size)
            timer.write_into(timings[i])
            results[i] = res
        return results
