"""The computation side of the cost model: the rates of the five primitives (fill, scatter, sort, hash,
bitmap: ``core.cost.PRIMITIVES``) measured on the running device (``calibrate_compute``). How many
units of each a scheme's slowest rank executes per phase is the scheme's own ``predict_work``
(next to its sync, ``core/<scheme>.py``); ``cost_model.py`` multiplies them and adds the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..core.cost import PRIMITIVES
from ..core.hashing import HashPartitioner


# The α–β time is the wire; on a real machine each scheme also hashes, sorts, scatters and
# materializes dense buffers, and on the lab's shared cores that computation is most of a sparse sync
# (docs/benchmarks.md). Each scheme counts, per phase (the same phase names it writes into
# ``timings``), how many units of the five primitives its slowest rank executes; the planner multiplies
# them by the rates measured here. Phase times of real syncs refine the result per scheme and phase
# (``Refinement``).


@dataclass
class ComputeRates:
    """Seconds per unit of the primitives the schemes' computation is made of.

    ``fill_s_per_byte``: zero-fill / cast / copy of dense buffers (memory bandwidth);
    ``scatter_s_per_elem``: ``index_add_`` / ``index_put_`` of one element at a random position;
    ``sort_s_per_entry``: ``torch.unique`` (sort) of one index; ``hash_s_per_entry``: h0 of one index
    (``HashPartitioner``); ``bitmap_s_per_bit``: decoding one bit of a hash bitmap.
    The defaults are this project's 2-core lab machine with 4 ranks on it (order of magnitude only:
    ``calibrate_compute`` measures the running device).
    """

    fill_s_per_byte: float = 1.0e-9
    scatter_s_per_elem: float = 2.0e-8
    sort_s_per_entry: float = 6.0e-8
    hash_s_per_entry: float = 5.0e-8
    bitmap_s_per_bit: float = 1.0e-10

    def as_list(self) -> list[float]:
        return [getattr(self, k) for k in PRIMITIVES]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> "ComputeRates":
        return cls(**{k: float(v) for k, v in zip(PRIMITIVES, values)})


def _time_best_s(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Best of ``reps`` timed calls (after one warm-up); CUDA is synchronized around each call."""
    import time

    cuda = device.type == "cuda"
    fn()
    best = float("inf")
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate_compute(device: "torch.device | str" = "cpu", elems: int = 1 << 22, entries: int = 1 << 16,
                      reps: int = 2) -> ComputeRates:
    """Measure ``ComputeRates`` on ``device`` with a short micro-benchmark (~0.1–0.3 s on a CPU core).

    ``elems`` is large enough (16 MB) that the dense buffers do not fit in cache, as gradient
    buckets do not.

    1. Fill: zero-fill plus a cast-copy of an ``elems``-element fp32 buffer.
    2. Scatter: ``index_add_`` of ``entries`` random positions into it.
    3. Sort: ``torch.unique`` of ``entries`` random indices. 4. Hash: h0 of them.
    5. Bitmap: scan an ``elems``-bit pull bitmap with the decode zen runs (``ops.decode_pull_``,
       popcount/ctz over 64-bit words), few bits set: a set bit's own work (``P⁻¹``, the store) is
       counted by the hash and scatter rates, so here only the scan per bit.

    Each rate is the best of ``reps`` (the least disturbed run); callers agree on the slowest rank's
    rates with one all-reduce MAX (``AutoScheme`` does).
    """
    from .. import ops

    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, elems, (entries,), generator=g).to(device)
    vals = torch.ones(entries, device=device)
    buf = torch.zeros(elems, device=device)
    part = HashPartitioner(elems, 8, 0)
    # A one-server pull message in bitmap format ([fmt, count | words | values], csrc/pull_format.h)
    # with one bit in ~4096 set: the wire format zen decodes, built by the ops that build it.
    pos = torch.unique(idx[: max(1, elems // 4096)]).to(torch.int32)
    payload = torch.cat([pos.view(torch.uint8), torch.ones(pos.numel(), device=device).view(torch.uint8)])
    acc, words, count = ops.aggregate_push([payload], elems, 1, torch.float32, 4)
    msg = ops.encode_pull(acc, words, ops.read_aggregate_count(count), ops._reference.FMT_BITMAP, 1, torch.float32, 4)
    keys = HashPartitioner(elems, 1, 0).keys_on(device)
    rates = [
        # Step 1: zeros (4 B written per element) + a cast copy (4 B read, 2 B written).
        _time_best_s(lambda: torch.zeros(elems, device=device).to(torch.bfloat16), reps, device) / (elems * 10),
        # Step 2.
        _time_best_s(lambda: buf.index_add_(0, idx, vals), reps, device) / entries,
        # Step 3 and 4.
        _time_best_s(lambda: torch.unique(idx), reps, device) / entries,
        _time_best_s(lambda: part.partition_of(idx), reps, device) / entries,
        # Step 5.
        _time_best_s(lambda: ops.decode_pull_(buf, msg, 0, 1, keys, 4), reps, device) / elems,
    ]
    return ComputeRates.from_list([max(r, 1e-15) for r in rates])
