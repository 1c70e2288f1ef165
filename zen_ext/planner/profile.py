"""Sparsity profiles for the cost model (``cost_model.py``): what the traffic predictors need (the
``core.cost.ProfileView`` they are written against), gathered
from all ranks: exact per-rank entry counts per server for each partition pattern, and hash-sampled
index sets from which unions of any group of ranks are estimated (sampling by h0 keeps the overlap
structure: an index is in every rank's sample or in none).

Legend: ``_P`` per server/rank, ``W`` row width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..core.hashing import HashPartitioner, contiguous_partition_of
from ..core.cost import BLOCK_SIZE
from ..core.types import SparseGrad, index_dtype


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
        return self.union_set(ranks, blocks).numel() * float(parts)

    def union_set(self, ranks: tuple[int, ...], blocks: bool) -> torch.Tensor:
        """Sorted union of the members' samples; halves are cached, so nested groups (recursive
        doubling, aligned γ groups) cost one merge each."""
        if len(ranks) == 1:
            q = self.locals[ranks[0]]
            return q.block_sample if blocks else q.sample
        key = (ranks, blocks)
        if key not in self._union_cache:
            half = len(ranks) // 2
            self._union_cache[key] = torch.unique(torch.cat(
                [self.union_set(ranks[:half], blocks), self.union_set(ranks[half:], blocks)]))
        return self._union_cache[key]

    def counts_PP(self, pattern: str) -> torch.Tensor:
        """``[src, server]`` entries of partition ``pattern`` (``"hash_counts"``, ``"range_counts"``,
        ``"block_counts"``), float64."""
        return torch.tensor([getattr(q, pattern) for q in self.locals], dtype=torch.float64)

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
        union = self.union_set(tuple(range(self.n)), blocks)
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
    blocks = nonzero_blocks(uniq, row_width, block_size)
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
    blocks_max = max(nonzero_blocks(torch.unique(g.indices), g.row_width, block_size).numel() for g in grads)
    s, sb = sample_parts_for(uniq_max, sample_budget), sample_parts_for(blocks_max, sample_budget)
    return SparsityProfile(
        numel=first.numel, row_width=first.row_width, value_bytes=first.values.element_size(), seed=seed,
        locals=[local_profile(g.indices, g.numel, g.row_width, n, seed, s, sb, block_size) for g in grads],
        sample_parts=s,
        block_sample_parts=sb, block_size=block_size,
    )


def nonzero_blocks(uniq: torch.Tensor, row_width: int, block_size: int) -> torch.Tensor:
    """The ids of the ``block_size``-element blocks that rows (or elements) ``uniq`` touch, sorted."""
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
