"""Sparsity analytics of the ZEN paper §2.1 and §3.1: density, overlap (Def. 3), densification (Def. 4),
skewness (Def. 5) and Push/Pull imbalance (Def. 8).

Index sets are sets: every function deduplicates its inputs first. In row form an index is a row. The
functions run on one process over the index sets of all ranks (from a trace, a workload or an
all-gather); nothing here communicates.

Legend: ``_K`` indices of one rank, ``_U`` the union over ranks, ``_P`` partitions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.cost import BLOCK_SIZE
from ..core.hashing import imbalance
from ..core.registry import scheme_class
from ..core.scheme import PartitionFn
from ..core.types import SparseGrad

__all__ = [
    "block_ids", "densification_curve", "densification_ratio", "density", "index_set", "overlap_ratio",
    "partition_fn", "pull_imbalance", "push_imbalance", "skewness", "union_density",
]


def index_set(x: SparseGrad | torch.Tensor) -> torch.Tensor:
    """Sorted distinct indices of a sparse gradient (or of an index tensor)."""
    idx = x.indices if isinstance(x, SparseGrad) else x
    return torch.unique(idx.reshape(-1).to(torch.int64), sorted=True)


def density(x: SparseGrad, numel: int | None = None) -> float:
    """``d_G``: the fraction of the ``numel`` indices (rows in row form) that are non-zero."""
    numel = x.numel if numel is None else numel
    return index_set(x).numel() / numel if numel else 0.0


def overlap_ratio(a: SparseGrad | torch.Tensor, b: SparseGrad | torch.Tensor) -> float:
    """Def. 3: ``|I₁ ∩ I₂| / min(|I₁|, |I₂|)``; 0.0 when either set is empty."""
    ia, ib = index_set(a), index_set(b)
    small = min(ia.numel(), ib.numel())
    if small == 0:
        return 0.0
    return torch.isin(ia, ib).sum().item() / small


def union_density(grads: Sequence[SparseGrad], numel: int | None = None) -> float:
    """``d_G^n``: density of the aggregate of ``grads``."""
    numel = grads[0].numel if numel is None else numel
    return _union(grads).numel() / numel if numel else 0.0


def densification_ratio(grads: Sequence[SparseGrad]) -> float:
    """Def. 4: ``γ_G^n = d_G^n / d_G`` with ``d_G`` the mean density of the inputs (1.0 if all empty)."""
    mean = sum(index_set(g).numel() for g in grads) / len(grads)
    return _union(grads).numel() / mean if mean else 1.0


def densification_curve(grads: Sequence[SparseGrad], group_sizes: Sequence[int] | None = None) -> dict[int, float]:
    """``γ^k`` for ``k`` in ``group_sizes`` (default 1, 2, 4, …, n, and n itself).

    Each ``γ^k`` is the mean over the aligned groups ``[0, k), [k, 2k), …`` of ranks — the groups
    recursive doubling merges — with the group's own mean density as ``d_G``.
    """
    n = len(grads)
    if group_sizes is None:
        group_sizes = sorted({1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n})
    curve = {}
    for k in group_sizes:
        if not 1 <= k <= n:
            raise ValueError(f"group size ({k}) must be in [1, {n}]")
        groups = [grads[s:s + k] for s in range(0, n - k + 1, k)]
        curve[k] = sum(densification_ratio(g) for g in groups) / len(groups)
    return curve


def skewness(x: SparseGrad | torch.Tensor, numel: int, n: int) -> float:
    """Def. 5: ``max_i d_{G_i} / d_G`` over ``n`` even contiguous partitions (1.0 for an empty set).

    ``x`` may also be an index tensor (e.g. the union over ranks).
    """
    idx = index_set(x)
    if idx.numel() == 0:
        return 1.0
    size = -(-numel // n)
    counts = torch.bincount(idx // size, minlength=n).to(torch.float64)
    sizes = torch.tensor([max(0, min(size, numel - i * size)) for i in range(n)], dtype=torch.float64)
    dens = torch.where(sizes > 0, counts / sizes.clamp(min=1), torch.zeros_like(counts))
    return float(dens.max() / (idx.numel() / numel))


def push_imbalance(grads: Sequence[SparseGrad], part_of: PartitionFn, n: int) -> float:
    """Def. 8, Push: ``max_{i,j} n·|I_i^j| / |I_i|`` over the ranks that have non-zeros (1.0 if none)."""
    worst = 1.0
    for g in grads:
        idx = index_set(g)
        if idx.numel():
            worst = max(worst, n * torch.bincount(part_of(idx), minlength=n).max().item() / idx.numel())
    return worst


def pull_imbalance(grads: Sequence[SparseGrad], part_of: PartitionFn, n: int) -> float:
    """Def. 8, Pull: ``max_i n·|𝕀_i| / |I|`` for the union ``I`` split by ``part_of`` (1.0 if empty)."""
    union = _union(grads)
    if union.numel() == 0:
        return 1.0
    return imbalance(torch.bincount(part_of(union), minlength=n))


def partition_fn(
    scheme: str, numel: int, n: int, *, seed: int = 0, row_width: int = 1, block_size: int = BLOCK_SIZE
) -> PartitionFn | None:
    """The index → server map of a Parallelism scheme, for ``push_imbalance``/``pull_imbalance``: the
    scheme's own ``partition_fn`` (``zen``/``zen_coo``: h0; ``sparse_ps``: contiguous ranges;
    ``omnireduce``: contiguous ranges of 256-element blocks — its unit of traffic, so indices map to
    their block's owner and a set of indices should be reduced to blocks first, ``block_ids``).
    Centralization schemes (``dense``, ``agsparse``, ``sparcml``) have no partition: ``None``.
    """
    return scheme_class(scheme).partition_fn(numel, n, seed=seed, row_width=row_width, block_size=block_size)


def block_ids(x: SparseGrad, block_size: int = BLOCK_SIZE) -> SparseGrad:
    """The non-zero ``block_size``-element blocks of ``x`` as an index-only gradient (OmniReduce's unit)."""
    w = x.row_width
    idx = index_set(x)
    if w > 1:
        idx = (idx.unsqueeze(1) * w + torch.arange(w, device=idx.device)).reshape(-1)
    blocks = torch.unique(idx // block_size)
    return SparseGrad(blocks, torch.ones(blocks.numel()), -(-x.dense_numel // block_size))


def _union(grads: Sequence[SparseGrad]) -> torch.Tensor:
    if not grads:
        return torch.empty(0, dtype=torch.int64)
    return torch.unique(torch.cat([g.indices.reshape(-1) for g in grads]), sorted=True)
