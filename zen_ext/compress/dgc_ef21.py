"""DGC's EF21 feedback (``zen.dgc.feedback: "ef21"``; Richtárik et al., NeurIPS'21): each rank keeps an
estimate ``G_i`` of its gradient and sends the top-k of the *difference* ``g − G_i``; every rank keeps the
same aggregate ``A`` and adds the synchronized difference to it. The selection is DGC's error feedback
run on ``g − G_i`` (``DGCSparsifier._compress_ef``), so both feedbacks share one kernel path.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.types import SparseGrad
from .base import NamedGrad
from .dgc_units import memory_dtype


def compress(sp, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
    """EF21: send the top-k of ``g − G_i`` and move the estimate ``G_i`` by what was sent.

    1. The residual becomes ``−G_i``, so error feedback's accumulation (``R += g``) makes it
       ``g − G_i``; the residual is scratch under EF21 (rebuilt every step from ``G_i``).
    2. Error feedback's selection sends the top-k of it and leaves ``g − G_i − sent`` in ``R``.
    3. ``G_i ← g − R``: the old estimate plus exactly what was sent (cast rounding included).
       An overflowed gradient (error feedback sent its non-finite entries and touched nothing)
       leaves ``G_i`` as it was.
    The Synchronizer adds the synchronized result to the previous aggregate (``add_aggregate_``).
    """
    if not grads:
        raise ValueError("DGCSparsifier.compress needs at least one gradient")
    flats = [g.grad if g.grad.dim() == 1 else g.grad.reshape(-1) for g in grads]
    mdt = memory_dtype(flats[0].dtype, sp.config.residual_dtype)
    names, numels = tuple(g.name for g in grads), tuple(f.numel() for f in flats)
    device = flats[0].device
    # Step 1: residual = −G_i.
    G, G_T = sp.state.flat(names, numels, "ef21_estimate", mdt, device)
    R, _ = sp.state.flat(names, numels, "residual", mdt, device)
    torch.neg(G, out=R)
    # Step 2: error feedback's selection on g − G_i.
    sp._overflowed = False
    sent = sp._compress_ef(grads, tp_comm)
    # Step 3: the estimate moves by what was sent.
    if not sp._overflowed:
        _, R_T = sp.state.flat(names, numels, "residual", mdt, device)
        torch._foreach_copy_(G_T, flats)
        torch._foreach_sub_(G_T, R_T)
    return sent


def add_aggregate_(sp, names: Sequence[str], outs: Sequence[torch.Tensor]) -> None:
    """EF21's receiving side: ``out ← A + out`` (the synchronized difference added to the previous
    aggregate ``A``), then ``A ← out``. ``A`` is the same on every rank (every rank adds the same
    synchronized values), kept in the memory dtype; ``outs`` are the DGC slices of the result."""
    mdt = memory_dtype(outs[0].dtype, sp.config.residual_dtype)
    A, A_T = sp.state.flat(tuple(names), tuple(o.numel() for o in outs), "ef21_aggregate", mdt, outs[0].device)
    if mdt == outs[0].dtype:
        torch._foreach_add_(A_T, list(outs))
    else:
        torch._foreach_add_(A_T, [o.to(mdt) for o in outs])
    for o, a in zip(outs, A_T):
        o.copy_(a)
