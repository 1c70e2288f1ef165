"""What a scheme's cost model is written in: the inputs ``auto`` hands it and the units it answers in.

A scheme declares its cost model next to its ``_sync`` (``SyncScheme.wire_phases``,
``predict_traffic``, ``predict_work``; ``core/zen.py`` is the fullest example) in the terms defined
here, so that core never imports the planner (``zen_ext/planner/``), which reads the declarations:

* ``ProfileView``: the sparsity profile of one gradient slice over ``n`` ranks (the planner's
  ``SparsityProfile``, gathered from every rank), the input of ``predict_traffic``;
* ``Traffic``: the bytes and messages each rank sends and receives, recorded with the Communicator's
  byte model (``comm/base.py``), the output of ``predict_traffic``;
* ``WorkCounts`` (and ``Dims``, the quantities work models share): the input of ``predict_work``,
  which answers ``{phase: {primitive: units}}`` in the ``PRIMITIVES`` whose per-unit seconds the
  planner measures on the running device (``planner/compute_model.py``).

Legend: ``_P`` per server/rank, ``N`` rows, ``W`` row width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..comm import gather
from ..comm.base import CommStats
from ..comm.inline import COUNT_BYTES as _COUNT_BYTES, counted_bytes, next_capacity
from .types import index_dtype

BLOCK_SIZE = 256
"""OmniReduce's block (elements): profiles count non-zero blocks of this size."""
PRIMITIVES = ("fill_s_per_byte", "scatter_s_per_elem", "sort_s_per_entry", "hash_s_per_entry", "bitmap_s_per_bit")
"""The units of computation a work model counts: bytes filled, cast or copied (memory bandwidth),
elements scattered (``index_add_`` at random positions), indices sorted (``torch.unique``), indices
hashed (h0), bits of a hash bitmap decoded."""


class ProfileView(Protocol):
    """What a traffic predictor may read of a slice's sparsity profile (identical on every rank).

    ``locals[r]`` is rank ``r``'s part: ``raw_nnz`` (entries, duplicates included), ``unique_nnz``,
    and its entries per server of each partition pattern (``hash_counts``: h0; ``range_counts``:
    contiguous ranges; ``block_counts``: contiguous ranges of ``block_size``-element blocks).
    """

    numel: int
    row_width: int
    value_bytes: int
    seed: int
    sample_parts: int
    block_size: int
    locals: list

    @property
    def n(self) -> int: ...
    @property
    def index_bytes(self) -> int: ...
    @property
    def entry_bytes(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...

    def union(self, ranks: Sequence[int], blocks: bool = False) -> float:
        """Estimated distinct indices (or non-zero blocks) over ``ranks``."""

    def union_set(self, ranks: tuple[int, ...], blocks: bool) -> torch.Tensor:
        """The (sampled: exact when ``sample_parts`` is 1) union of the ranks' indices."""

    def union_per_range(self, blocks: bool = False) -> list[float]:
        """Estimated distinct indices (blocks) of the union in each contiguous range."""

    def counts_PP(self, pattern: str) -> torch.Tensor:
        """``[src, server]`` entries of a partition pattern (``"hash_counts"``, ...), float64."""


class Traffic:
    """Predicted ``CommStats`` of every rank, built with the Communicator's byte model (comm/base.py).

    ``stats``: a step of a Synchronizer, whose exchanges run in a Communicator slot and, from their
    second call on, carry their counts in the payload (one round, one message per peer, the payload's
    capacity ``next_capacity`` on the wire; a step whose counts repeat the last one's, so no overflow).
    ``first_stats``: a call outside a slot, or a slot's first: each peer gets an 8-byte count in a round
    of its own, then the payload where it is not empty. ``all_gather_v`` runs the rounds of
    ``comm/gather.py``, in a slot's repeat on count-carrying blocks (the same rule); rounds are counted
    as the communicators do. Payloads are uint8 (every scheme packs its messages, ``core/wire.py``).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.stats = [CommStats() for _ in range(n)]
        self.first_stats = [CommStats() for _ in range(n)]

    def _add(self, r: int, sent: float, recv: float, msgs_sent: int, msgs_recv: int, rounds: int) -> None:
        """Traffic that is the same in both forms (collectives other than ``exchange_v``)."""
        for s in (self.first_stats[r], self.stats[r]):
            s.bytes_sent += sent
            s.bytes_recv += recv
            s.msgs_sent += msgs_sent
            s.msgs_recv += msgs_recv
            s.rounds += rounds

    def exchange_v(self, bytes_PP: torch.Tensor) -> None:
        """``bytes_PP[src, dst]``: payload bytes from ``src`` to ``dst``."""
        n = self.n
        if n <= 1:
            return
        bytes_PP = bytes_PP.to(torch.float64).clone()
        bytes_PP.fill_diagonal_(0)
        nonempty = bytes_PP > 0
        sent, recv = bytes_PP.sum(1).tolist(), bytes_PP.sum(0).tolist()
        msent, mrecv = nonempty.sum(1).tolist(), nonempty.sum(0).tolist()
        # Counts in the payload: the count word, then the capacity (padded to 8 bytes) of a payload of
        # the same size as the last step's (comm/inline.py); an empty pair sends its count word only.
        inline_PP = counted_bytes(next_capacity(bytes_PP), 1)
        inline_PP.fill_diagonal_(0)
        isent, irecv = inline_PP.sum(1).tolist(), inline_PP.sum(0).tolist()
        for r in range(n):
            s, f = self.stats[r], self.first_stats[r]
            s.bytes_sent, s.bytes_recv = s.bytes_sent + isent[r], s.bytes_recv + irecv[r]
            s.msgs_sent, s.msgs_recv, s.rounds = s.msgs_sent + n - 1, s.msgs_recv + n - 1, s.rounds + 1
            f.bytes_sent += (n - 1) * _COUNT_BYTES + sent[r]
            f.bytes_recv += (n - 1) * _COUNT_BYTES + recv[r]
            f.msgs_sent += n - 1 + msent[r]
            f.msgs_recv += n - 1 + mrecv[r]
            f.rounds += 2

    def sendrecv(self, sends: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One round of fixed-size point-to-point messages (``Communicator.sendrecv``: no count, the same
        in both forms): ``sends[src]`` lists ``(dst, payload bytes)``."""
        if self.n <= 1:
            return
        for src, msgs in enumerate(sends):
            for dst, b in msgs:
                self._add(src, b, 0, int(b > 0), 0, 0)
                self._add(dst, 0, b, 0, int(b > 0), 0)
        for r in range(self.n):
            self._add(r, 0, 0, 0, 0, 1)

    def all_gather_v(self, sizes: Sequence[float], impl: str = "auto") -> None:
        """``sizes[r]``: rank ``r``'s payload bytes, gathered in the rounds ``comm/gather.py`` picks for
        them (its ``choose`` with the default costs, as the communicators do); in a slot's repeat, for
        blocks of the capacity the same sizes leave (``comm/inline.py``), without a count round."""
        costs = gather.GatherCosts()
        first = gather.GatherPlan(gather.choose(impl, sizes, costs), list(sizes), 1)
        caps = [next_capacity(b) for b in sizes]
        steady = gather.GatherPlan(gather.choose(impl, gather.inline_block_bytes(caps, 1), costs), list(sizes), 1,
                                   costs, caps)
        for r in range(self.n):
            for stats, plan in ((self.first_stats, first), (self.stats, steady)):
                sent, recv, ms, mr, rounds = gather.traffic(plan, r)
                s = stats[r]
                s.bytes_sent, s.bytes_recv = s.bytes_sent + sent, s.bytes_recv + recv
                s.msgs_sent, s.msgs_recv, s.rounds = s.msgs_sent + ms, s.msgs_recv + mr, s.rounds + rounds

    def all_reduce(self, nbytes: int) -> None:
        """A ring all-reduce of ``nbytes`` on every rank."""
        n = self.n
        if n > 1:
            ring = 2 * (n - 1) * nbytes // n
            for r in range(n):
                self._add(r, ring, ring, 2 * (n - 1), 2 * (n - 1), 2 * (n - 1))


@dataclass
class WorkCounts:
    """What a work model needs about one sync (the slowest rank's view).

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
    def from_profile(cls, p: ProfileView) -> "WorkCounts":
        range_recv = p.counts_PP("range_counts").sum(0).max().item() if p.n else 0.0
        block_recv = p.counts_PP("block_counts").sum(0).max().item() if p.n else 0.0
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
class Dims:
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
    def of(cls, w: WorkCounts) -> "Dims":
        return cls(n=max(1, w.n), N=w.numel, W=w.row_width, vb=w.value_bytes,
                   ab=max(4, w.value_bytes),  # accumulators are fp32 (fp64 for fp64)
                   ib=torch.empty(0, dtype=index_dtype(max(1, w.numel))).element_size(),
                   K=float(max(w.nnz, default=0)), S=float(sum(w.nnz)), U=float(w.union))

    @property
    def dense_out(self) -> int:
        return self.N * self.W * self.vb  # the dense result every scheme writes
