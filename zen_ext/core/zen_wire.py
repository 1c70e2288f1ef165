"""ZEN's pull wire format, shared by the all-reduce (``core/zen.py``) and the reduce-scatter
(``core/rs_zen.py``): the message formats, their costs and the choice between them, and what one
gradient's entries weigh on the wire (``ZenCall``).

A pull message from a server is ``[header int64×2 = (format, count) | body]``; the body is one of

* COO: ``pos`` (the gradient's index dtype) ``| values``;
* hash bitmap: ``⌈|𝕀_i|/64⌉`` little-endian 64-bit words (``⌈|𝕀_i|/8⌉`` bytes padded to 8) ``| values``;
* dense: ``|𝕀_i|`` values,

so every rank knows how to decode it (paper Fig. 17a crossover). Layout: ``csrc/pull_format.h``; the
format codes are the ops' (``ops/_reference.py``).
"""

from __future__ import annotations

import torch

from .. import ops
from .bitmap import bitmap_bytes
from .timing import PhaseTimer
from .types import SparseGrad, index_dtype

__all__ = ["FMT_BITMAP", "FMT_BY_NAME", "FMT_COO", "FMT_DENSE", "FMT_NAMES", "HEADER_BYTES", "PULL_FORMATS",
           "ZenCall", "cheapest_format", "pull_costs"]

PULL_FORMATS = ("auto", "coo", "bitmap", "dense")
"""``zen.pull_format``'s values: ``auto`` picks the cheapest format per message."""
FMT_COO, FMT_BITMAP, FMT_DENSE = ops._reference.FMT_COO, ops._reference.FMT_BITMAP, ops._reference.FMT_DENSE
FMT_NAMES = {FMT_COO: "coo", FMT_BITMAP: "bitmap", FMT_DENSE: "dense"}
FMT_BY_NAME = {name: code for code, name in FMT_NAMES.items()}
HEADER_BYTES = 16
"""The header of every pull message: ``(format, count)`` as two int64."""


def pull_costs(count: int, part_size: int, idx_bytes: int, val_bytes: int) -> dict[int, int]:
    """Body bytes of each pull format for ``count`` non-zeros of a partition of ``part_size``."""
    bm = bitmap_bytes(part_size)
    return {
        FMT_DENSE: part_size * val_bytes,
        FMT_BITMAP: bm + (-bm % 8) + count * val_bytes,
        FMT_COO: count * (idx_bytes + val_bytes),
    }


def cheapest_format(count: int, part_size: int, idx_bytes: int, val_bytes: int, forced: str = "auto") -> int:
    """The format code of a message: ``forced`` when it is not ``"auto"``, else the cheapest (ties go to
    the simpler decode: dense first)."""
    if forced != "auto":
        return FMT_BY_NAME[forced]
    costs = pull_costs(count, part_size, idx_bytes, val_bytes)
    return min(costs, key=lambda f: (costs[f], -f))


class ZenCall:
    """One gradient's state while a ZEN scheme runs it over a group (facts, then each step's tensors):
    its index dtype and the bytes of one index and one value entry (a whole row in row form)."""

    def __init__(self, sg: SparseGrad, timings: dict | None) -> None:
        self.sg = sg
        self.dtype, self.device = sg.values.dtype, sg.values.device
        self.idt = index_dtype(sg.numel)
        self.width = sg.row_width
        # vsz: bytes of one value entry (a whole row in row form).
        self.isz, self.vsz = torch.empty(0, dtype=self.idt).element_size(), sg.values.element_size() * self.width
        self.row_shape = tuple(sg.values.shape[1:])
        # CUDA events on a GPU (perf_counter would time only the launches of the asynchronous phases,
        # and auto's compute model learns from these times); perf_counter on the CPU.
        self.timer = PhaseTimer(self.device, enabled=timings is not None)
