"""The computation side of the cost model: per phase of each scheme, how many units of five primitives
(fill, scatter, sort, hash, bitmap) its slowest rank executes (``WorkCounts`` → ``_work_<scheme>``), and
the rates of those primitives measured on the running device (``calibrate_compute``). ``cost_model.py``
registers the work functions with each scheme's traffic predictor and adds the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..core.hashing import HashPartitioner
from ..core.types import index_dtype
from .profile import BLOCK_SIZE, SparsityProfile, _counts_PP


# --- computation: per-entry and per-element work of each scheme, on calibrated rates ----------------
# The α–β time above is the wire; on a real machine each scheme also hashes, sorts, scatters and
# materializes dense buffers, and on the lab's shared cores that computation is most of a sparse sync
# (docs/benchmarks.md). The model below counts, per phase of each scheme (the same phase names the
# schemes write into ``timings``), how many units of five primitives the slowest rank executes, and
# multiplies them by rates measured on the running device (``calibrate_compute``). Phase times of
# real syncs refine the result per scheme and phase (``Refinement``).

#: Phases whose time is mostly the wire (their prediction starts from the α–β time); the others compute.
WIRE_PHASES = frozenset({"push_s", "pull_s", "allgather_s", "rounds_s", "comm_s"})
PRIMITIVES = ("fill_s_per_byte", "scatter_s_per_elem", "sort_s_per_entry", "hash_s_per_entry", "bitmap_s_per_bit")


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


@dataclass
class WorkCounts:
    """What the compute model needs about one sync (the slowest rank's view).

    Args:
        n: ranks. numel: rows (index space). row_width: elements per row. value_bytes: bytes per element.
        nnz: each rank's entries (duplicates included). union: distinct indices over all ranks.
        server_recv_max: entries the busiest server of a range-partitioned scheme receives (None:
            balanced, ``Σ nnz / n``). block_union / block_size: OmniReduce's non-zero blocks.
    """

    n: int
    numel: int
    row_width: int
    value_bytes: int
    nnz: list[int]
    union: float
    server_recv_max: float | None = None
    block_union: float | None = None
    block_recv_max: float | None = None
    block_size: int = BLOCK_SIZE

    @classmethod
    def from_profile(cls, p: SparsityProfile) -> "WorkCounts":
        range_recv = _counts_PP(p, "range_counts").sum(0).max().item() if p.n else 0.0
        block_recv = _counts_PP(p, "block_counts").sum(0).max().item() if p.n else 0.0
        return cls(n=p.n, numel=p.numel, row_width=p.row_width, value_bytes=p.value_bytes,
                   nnz=[q.raw_nnz for q in p.locals], union=p.union(range(p.n)) if p.n else 0.0,
                   server_recv_max=range_recv, block_union=p.union(range(p.n), blocks=True) if p.n else 0.0,
                   block_recv_max=block_recv, block_size=p.block_size)

    @classmethod
    def independent(cls, n: int, numel: int, row_width: int, value_bytes: int, nnz: Sequence[int]) -> "WorkCounts":
        """Counts when the ranks' indices are independent and uniform (no profile: e.g. recorded runs)."""
        miss = 1.0
        for k in nnz:
            miss *= 1.0 - min(1.0, k / max(1, numel))
        union = numel * (1.0 - miss)
        # A block of BLOCK_SIZE elements holds BLOCK_SIZE / row_width rows; it is non-zero unless all miss.
        rows_per_block = max(1.0, BLOCK_SIZE / max(1, row_width))
        num_blocks = -(-numel * row_width // BLOCK_SIZE)

        def blocks(k: float) -> float:
            return num_blocks * (1.0 - (1.0 - min(1.0, k / max(1, numel))) ** rows_per_block)

        return cls(n=n, numel=numel, row_width=row_width, value_bytes=value_bytes, nnz=list(nnz), union=union,
                   block_union=blocks(union), block_recv_max=sum(blocks(k) for k in nnz) / max(1, n))


@dataclass(frozen=True)
class _Dims:
    """What the per-scheme work models share: ``N`` rows, ``W`` row width, value/accumulator/index
    bytes, ``K`` the largest local entry count, ``S`` all ranks' entries, ``U`` the union."""

    n: int
    N: int
    W: int
    vb: int
    ab: int
    ib: int
    K: float
    S: float
    U: float

    @classmethod
    def of(cls, w: WorkCounts) -> "_Dims":
        return cls(n=max(1, w.n), N=w.numel, W=w.row_width, vb=w.value_bytes,
                   ab=max(4, w.value_bytes),  # accumulators are fp32 (fp64 for fp64)
                   ib=torch.empty(0, dtype=index_dtype(max(1, w.numel))).element_size(),
                   K=float(max(w.nnz, default=0)), S=float(sum(w.nnz)), U=float(w.union))

    @property
    def dense_out(self) -> int:
        return self.N * self.W * self.vb  # the dense result every scheme writes


def _work_dense(w: WorkCounts, opts: dict) -> dict:
    return {"comm_s": {"fill_s_per_byte": _Dims.of(w).dense_out}}


def _work_agsparse(w: WorkCounts, opts: dict) -> dict:
    d = _Dims.of(w)
    # fp32/fp64 sum straight into the result (zeroed once); half types zero an fp32 accumulator, then
    # cast it into the result.
    result_fill = d.N * d.W * d.vb if d.ab == d.vb else d.N * d.W * (2 * d.ab + d.vb)
    return {"encode_s": {"fill_s_per_byte": d.K * (d.ib + d.W * d.vb)},
            "aggregate_s": {"fill_s_per_byte": result_fill + d.S * 8, "scatter_s_per_elem": d.S * d.W}}


def _work_zen(w: WorkCounts, opts: dict, coo_only: bool = False) -> dict:
    d = _Dims.of(w)
    per_server = d.S / d.n
    bitmap = not coo_only and opts.get("pull_format", "auto") != "coo" and d.U / d.n * d.ib > d.N / d.n / 8
    decode = {"fill_s_per_byte": d.dense_out, "hash_s_per_entry": d.U, "scatter_s_per_elem": d.U * d.W}
    if bitmap:
        decode["bitmap_s_per_bit"] = d.N
    return {"hash_s": {"hash_s_per_entry": d.K, "fill_s_per_byte": d.K * (d.W * d.vb + d.ib)},
            "aggregate_s": {"fill_s_per_byte": d.N / d.n * (d.W * d.ab + 1) + per_server * 8,
                            "scatter_s_per_elem": per_server * d.W * 2, "bitmap_s_per_bit": d.N / d.n},
            "decode_s": decode}


def _work_zen_coo(w: WorkCounts, opts: dict) -> dict:
    return _work_zen(w, opts, coo_only=True)


def _work_sparcml(w: WorkCounts, opts: dict) -> dict:
    d = _Dims.of(w)
    rounds = max(1, (d.n - 1).bit_length())
    merged = sum(min(d.U, d.K * (1 << i)) for i in range(1, rounds + 1))
    return {"coalesce_s": {"sort_s_per_entry": d.K},
            "rounds_s": {"sort_s_per_entry": merged, "fill_s_per_byte": merged * (d.ib + d.W * d.vb)},
            "decode_s": {"fill_s_per_byte": d.dense_out, "scatter_s_per_elem": d.U * d.W}}


def _work_sparse_ps(w: WorkCounts, opts: dict) -> dict:
    d = _Dims.of(w)
    recv = w.server_recv_max if w.server_recv_max is not None else d.S / d.n
    return {"partition_s": {"sort_s_per_entry": d.K},
            "aggregate_s": {"fill_s_per_byte": d.N / d.n * d.W * d.ab, "scatter_s_per_elem": recv * d.W,
                            "sort_s_per_entry": recv},
            "decode_s": {"fill_s_per_byte": d.dense_out, "scatter_s_per_elem": d.U * d.W}}


def _work_omnireduce(w: WorkCounts, opts: dict) -> dict:
    d = _Dims.of(w)
    B = opts.get("block_size", w.block_size)
    blocks = w.block_union if w.block_union is not None else min(-(-d.N * d.W // B), d.U)
    recv = w.block_recv_max if w.block_recv_max is not None else blocks
    return {"blocks_s": {"sort_s_per_entry": d.K},
            "partition_s": {"fill_s_per_byte": blocks * B * d.vb},
            "aggregate_s": {"fill_s_per_byte": d.N / d.n * d.W * d.ab + recv * B * d.ab},
            "decode_s": {"fill_s_per_byte": d.dense_out + blocks * B * d.vb}}
