"""``natural``: the non-zero rows of embedding gradients, sent losslessly (ZEN paper §2.2, §4).

An embedding's gradient is non-zero only in the rows of the tokens in the batch. ``natural`` sends
those rows as they are, so the synchronized result equals the dense all-reduce. By default the
index is a *row* id with a whole row of values behind it (EmbRace's row granularity): ZEN then
hashes row ids, which keeps the partitions balanced and cuts the Push index bytes by the row width
``W`` (a rank sends ``K_rows·(4 + W·itemsize)`` bytes instead of ``K_rows·W·(4 + itemsize)``;
docs/sparsifiers.md has the measured bytes per rank on a Zipf workload).

It claims embeddings (``routing.classify_parameters`` finds them: ``nn.Embedding``, ``nn.EmbeddingBag``,
a HF model's ``get_input_embeddings()``, vocab-parallel shards) unless the weight is *tied* to an
output layer: the LM head then makes its gradient dense, so it is routed like any other matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.types import SparseGrad
from .base import NamedGrad, Sparsifier, check_bool, config_from_dict
from .registry import register_sparsifier


@dataclass(frozen=True)
class NaturalConfig:
    """The ``zen.natural`` section."""

    enabled: bool = True
    """Send only the non-zero rows of embedding gradients (lossless). Default on."""
    row_granularity: bool = True
    """Index rows, not elements: Push index bytes shrink by the row width (EmbRace; measured in
    docs/sparsifiers.md). ``False`` sends element-wise COO of the non-zeros."""

    def __post_init__(self) -> None:
        check_bool("natural", "enabled", self.enabled)
        check_bool("natural", "row_granularity", self.row_granularity)

    @classmethod
    def from_dict(cls, values: "dict | NaturalConfig | None") -> "NaturalConfig":
        return config_from_dict(cls, values, "natural")


@register_sparsifier(config=NaturalConfig, priority=100)
class NaturalSparsifier(Sparsifier):
    """The non-zero rows (or elements) of one embedding gradient; stateless and lossless."""

    kind = "natural"
    lossless = True
    bucket_mode = "per_slice"  # row widths differ between embeddings: one SparseGrad each
    row_sparse = True  # only the batch's tokens' rows are non-zero

    @classmethod
    def claims(cls, param, config) -> bool:
        """Untied embeddings (a tied one's gradient is dense through the output layer)."""
        return param.is_embedding and not param.tied

    def __init__(self, config: NaturalConfig | None = None) -> None:
        self.config = config or NaturalConfig()

    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """The non-zero rows of one gradient, indexed by row (row form), or its non-zero elements.

        Args:
            grads: exactly one gradient, shaped like its parameter (rows along dim 0).
            tp_comm: unused (a vocab-parallel shard's rows are local to it).

        Raises:
            ValueError: not exactly one gradient (row widths differ between parameters).
        """
        if len(grads) != 1:
            raise ValueError(f"NaturalSparsifier.compress takes one gradient at a time, got {len(grads)}")
        return self.compress_each(grads)[0]

    def compress_each(self, grads: Sequence[NamedGrad]) -> list[SparseGrad]:
        """``compress`` of every gradient of ``grads``, with one host read for all of them.

        1. Mark each gradient's non-zero rows (or elements) and count them, on the device.
        2. Read every count at once (the one host synchronization, whatever the number of gradients).
        3. Find each gradient's marked rows with ``nonzero_static`` of the known count (no read).
        """
        # Step 1: marks and counts.
        srcs, marks = [], []
        for ng in grads:
            g = ng.grad
            if self.config.row_granularity and g.dim() >= 2:
                src = g.reshape(g.shape[0], -1)
                marks.append(src.ne(0).any(1))
            else:
                src = g.reshape(-1)
                marks.append(src.ne(0))
            srcs.append(src)
        if not marks:
            return []
        # Step 2: one read.
        counts = torch.stack([m.sum() for m in marks]).tolist()
        # Step 3: the rows.
        out = []
        for src, mark, k in zip(srcs, marks, counts):
            idx = torch.nonzero_static(mark, size=int(k)).flatten()
            out.append(SparseGrad(idx, src.index_select(0, idx), src.shape[0], in_range=True))
        return out
