"""Byte packing of several tensors into one uint8 message, so a phase costs one message per peer."""

from __future__ import annotations

import torch


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the raw bytes of 1-D tensors into one uint8 tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def view_as(buf_B: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` starting at byte ``offset`` of ``buf_B`` (copied if misaligned)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    part = buf_B[offset : offset + count * esize]
    if (part.storage_offset() % esize) or (part.data_ptr() % esize):
        part = part.clone()
    return part.view(dtype)
