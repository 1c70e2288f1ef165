"""docs/extending.md's worked example: a sparsifier written outside the package, in one file.

``nonzero`` sends only the non-zero elements of the parameters it claims (by name), losslessly: the
synchronized result equals the dense all-reduce. It suits parameters whose gradients are sparse
element by element for reasons zen_ext cannot see (a pruned or masked layer, a partly frozen adapter).
Importing this module registers it; then ``"zen": {"nonzero": {"enabled": true, "params": ["mask"]}}``
turns it on like any built-in section, and ``tests/unit/test_extending_sparsifier.py`` runs it
through the Synchronizer, the config and torch DDP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from zen_ext.compress import Sparsifier, register_sparsifier
from zen_ext.core.types import SparseGrad


@dataclass(frozen=True)
class NonzeroConfig:
    """The ``zen.nonzero`` section."""

    enabled: bool = False
    """Send the non-zero elements of the parameters ``params`` names. Default off."""
    params: list = field(default_factory=list)
    """Regular expressions (``re.search``) over parameter names: the parameters this sparsifier takes."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"zen.nonzero.enabled ({self.enabled!r}) must be a bool")
        if not isinstance(self.params, (list, tuple)) or not all(isinstance(p, str) for p in self.params):
            raise TypeError(f"zen.nonzero.params ({self.params!r}) must be a list of regular expressions")
        for p in self.params:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"zen.nonzero.params ({p!r}) must be a regular expression: {exc}") from None


@register_sparsifier(config=NonzeroConfig)  # priority 0: it sees every parameter before the built-ins
class NonzeroSparsifier(Sparsifier):
    """The non-zero elements of every claimed slice of a bucket, as one element-form SparseGrad."""

    kind = "nonzero"
    lossless = True
    bucket_mode = "fused"  # one SparseGrad per bucket over the concatenation of its slices

    def __init__(self, config: NonzeroConfig) -> None:
        self.config = config

    @classmethod
    def claims(cls, param, config: NonzeroConfig) -> bool:
        return any(re.search(p, param.name) for p in config.params)

    def compress(self, grads, tp_comm=None) -> SparseGrad:
        """1. Concatenate the slices (flat views, bucket order). 2. Keep the non-zeros (one host read
        per bucket, for their count)."""
        # Step 1: the concatenation.
        flat = torch.cat([g.grad.reshape(-1) for g in grads])
        # Step 2: the non-zeros.
        idx = flat.nonzero().flatten()
        return SparseGrad(idx, flat[idx], flat.numel(), in_range=True)
