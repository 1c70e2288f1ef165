"""One bucket between ``Synchronizer.prepare_flat`` and its communicating half (``finish_flat``, or
``reduction/scatter.py``'s reduce-scatter): the plan, the dense buffer and each SparseGrad on its way
to the scheme. Its own module so the Synchronizer's stays about routing (and under the line bound)."""

from __future__ import annotations

import dataclasses

import torch

from ..core.types import SparseGrad
from .plan import GradSlice, Plan, SliceGroup


@dataclasses.dataclass
class PreparedPart:
    """One SparseGrad of a bucket on its way to the scheme: a fused group's, or one slice's."""

    group: SliceGroup
    grad: SparseGrad
    numel: int
    """Elements it stands for (the slices', for stats)."""
    slice: GradSlice | None = None
    """The slice of a per-slice part; None for a fused group."""

    @property
    def key(self) -> str:
        return f"{self.slice.name}:{self.group.kind}" if self.slice is not None else self.group.key


@dataclasses.dataclass
class PreparedBucket:
    """One bucket between ``Synchronizer.prepare_flat`` and ``finish_flat``."""

    flat: torch.Tensor
    flat_N: torch.Tensor
    out_N: torch.Tensor
    plan: "Plan"
    op: str
    dense_buf: torch.Tensor | None = None
    parts: list[PreparedPart] = dataclasses.field(default_factory=list)
    local_s: float = 0.0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this bucket holds (the dense buffer, the sparsifiers' entries, the views).

        A caller that finishes the bucket on another CUDA stream marks these as used there
        (``record_stream``): they were allocated on the preparing stream, and the caching allocator
        would otherwise hand their memory out again while the other stream still reads it.
        """
        found: list[torch.Tensor] = []

        def walk(x) -> None:
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)
            elif isinstance(x, SparseGrad):
                found.extend((x.indices, x.values))

        walk([self.flat, self.flat_N, self.out_N, self.dense_buf, [p.grad for p in self.parts]])
        return found
