"""Plain data types shared by every scheme: a sparse gradient in COO form.

Legend: ``_N`` dense length, ``_K`` non-zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

INDEX_INT32_LIMIT = 2**31


@dataclass
class SparseGrad:
    """A flat gradient given by its non-zeros, element-wise or row-wise.

    Element form: ``values`` is ``[K]`` and ``indices`` address ``numel`` elements. Row form (embedding
    gradients, EmbRace's row granularity): ``values`` is ``[K, W]`` and ``indices`` address ``numel``
    rows of width ``W``; the dense gradient then has ``numel·W`` elements. ``indices`` may repeat
    (duplicates are summed, as a dense scatter-add would) and need not be sorted. ``values`` carries
    the gradient's dtype.
    """

    indices: torch.Tensor  # idx_K, int64
    values: torch.Tensor  # val_K or val_KW
    numel: int
    in_range: bool = field(default=False, compare=False, repr=False)
    """True when the indices lie in ``[0, numel)`` by construction (``nonzero`` of a ``numel``-long
    tensor, a compressor's positions): ``check_range`` then skips its host synchronization."""
    lowbit: object = field(default=None, compare=False, repr=False)
    """``core.lowbit.LowBitValues`` when the values travel in low bits (``zen.dgc.value_bits``; a scheme
    that cannot carry them refuses the gradient), else None: the values travel in their dtype."""

    def __post_init__(self) -> None:
        if self.indices.dim() != 1 or self.values.dim() not in (1, 2):
            raise ValueError(
                f"SparseGrad indices must be 1-D and values 1-D or 2-D, got {self.indices.dim()}-D and "
                f"{self.values.dim()}-D"
            )
        if self.indices.numel() != self.values.shape[0]:
            raise ValueError(
                f"SparseGrad has {self.indices.numel()} indices but {self.values.shape[0]} values"
            )
        if self.indices.dtype != torch.int64:
            self.indices = self.indices.to(torch.int64)

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def row_width(self) -> int:
        """Elements per index: 1 in element form, ``W`` in row form."""
        return 1 if self.values.dim() == 1 else self.values.shape[1]

    @property
    def dense_numel(self) -> int:
        return self.numel * self.row_width

    @classmethod
    def from_dense_rows(cls, grad_RW: torch.Tensor) -> "SparseGrad":
        """The non-zero rows of a 2-D gradient (row form)."""
        rows = grad_RW.reshape(grad_RW.shape[0], -1)
        idx = rows.ne(0).any(1).nonzero().flatten()
        return cls(idx, rows[idx], rows.shape[0], in_range=True)

    @classmethod
    def from_dense(cls, grad_N: torch.Tensor) -> "SparseGrad":
        """The non-zeros of a dense tensor (flattened)."""
        flat = grad_N.reshape(-1)
        idx = flat.nonzero().flatten()
        return cls(idx, flat[idx], flat.numel(), in_range=True)

    def to_dense(self) -> torch.Tensor:
        """Scatter-add into a dense flat tensor of ``dense_numel`` (duplicates summed)."""
        out = torch.zeros((self.numel,) + tuple(self.values.shape[1:]), dtype=self.values.dtype,
                          device=self.values.device)
        if self.nnz:
            out.index_add_(0, self.indices, self.values)
        return out.reshape(-1)

    def check_range(self, where: str = "SparseGrad") -> None:
        """Raise ValueError when an index falls outside ``[0, numel)`` (one host synchronization,
        skipped where ``in_range`` says the indices are in range by construction).

        Args:
            where: who checks (e.g. ``"scheme 'zen'"``), named first in the error.
        """
        if self.nnz and not self.in_range:
            lo, hi = torch.aminmax(self.indices)
            lo, hi = torch.stack([lo, hi]).tolist()
            if lo < 0 or hi >= self.numel:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{where}: grad.indices ({bad}) must lie in [0, {self.numel}) "
                                 f"(indices span [{lo}, {hi}])")


@dataclass
class AccumulatedGrad(SparseGrad):
    """A gradient handed over dense, with its memory, to a scheme that selects its entries itself
    (``spardl``): ``memory`` is the flat accumulated gradient (the local gradient plus the residual, in
    the memory dtype), which the scheme overwrites with what it keeps; ``density`` the fraction of
    entries it may send. As a SparseGrad it has no entries (``values`` is empty, in the wire dtype):
    every other scheme refuses it (``SyncScheme._validate``) rather than sync nothing. ``momentum``:
    the sparsifier's momentum, zeroed where the scheme consumed the local value (DGC's masking), or None.
    """

    memory: torch.Tensor = None  # acc_N, flat, contiguous
    density: float = 1.0
    momentum: torch.Tensor | None = None
    flush: "FlushPositions | None" = None
    """Positions the scheme must send this step whatever their size, inside its ``density`` budget (the
    sparsifier's rotating flush), or None."""

    @classmethod
    def of(cls, memory: torch.Tensor, density: float, wire_dtype: torch.dtype,
           momentum: torch.Tensor | None = None, flush: "FlushPositions | None" = None) -> "AccumulatedGrad":
        empty = torch.empty(0, dtype=wire_dtype, device=memory.device)
        return cls(empty.long(), empty, memory.numel(), in_range=True, memory=memory.reshape(-1),
                   density=float(density), momentum=momentum, flush=flush)


@dataclass(frozen=True)
class FlushPositions:
    """A rotating flush's positions in a flat memory (DGC's ``zen.dgc.flush_fraction``): in each of
    consecutive segments of lengths ``numels`` (one per tensor), the elements ``phase``, ``phase +
    stride``, ... counted from the segment's start, the same on every rank. ``positions`` holds them
    ascending on the memory's device; how many fall in a range is computed on the host from the
    segments (``count_in``), so a scheme's message sizes stay known everywhere without a host read."""

    positions: torch.Tensor  # pos_F, int64, ascending
    numels: tuple[int, ...]
    phase: int
    stride: int

    def count_below(self, at: list[int]) -> list[int]:
        """Flushed positions ``< x`` for each ``x`` in ``at`` (one vectorized pass over segments × ``at``)."""
        n_T = np.asarray(self.numels, dtype=np.int64)
        start_T = np.cumsum(n_T) - n_T + self.phase  # each segment's first flushed position
        count_T = np.maximum(0, -(-(n_T - self.phase) // self.stride))
        x = np.asarray(at, dtype=np.int64)[:, None]
        below = np.clip(-(-(x - start_T) // self.stride), 0, count_T)  # ceil((x − start) / stride), clipped
        return below.sum(axis=1).tolist()

    def count_in(self, ranges: list[tuple[int, int]]) -> list[int]:
        """Flushed positions in each ``[lo, hi)`` of ``ranges``."""
        if not ranges:
            return []
        ends = self.count_below([x for r in ranges for x in r])
        return [ends[2 * i + 1] - ends[2 * i] for i in range(len(ranges))]


def as_sparse(grad: "SparseGrad | torch.Tensor") -> SparseGrad:
    return grad if isinstance(grad, SparseGrad) else SparseGrad.from_dense(grad)


def as_dense(grad: "SparseGrad | torch.Tensor") -> torch.Tensor:
    return grad.to_dense() if isinstance(grad, SparseGrad) else grad.reshape(-1).clone()


def index_dtype(numel: int) -> torch.dtype:
    """Wire dtype of indices: int32 when they fit (numel < 2**31), else int64; never a float."""
    return torch.int32 if numel < INDEX_INT32_LIMIT else torch.int64


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and sparsifier memory accumulate in: fp32 for fp16/bf16 (more exact than a
    half-precision ring all-reduce; values still travel in the gradient's dtype), the dtype itself
    otherwise. (``zen_ext.ops._reference.acc_dtype`` states the same rule for the ops' contract.)"""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
