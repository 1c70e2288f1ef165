"""``none``: the null sparsifier, for parameters routed dense (1-D, small, tied embeddings).

It sends everything: the concatenation of the group's gradients, which the Synchronizer all-reduces
in one call per bucket (ring: ``2·(n−1)/n · numel · itemsize`` bytes each way per rank). A null object
instead of an if-branch keeps the Synchronizer's routing uniform (GRACE's ``NoneCompressor``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import NamedGrad, Sparsifier


class NoneSparsifier(Sparsifier):
    """Send the gradients as they are (dense); lossless by construction."""

    kind = "dense"
    lossless = True

    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> torch.Tensor:
        """The group's gradients, flattened and concatenated (always a copy: the caller reduces it in place)."""
        if not grads:
            raise ValueError("NoneSparsifier.compress needs at least one gradient")
        return torch.cat([g.grad.reshape(-1) for g in grads])
