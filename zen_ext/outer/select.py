"""Chunked top-k with error feedback: what one replica sends of its pseudo-gradient (SparseLoCo, arXiv
2508.15706, without its 2-bit values).

The error feedback ``e`` of a bucket absorbs the pseudo-gradient (``e ← β·e + Δ``); each chunk of
``chunk`` consecutive elements then sends its ``k`` entries of largest ``|e|``, and the sent values leave
``e`` (set to 0 there), so every value is either sent or still in ``e``: ``sent + e_after = β·e_before + Δ``
exactly (tests/unit/test_outer.py checks it).

Legend: ``_N`` elements of the bucket, ``_C`` full chunks, ``_K`` picked entries.
"""

from __future__ import annotations

import torch

from .config import OuterConfig


def picks_per_bucket(cfg: OuterConfig, numel: int) -> int:
    """Entries one replica sends of a bucket of ``numel`` elements (known before any data: no host read)."""
    full, tail = divmod(numel, cfg.chunk)
    return full * cfg.k_of(cfg.chunk) + (cfg.k_of(tail) if tail else 0)


def select_(err_N: torch.Tensor, cfg: OuterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the top-k ``|err|`` of every chunk and take them out of ``err`` (in place).

    1. Full chunks: one ``topk`` over the ``[C, chunk]`` view (k = ``cfg.k_of(chunk)`` each).
    2. The tail chunk (``numel % chunk`` elements, if any): its own ``topk`` (k = ``cfg.k_of(tail)``).
    3. Gather the picked values, then zero them in ``err``: they leave the error feedback.

    Returns:
        ``(idx_K, val_K)``: positions in the bucket (int64, unsorted, distinct) and the values sent.
        Sizes depend only on ``numel`` and ``cfg`` (``picks_per_bucket``), never on the data.
    """
    n, chunk = err_N.numel(), cfg.chunk
    full, tail = divmod(n, chunk)
    parts = []
    # Step 1: full chunks.
    if full:
        k = cfg.k_of(chunk)
        col_CK = err_N[: full * chunk].view(full, chunk).abs().topk(k, dim=1, sorted=False).indices
        base_C1 = torch.arange(full, device=err_N.device, dtype=torch.int64).mul_(chunk).unsqueeze(1)
        parts.append((col_CK + base_C1).reshape(-1))
    # Step 2: the tail chunk.
    if tail:
        k = cfg.k_of(tail)
        parts.append(err_N[full * chunk:].abs().topk(k, sorted=False).indices + full * chunk)
    idx_K = parts[0] if len(parts) == 1 else torch.cat(parts)
    # Step 3: the picked values leave the error feedback.
    val_K = err_N[idx_K]
    err_N[idx_K] = 0
    return idx_K, val_K
