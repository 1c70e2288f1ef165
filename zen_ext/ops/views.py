"""Views over lists of tensors, shared by the ops' wrappers and their callers (no kernel of their own)."""

from __future__ import annotations

import torch


def concat_view(g_T: list[torch.Tensor]) -> torch.Tensor:
    """The concatenation of the contiguous 1-D tensors ``g_T``: a view when they lie back to back in one
    storage (an engine bucket's slices), else a copy."""
    first = g_T[0]
    if len(g_T) == 1:
        return first
    esz, ptr = first.element_size(), first.data_ptr()
    total, adjacent = 0, True
    for g in g_T:
        if g.numel() and (g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                          or g.data_ptr() != ptr + total * esz or not g.is_contiguous()):
            adjacent = False
        total += g.numel()
    if adjacent:
        return first.as_strided((total,), (1,))
    return torch.cat(g_T)
