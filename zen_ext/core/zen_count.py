"""Contributor counting at ZEN's owners (``op="contributors"``): each index divided by the number of ranks
that sent it, as SparseLoCo averages its pseudo-gradients (``scatter_reduce_(reduce="mean")``).

Why at the owners: in ZEN's push every contribution to a position reaches that position's owner (h0),
so the owner can count, per position it owns, the ranks whose message carried it, and divide its sum
there. The pull then carries the averages in exactly the bytes of a sum (``op="sum"``/``"mean"``), where
sending each entry as a row ``(value, 1)`` through a plain sum doubles the values on the wire.

1. Push: COO always (position and value per entry), never the pre-summed dense partition ZEN sends
   when a rank's share of a partition is dense: a dense payload loses which positions were sent (a
   picked 0 is still a contributor), and COO is at most twice the dense payload there. (So the owner
   aggregates here, not in ``ops.aggregate_push``, which tells a dense payload by its size.)
2. Owner: the sum of every contribution (in payload order, the accumulation dtype, as ZEN's op sums),
   the touched bitmap, and ``count[p]``: the distinct senders of position ``p`` (a rank that sends an
   index twice counts once; its values are summed, as a dense scatter-add would).
3. Owner: ``sum[p] / count[p]`` where ``count[p] > 0`` (one correctly rounded division, in the sum's
   accumulation dtype), before the pull's cast; untouched positions stay 0.

Every rank decodes the same pulled message, so the result is bitwise the same everywhere; on
integer-valued inputs it equals the dense sum of the picks divided per index by its senders exactly.
Schemes without an owner that sees every contribution do not count (``SyncScheme.counts_contributors``
is False): they refuse ``op="contributors"``, and the outer sync falls back to the row form.

Legend: ``_M`` one owner's index-set size, ``_E`` received entries.
"""

from __future__ import annotations

import torch

from ..ops._reference import mask_to_words
from .types import acc_dtype
from .wire import view_as

CONTRIBUTORS = "contributors"
"""The op name: sum, then divide each index by its senders."""


def sender_counts(pos_by_sender: list[torch.Tensor | None], m: int, device) -> torch.Tensor:
    """Step 2's count: ``pos_by_sender[r]`` the compact positions rank ``r``'s push carried (None or
    empty: it sent none). Returns fp32 ``[m]``, the distinct senders per position (exact: at most n).

    A sender's duplicates count once: one bool per (sender, position) (about the bucket's element count
    in bytes, a quarter of the fp32 bucket), set in one scatter and summed over senders; no host read
    (a ``unique`` would read its size back) and a constant number of ops whatever the number of ranks."""
    live = [p for p in pos_by_sender if p is not None and p.numel()]
    if not live:
        return torch.zeros(m, dtype=torch.float32, device=device)
    keys_E = torch.cat([p.to(torch.int64) + r * m for r, p in enumerate(live)])
    seen = torch.zeros(len(live) * m, dtype=torch.bool, device=device)
    seen.index_fill_(0, keys_E, True)
    return seen.view(len(live), m).sum(0, dtype=torch.float32)


def aggregate_counted(c, recv: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-3 on one owner (``c``: the ``ZenCall``; ``recv``: the COO push messages ``[pos | values]``
    from every rank). Returns what ``ops.aggregate_push`` returns: ``(acc [m, width]`` holding the
    averages, ``words`` the touched bitmap, ``count_1)``."""
    m, width, device = c.m, c.width, c.device
    acc = torch.zeros((m, width), dtype=acc_dtype(c.dtype), device=device)
    pos_by_sender, vals = [], []
    for r in recv:
        k = r.numel() // (c.isz + c.vsz)
        pos_by_sender.append(view_as(r, 0, k, c.idt).to(torch.int64) if k else None)
        if k:
            vals.append(view_as(r, k * c.isz, k * width, c.dtype).view(k, width))
    touched = torch.zeros(m, dtype=torch.bool, device=device)
    if vals:
        pos_E = torch.cat([p for p in pos_by_sender if p is not None])
        acc.index_add_(0, pos_E, torch.cat(vals).to(acc.dtype))  # sequential on the CPU: payload order
        touched.index_fill_(0, pos_E, True)
    divide_by_senders_(acc, sender_counts(pos_by_sender, m, device))
    return acc, mask_to_words(touched), touched.sum().reshape(1)


def divide_by_senders_(acc_M: torch.Tensor, cnt_M: torch.Tensor) -> torch.Tensor:
    """Step 3: ``acc[p] /= count[p]`` where ``count[p] > 0`` (rows in row form), in place."""
    div = cnt_M.clamp(min=1).to(acc_M.dtype)
    return acc_M.div_(div.view((-1,) + (1,) * (acc_M.dim() - 1)))
