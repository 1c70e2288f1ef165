"""α–β communication cost model: measured per-rank traffic → time, the paper's Eq. 1 and 2, and
per-scheme predictions from a sparsity profile (for the ``auto`` planner).

Time of one rank with full-duplex links: ``α·max(msgs_sent, msgs_recv) + max(bytes_sent, bytes_recv)/B``
(every message pays the latency ``α`` once; a rank sends and receives at the same time). A sync takes
as long as its slowest rank, so schemes are compared on the maximum over ranks — which is where an
imbalanced partition (Sparse PS, OmniReduce) pays.

The paper's closed forms (ZEN §2.3, COO with one word per index and per value, bandwidth ``b``):

* Eq. 1, Balanced Parallelism: ``T_bp = (n−1)/n · (γⁿ + 1) · 2·M·d / b``;
* Eq. 2, Hierarchical Centralization: ``T_hc = Σ_{i=1}^{log2 n} γ^{2^(i−1)} · 2·M·d / b``.

The predictors below instead mirror each scheme's wire format and the Communicator's byte model
(counts, headers, index widths, the COO/bitmap/dense pull choice, SparCML's dense switch and folding),
and return predicted ``CommStats`` per rank, so a prediction and a SimWorld measurement go through the
same time formula and can be compared one to one (``tests/unit/test_planner.py``).

A ``SparsityProfile`` holds what they need, gathered from all ranks: exact per-rank entry counts per
server for each partition pattern, and hash-sampled index sets from which unions of any group of ranks
are estimated (sampling by h0 keeps the overlap structure: an index is in every rank's sample or in
none).

Legend: ``_P`` per server/rank, ``M`` dense elements, ``W`` row width, ``e`` bytes of one COO entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..comm.base import CommStats
from ..core.hashing import HashPartitioner, contiguous_partition_of
from ..core.types import SparseGrad, index_dtype
from ..core.zen import _HEADER_BYTES, _FMT_BITMAP, _FMT_COO, _FMT_DENSE, pull_costs

_COUNT_BYTES = 8  # the Communicator's int64 size/count per peer (comm/base.py)
BLOCK_SIZE = 256


# --- networks and measured time ------------------------------------------------------------------
@dataclass(frozen=True)
class Network:
    """A uniform full-duplex network: ``bandwidth_gbps`` per link and direction, ``latency_us`` per message."""

    bandwidth_gbps: float = 10.0
    latency_us: float = 50.0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"zen.bandwidth_gbps ({self.bandwidth_gbps!r}) must be > 0")
        if not self.latency_us >= 0:
            raise ValueError(f"zen.latency_us ({self.latency_us!r}) must be >= 0")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6


def rank_time_s(stats: CommStats, net: Network) -> float:
    """``α·max(msgs_sent, msgs_recv) + max(bytes_sent, bytes_recv)/B`` for one rank."""
    return (net.alpha_s * max(stats.msgs_sent, stats.msgs_recv)
            + max(stats.bytes_sent, stats.bytes_recv) / net.bytes_per_s)


def modeled_time_s(stats: Sequence[CommStats], net: Network) -> float:
    """Time of a sync: the slowest rank's ``rank_time_s``."""
    return max((rank_time_s(s, net) for s in stats), default=0.0)


# --- the paper's closed forms --------------------------------------------------------------------
def eq1_balanced_parallelism_s(n: int, numel: int, density: float, gamma_n: float, bandwidth_gbps: float,
                               word_bytes: int = 4) -> float:
    """Paper Eq. 1: ``(n−1)/n · (γⁿ + 1) · 2·M·d / b`` (COO: one word per index and per value)."""
    return (n - 1) / n * (gamma_n + 1) * 2 * numel * density * word_bytes / (bandwidth_gbps * 1e9 / 8)


def eq2_hierarchical_centralization_s(n: int, numel: int, density: float, gammas: dict[int, float],
                                      bandwidth_gbps: float, word_bytes: int = 4) -> float:
    """Paper Eq. 2: ``Σ_{i=1}^{log2 n} γ^{2^(i−1)} · 2·M·d / b``; ``gammas[k]`` is ``γ^k`` (``γ¹ = 1``)."""
    rounds = int(math.log2(n)) if n > 1 else 0
    total = sum(gammas.get(1 << i, 1.0 if i == 0 else float("nan")) for i in range(rounds))
    return total * 2 * numel * density * word_bytes / (bandwidth_gbps * 1e9 / 8)


def prefers_balanced_parallelism(n: int, gammas: dict[int, float]) -> bool:
    """The paper's selection rule: Balanced Parallelism iff ``Σ γ^{2^(i−1)} > (n−1)/n·(γⁿ + 1)``."""
    rounds = int(math.log2(n)) if n > 1 else 0
    lhs = sum(gammas.get(1 << i, 1.0) for i in range(rounds))
    return lhs > (n - 1) / n * (gammas.get(n, 1.0) + 1)


# --- sparsity profiles -----------------------------------------------------------------------------
@dataclass
class LocalProfile:
    """One rank's contribution to a ``SparsityProfile`` (small: 3·n counts and two bounded samples)."""

    raw_nnz: int
    unique_nnz: int
    hash_counts: list[int]
    range_counts: list[int]
    block_counts: list[int]
    sample: torch.Tensor
    block_sample: torch.Tensor


@dataclass
class SparsityProfile:
    """What the predictors need about one slice on ``n`` ranks (identical on every rank).

    ``sample_parts`` ``S``: the samples keep the indices that h0 (with ``S`` partitions) maps to
    partition 0, i.e. a ``1/S`` fraction; ``S = 1`` means exact.
    """

    numel: int
    row_width: int
    value_bytes: int
    seed: int
    locals: list[LocalProfile]
    sample_parts: int
    block_sample_parts: int
    block_size: int = BLOCK_SIZE
    _union_cache: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.locals)

    @property
    def index_bytes(self) -> int:
        return torch.empty(0, dtype=index_dtype(self.numel)).element_size()

    @property
    def entry_bytes(self) -> int:
        return self.index_bytes + self.row_width * self.value_bytes

    @property
    def num_blocks(self) -> int:
        return -(-self.numel * self.row_width // self.block_size)

    def density(self) -> float:
        """Mean per-rank density ``d_G`` (0 for an empty index space or no ranks)."""
        if not self.n or not self.numel:
            return 0.0
        return sum(p.unique_nnz for p in self.locals) / self.n / self.numel

    def union(self, ranks: Sequence[int], blocks: bool = False) -> float:
        """Estimated number of distinct indices (or non-zero blocks) over ``ranks``."""
        ranks = tuple(sorted(ranks))
        if len(ranks) == 1:
            p = self.locals[ranks[0]]
            return float(sum(p.block_counts)) if blocks else float(p.unique_nnz)
        parts = self.block_sample_parts if blocks else self.sample_parts
        return self._union_set(ranks, blocks).numel() * float(parts)

    def _union_set(self, ranks: tuple[int, ...], blocks: bool) -> torch.Tensor:
        """Sorted union of the members' samples; halves are cached, so nested groups (recursive
        doubling, aligned γ groups) cost one merge each."""
        if len(ranks) == 1:
            q = self.locals[ranks[0]]
            return q.block_sample if blocks else q.sample
        key = (ranks, blocks)
        if key not in self._union_cache:
            half = len(ranks) // 2
            self._union_cache[key] = torch.unique(torch.cat(
                [self._union_set(ranks[:half], blocks), self._union_set(ranks[half:], blocks)]))
        return self._union_cache[key]

    def gamma(self, k: int) -> float:
        """``γ^k``: mean over the aligned groups of ``k`` ranks of union / mean member size (Def. 4)."""
        vals = []
        for s in range(0, self.n - k + 1, k):
            group = range(s, s + k)
            mean = sum(self.locals[r].unique_nnz for r in group) / k
            if mean:
                vals.append(self.union(group) / mean)
        return sum(vals) / len(vals) if vals else 1.0

    def gammas(self) -> dict[int, float]:
        ks = sorted({1 << i for i in range(self.n.bit_length()) if 1 << i <= self.n} | {self.n})
        return {k: self.gamma(k) for k in ks}

    def union_per_range(self, blocks: bool = False) -> list[float]:
        """Estimated distinct indices (blocks) of the union falling into each contiguous range."""
        space = self.num_blocks if blocks else self.numel
        parts = self.block_sample_parts if blocks else self.sample_parts
        union = self._union_set(tuple(range(self.n)), blocks)
        counts = torch.bincount(contiguous_partition_of(union, space, self.n), minlength=self.n)
        return [float(c) * parts for c in counts.tolist()]


def local_profile(indices: torch.Tensor, numel: int, row_width: int, n: int, seed: int, sample_parts: int,
                  block_sample_parts: int, block_size: int = BLOCK_SIZE) -> LocalProfile:
    """This rank's ``LocalProfile`` for ``n`` ranks from its gradient's indices (rows in row form).

    The sample rates must be agreed beforehand (``sample_parts_for`` of the largest count).
    """
    idx = indices.cpu()
    uniq = torch.unique(idx)
    hash_counts = torch.bincount(HashPartitioner(numel, n, seed).partition_of(idx), minlength=n)
    range_counts = torch.bincount(contiguous_partition_of(idx, numel, n), minlength=n)
    blocks = _block_ids(uniq, row_width, block_size)
    num_blocks = -(-numel * row_width // block_size)
    block_counts = torch.bincount(contiguous_partition_of(blocks, num_blocks, n), minlength=n)
    return LocalProfile(
        raw_nnz=idx.numel(), unique_nnz=uniq.numel(), hash_counts=hash_counts.tolist(),
        range_counts=range_counts.tolist(), block_counts=block_counts.tolist(),
        sample=_sample(uniq, numel, sample_parts, seed),
        block_sample=_sample(blocks, num_blocks, block_sample_parts, seed),
    )


def sample_parts_for(max_count: int, budget: int) -> int:
    """``S`` so that a ``1/S`` sample of ``max_count`` indices has about ``budget`` entries (≥ 1)."""
    return max(1, -(-max_count // max(1, budget)))


def profile_from_grads(grads: Sequence[SparseGrad], seed: int = 0, sample_budget: int = 2048,
                       block_size: int = BLOCK_SIZE) -> SparsityProfile:
    """A ``SparsityProfile`` computed in one process from every rank's gradient (simulations, tests)."""
    n = len(grads)
    first = grads[0]
    uniq_max = max(torch.unique(g.indices).numel() for g in grads)
    blocks_max = max(_block_ids(torch.unique(g.indices), g.row_width, block_size).numel() for g in grads)
    s, sb = sample_parts_for(uniq_max, sample_budget), sample_parts_for(blocks_max, sample_budget)
    return SparsityProfile(
        numel=first.numel, row_width=first.row_width, value_bytes=first.values.element_size(), seed=seed,
        locals=[local_profile(g.indices, g.numel, g.row_width, n, seed, s, sb, block_size) for g in grads],
        sample_parts=s,
        block_sample_parts=sb, block_size=block_size,
    )


def _block_ids(uniq: torch.Tensor, row_width: int, block_size: int) -> torch.Tensor:
    if row_width == 1:
        return torch.unique(uniq // block_size)
    first, last = uniq * row_width // block_size, (uniq * row_width + row_width - 1) // block_size
    if bool((first == last).all()):
        return torch.unique(first)
    span = int((last - first).max()) + 1
    ids = first.unsqueeze(1) + torch.arange(span, device=first.device)
    return torch.unique(ids[ids <= last.unsqueeze(1)])


def _sample(idx: torch.Tensor, numel: int, parts: int, seed: int) -> torch.Tensor:
    if parts == 1 or idx.numel() == 0:
        return idx.clone()
    return idx[HashPartitioner(numel, parts, seed + 7919).partition_of(idx) == 0]


# --- predicted traffic per scheme ----------------------------------------------------------------
class _Traffic:
    """Predicted ``CommStats`` of every rank, built with the Communicator's byte model (comm/base.py)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.stats = [CommStats() for _ in range(n)]

    def exchange_v(self, bytes_PP: torch.Tensor) -> None:
        """``bytes_PP[src, dst]``: payload bytes from ``src`` to ``dst``; counts go to every peer."""
        n = self.n
        bytes_PP = bytes_PP.to(torch.float64).clone()
        bytes_PP.fill_diagonal_(0)
        nonempty = bytes_PP > 0
        sent, recv = bytes_PP.sum(1).tolist(), bytes_PP.sum(0).tolist()
        msent, mrecv = nonempty.sum(1).tolist(), nonempty.sum(0).tolist()
        for r, s in enumerate(self.stats):
            s.bytes_sent += (n - 1) * _COUNT_BYTES + sent[r]
            s.bytes_recv += (n - 1) * _COUNT_BYTES + recv[r]
            s.msgs_sent += n - 1 + msent[r]
            s.msgs_recv += n - 1 + mrecv[r]

    def all_gather_v(self, sizes: Sequence[float]) -> None:
        n = self.n
        total, nonempty = sum(sizes), sum(1 for x in sizes if x > 0)
        for r, s in enumerate(self.stats):
            s.bytes_sent += (n - 1) * (_COUNT_BYTES + sizes[r])
            s.msgs_sent += (n - 1) * (1 + (sizes[r] > 0))
            s.bytes_recv += (n - 1) * _COUNT_BYTES + total - sizes[r]
            s.msgs_recv += (n - 1) + nonempty - (sizes[r] > 0)

    def all_reduce(self, nbytes: int) -> None:
        n = self.n
        if n > 1:
            ring = 2 * (n - 1) * nbytes // n
            for s in self.stats:
                s.bytes_sent += ring
                s.bytes_recv += ring
                s.msgs_sent += 2 * (n - 1)
                s.msgs_recv += 2 * (n - 1)


def _counts_PP(p: SparsityProfile, attr: str) -> torch.Tensor:
    return torch.tensor([getattr(q, attr) for q in p.locals], dtype=torch.float64)


def _predict_dense(p: SparsityProfile, opts: dict) -> _Traffic:
    tr = _Traffic(p.n)
    tr.all_reduce(p.numel * p.row_width * p.value_bytes)
    return tr


def _predict_agsparse(p: SparsityProfile, opts: dict) -> _Traffic:
    tr = _Traffic(p.n)
    tr.all_gather_v([q.raw_nnz * p.entry_bytes for q in p.locals])
    return tr


def _predict_zen(p: SparsityProfile, opts: dict) -> _Traffic:
    n, tr = p.n, _Traffic(p.n)
    vsz = p.row_width * p.value_bytes
    # Push: COO per server, or the server's whole partition dense once that is not larger (zen.py).
    part_P = torch.tensor([max(0, (p.numel - j + n - 1) // n) for j in range(n)], dtype=torch.float64)
    coo_PP = _counts_PP(p, "hash_counts") * p.entry_bytes
    dense_PP = (part_P * vsz).expand(n, n)
    tr.exchange_v(torch.where((coo_PP > 0) & (coo_PP >= dense_PP), dense_PP, coo_PP))
    # Pull: h0 balances the union, so each server holds ~|U|/n (exact per server when unsampled).
    if p.sample_parts == 1:
        union = p._union_set(tuple(range(n)), False)
        per_server = torch.bincount(HashPartitioner(p.numel, n, p.seed).partition_of(union), minlength=n).tolist()
    else:
        per_server = [p.union(range(n)) / n] * n
    fmt = opts.get("pull_format", "auto")

    def body(i: int) -> float:
        part = max(0, (p.numel - i + n - 1) // n)
        costs = pull_costs(int(round(per_server[i])), part, p.index_bytes, vsz)
        if fmt == "auto":
            return min(costs.values())
        return costs[{"coo": _FMT_COO, "bitmap": _FMT_BITMAP, "dense": _FMT_DENSE}[fmt]]

    tr.all_gather_v([_HEADER_BYTES + body(i) for i in range(n)])
    return tr


def _predict_zen_coo(p: SparsityProfile, opts: dict) -> _Traffic:
    return _predict_zen(p, {**opts, "pull_format": "coo"})


def _predict_range_ps(p: SparsityProfile, counts_PP: torch.Tensor, union_per_range: list[float],
                      entry_bytes: float) -> _Traffic:
    tr = _Traffic(p.n)
    tr.exchange_v(counts_PP * entry_bytes)
    tr.all_gather_v([u * entry_bytes for u in union_per_range])
    return tr


def _predict_sparse_ps(p: SparsityProfile, opts: dict) -> _Traffic:
    return _predict_range_ps(p, _counts_PP(p, "range_counts"), p.union_per_range(), p.entry_bytes)


def _predict_omnireduce(p: SparsityProfile, opts: dict) -> _Traffic:
    block_size = opts.get("block_size", p.block_size)
    if block_size != p.block_size:
        raise ValueError(f"omnireduce block_size ({block_size}) must equal the profile's ({p.block_size})")
    idx_bytes = torch.empty(0, dtype=index_dtype(p.num_blocks)).element_size()
    return _predict_range_ps(p, _counts_PP(p, "block_counts"), p.union_per_range(blocks=True),
                             idx_bytes + block_size * p.value_bytes)


def _predict_sparcml(p: SparsityProfile, opts: dict) -> _Traffic:
    n, tr = p.n, _Traffic(p.n)
    dense_bytes = p.numel * p.row_width * p.value_bytes

    def stream_bytes(group: Sequence[int]) -> float:
        coo = p.union(group) * p.entry_bytes
        return dense_bytes if coo >= dense_bytes else coo

    def step(pairs: dict[int, tuple[int, Sequence[int]]]) -> None:
        # pairs[src] = (dst, group whose aggregate src sends)
        bytes_PP = torch.zeros(n, n, dtype=torch.float64)
        for src, (dst, group) in pairs.items():
            bytes_PP[src, dst] = stream_bytes(group)
        tr.exchange_v(bytes_PP)

    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    groups = {r: (r,) for r in range(n)}
    if rem:
        step({r: (r + 1, groups[r]) for r in range(0, 2 * rem, 2)})
        for r in range(1, 2 * rem, 2):
            groups[r] = (r - 1, r)
    real = [2 * v + 1 if v < rem else v + rem for v in range(p2)]
    mask = 1
    while mask < p2:
        step({real[v]: (real[v ^ mask], groups[real[v]]) for v in range(p2)})
        groups = {**groups, **{real[v]: tuple(sorted(groups[real[v]] + groups[real[v ^ mask]])) for v in range(p2)}}
        mask <<= 1
    if rem:
        step({r: (r - 1, tuple(range(n))) for r in range(1, 2 * rem, 2)})
    return tr


def predict_stats(scheme: str, profile: SparsityProfile, options: dict | None = None) -> list[CommStats]:
    """Predicted per-rank ``CommStats`` of ``scheme`` (built with ``options``) on ``profile``.

    Raises:
        ValueError: no predictor for ``scheme`` (lists the ones there are).
    """
    return cost_model_of(scheme).traffic(profile, options or {}).stats


def predict_time_s(scheme: str, profile: SparsityProfile, net: Network, options: dict | None = None) -> float:
    """``modeled_time_s`` of the predicted traffic."""
    return modeled_time_s(predict_stats(scheme, profile, options), net)


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


# --- the registry: one cost model per scheme ------------------------------------------------------
@dataclass(frozen=True)
class SchemeCostModel:
    """What ``auto`` needs to know about a scheme to predict its sync time.

    Attributes:
        traffic: ``(profile, options) → _Traffic``: the bytes and messages each rank sends and receives
            (record them with ``_Traffic.exchange_v`` / ``all_gather_v`` / ``all_reduce``).
        work: ``(WorkCounts, options) → {phase: {primitive: units}}``: the computation per phase on the
            slowest rank, in ``ComputeRates`` primitives (``fill_s_per_byte``, ``scatter_s_per_elem``, ...).
        wire_phases: the phases (keys of the scheme's timings) whose time is the wire's.
    """

    traffic: Callable[["SparsityProfile", dict], _Traffic]
    work: Callable[[WorkCounts, dict], dict]
    wire_phases: tuple[str, ...]


COST_MODELS: dict[str, SchemeCostModel] = {}
"""Scheme name → its cost model; ``auto`` considers the registered lossless schemes found here."""
PREDICTORS = COST_MODELS  # the older name: ``name in PREDICTORS`` asks whether the model knows a scheme


def register_cost_model(name: str, *, traffic, work, wire_phases: Sequence[str]) -> None:
    """Declare how the cost model predicts scheme ``name`` (see ``SchemeCostModel``); the scheme itself
    registers with ``@register_scheme``. Re-registering a name replaces its model.

    Raises:
        ValueError: ``wire_phases`` is empty, or ``traffic`` / ``work`` is not callable.
    """
    if not wire_phases:
        raise ValueError(f"cost model of {name!r}: wire_phases must name at least one phase")
    if not (callable(traffic) and callable(work)):
        raise ValueError(f"cost model of {name!r}: traffic and work must be callables")
    COST_MODELS[name] = SchemeCostModel(traffic, work, tuple(wire_phases))


def cost_model_of(scheme: str) -> SchemeCostModel:
    """The registered cost model of ``scheme``.

    Raises:
        ValueError: none is registered (lists the ones there are).
    """
    if scheme not in COST_MODELS:
        raise ValueError(f"cost model scheme ({scheme!r}) must be one of {sorted(COST_MODELS)}")
    return COST_MODELS[scheme]


for _name, _traffic, _work, _wire in (
        ("dense", _predict_dense, _work_dense, ("comm_s",)),
        ("zen", _predict_zen, _work_zen, ("push_s", "pull_s")),
        ("zen_coo", _predict_zen_coo, _work_zen_coo, ("push_s", "pull_s")),
        ("agsparse", _predict_agsparse, _work_agsparse, ("allgather_s",)),
        ("sparse_ps", _predict_sparse_ps, _work_sparse_ps, ("push_s", "pull_s")),
        ("omnireduce", _predict_omnireduce, _work_omnireduce, ("push_s", "pull_s")),
        ("sparcml", _predict_sparcml, _work_sparcml, ("rounds_s",))):
    register_cost_model(_name, traffic=_traffic, work=_work, wire_phases=_wire)


def compute_work(scheme: str, w: WorkCounts, options: dict | None = None) -> dict[str, dict[str, float]]:
    """Units of each primitive per phase of ``scheme`` on the slowest rank: ``{phase: {primitive: units}}``.

    Each model mirrors what its scheme's ``_sync`` does (core/*.py).

    Raises:
        ValueError: no cost model is registered for ``scheme``.
    """
    if scheme not in COST_MODELS:
        raise ValueError(f"compute model scheme ({scheme!r}) must be one of {sorted(COST_MODELS)}")
    return COST_MODELS[scheme].work(w, options or {})


@dataclass(frozen=True)
class Wire:
    """The α–β inputs of one sync on its slowest rank: messages, and seconds of bytes at the link rate."""

    msgs: float
    bytes_s: float

    @classmethod
    def of(cls, stats: Sequence[CommStats], net: Network) -> "Wire":
        msgs = max((max(s.msgs_sent, s.msgs_recv) for s in stats), default=0)
        nbytes = max((max(s.bytes_sent, s.bytes_recv) for s in stats), default=0)
        return cls(float(msgs), nbytes / net.bytes_per_s)


SHARED = "*"  # the Refinement's fits shared by every scheme


@dataclass
class Refinement:
    """What real syncs taught the model: per scheme and phase, ``measured ≈ slope · predicted + offset``.

    The fit is a least-squares line through the (predicted, measured) pairs of the syncs seen
    (exponentially decayed by ``decay`` per observation, so the model follows a drifting machine). The
    offset catches what scales with nothing the model counts (Python and allocator work per phase,
    per-message costs of the transport above the probe's latency), which dominates small syncs; the
    slope catches rates that differ from the micro-benchmark's. The wire phases of a scheme are fitted
    together (``"wire"``: the α–β time plus the computation inside them). Observations of one input
    size give an offset (an excess) or a ratio below 1 (a shortfall), never a ratio above 1 that
    larger syncs would inherit.

    Every observation also feeds two shared fits (scheme ``"*"``): ``"wire"`` and ``"compute"`` (all
    computing phases). A scheme's phase that was never measured uses them, so a planner that runs one
    scheme corrects the others by the same measured network and machine instead of comparing a
    corrected prediction with uncorrected ones (which would favor whatever it did not run).
    """

    decay: float = 0.9
    fits: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def apply(self, scheme: str, phase: str, predicted_s: float) -> float:
        """The refined prediction of one phase (or ``"wire"``) of ``scheme``.

        Never below the prediction scaled by the fit's ratio at its mean input (capped at 1): a line
        fitted on syncs of similar size can be nearly flat (a slope near 0 and the mean as offset), and
        extrapolated to a much larger sync it predicted the size of the small ones (the shared wire fit
        of 25–30 ms ZEN/AGsparse syncs put a 1.1 s dense all-reduce at 40 ms, and ``auto`` ran dense).
        """
        st = self.fits.get(scheme, {}).get(phase)
        if st is None:
            st = self.fits.get(SHARED, {}).get("wire" if phase == "wire" else "compute")
        if st is None:
            return predicted_s
        slope, offset = _line(st)
        mx = st[1] / st[0] if st[0] > 0 else 0.0
        floor = predicted_s * min(1.0, (slope * mx + offset) / mx) if mx > 0 else 0.0
        return max(slope * predicted_s + offset, floor)

    def observe(self, scheme: str, predicted: dict[str, float], measured: dict) -> None:
        """Fold one sync's ``timings`` (phase → seconds) into the fits of ``scheme``.

        ``predicted`` is ``predict_phases_s`` without refinement (its wire phases include the α–β
        time); non-numeric or missing phases are skipped.
        """
        wire = [k for k in predicted if k in WIRE_PHASES]
        pairs = [(k, predicted[k], measured.get(k)) for k in predicted if k not in WIRE_PHASES]
        if wire and all(isinstance(measured.get(k), (int, float)) for k in wire):
            pairs.append(("wire", sum(predicted[k] for k in wire), sum(float(measured[k]) for k in wire)))
        for k, x, y in pairs:
            if not isinstance(y, (int, float)) or not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
                continue
            for owner, key in ((scheme, k), (SHARED, "wire" if k == "wire" else "compute")):
                st = self.fits.setdefault(owner, {}).setdefault(key, [0.0] * 5)  # weight, Σx, Σy, Σxx, Σxy
                for i in range(5):
                    st[i] *= self.decay
                st[0] += 1.0
                st[1] += x
                st[2] += y
                st[3] += x * x
                st[4] += x * y

    def state(self) -> dict:
        return {"fits": {s: {k: list(v) for k, v in ph.items()} for s, ph in self.fits.items()}}

    def load(self, st: dict) -> None:
        self.fits = {s: {k: [float(x) for x in v] for k, v in ph.items()} for s, ph in st.get("fits", {}).items()}

    def merge_max(self, states: Sequence[dict]) -> None:
        """Agree across ranks (``states``: every rank's ``state()``, in rank order): per scheme, every
        phase fit of the rank whose fits predict the most in total at their mean inputs (the slowest
        rank sets the pace of a sync; ties go to the lower rank); a phase that rank never measured
        comes from the rank predicting the most for it.

        Whole ranks, not phase by phase: a sync's waiting moves between phases from rank to rank (a
        fast rank waits in the exchange that a slow rank reaches late), so the per-phase maxima of
        different ranks add up to more than any rank's sync (on the 4-host lab the per-phase merge
        predicted zen, of five phases, at 2.6x its measured sync and AGsparse, of two, at 0.9x, and
        the planner chose AGsparse)."""
        merged: dict[str, dict[str, list[float]]] = {}
        schemes = dict.fromkeys(s for st in states for s in st.get("fits", {}))
        for s in schemes:
            per_rank = [st.get("fits", {}).get(s, {}) for st in states]
            totals = [sum(_line_at_mean(v) for v in ph.values()) for ph in per_rank]
            win = max(range(len(per_rank)), key=lambda r: (totals[r], -r))
            out = {k: [float(x) for x in v] for k, v in per_rank[win].items()}
            for ph in per_rank:
                for k, v in ph.items():
                    if k not in per_rank[win] and (k not in out or _line_at_mean(v) > _line_at_mean(out[k])):
                        out[k] = [float(x) for x in v]
            merged[s] = out
        self.fits = merged


def _line(st: Sequence[float]) -> tuple[float, float]:
    """``(slope, offset)`` of the decayed least-squares fit, both >= 0."""
    w, sx, sy, sxx, sxy = st
    if w <= 0:
        return 1.0, 0.0
    det = w * sxx - sx * sx
    if det > 1e-12 * max(1e-30, w * sxx):
        slope = (w * sxy - sx * sy) / det
        offset = (sy - slope * sx) / w
        if slope >= 0 and offset >= 0:
            return slope, offset
        if slope < 0:
            return 0.0, sy / w
    # One distinct input (or a negative offset). A measured excess is taken as an offset, not a ratio:
    # the first syncs are often small and dominated by fixed per-call costs, and a ratio learned there
    # would multiply every larger sync's prediction (a 4 KB all-reduce taking 10x its α–β time made a
    # 4 MB one predict 50x too long). A measured shortfall scales down (a slower-than-real model).
    mx, my = sx / w, sy / w
    if my >= mx:
        return 1.0, my - mx
    return (my / mx if mx > 0 else 1.0), 0.0


def _line_at_mean(st: Sequence[float]) -> float:
    slope, offset = _line(st)
    return slope * (st[1] / st[0] if st[0] > 0 else 0.0) + offset


def predict_phases_s(scheme: str, w: WorkCounts, wire: Wire, latency_s: float, rates: ComputeRates,
                     options: dict | None = None, refine: Refinement | None = None) -> dict[str, float]:
    """Predicted seconds per phase of ``scheme``: computation from ``compute_work`` × ``rates``, plus
    the α–β time ``wire.msgs · latency_s + wire.bytes_s`` spread over the wire phases; with
    ``refine``, each computing phase and the wire phases together go through their fitted line."""
    work = compute_work(scheme, w, options)
    wire_phases = cost_model_of(scheme).wire_phases
    out = {}
    for phase in dict.fromkeys([*work, *wire_phases]):
        units = work.get(phase, {})
        t = sum(getattr(rates, prim) * u for prim, u in units.items())
        if phase in wire_phases:
            t += (wire.msgs * latency_s + wire.bytes_s) / len(wire_phases)
        elif refine is not None:
            t = refine.apply(scheme, phase, t)
        out[phase] = t
    if refine is not None:
        raw = sum(out[k] for k in wire_phases)
        if raw > 0:
            scale = refine.apply(scheme, "wire", raw) / raw
            for k in wire_phases:
                out[k] *= scale
        else:
            for k in wire_phases:
                out[k] = refine.apply(scheme, "wire", 0.0) / len(wire_phases)
    return out


def predict_total_s(scheme: str, w: WorkCounts, wire: Wire, latency_s: float, rates: ComputeRates,
                    options: dict | None = None, refine: Refinement | None = None) -> float:
    """The sync's predicted wall time: the sum of ``predict_phases_s`` (phases run one after another)."""
    return sum(predict_phases_s(scheme, w, wire, latency_s, rates, options, refine).values())
