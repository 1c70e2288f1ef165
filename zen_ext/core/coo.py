"""The COO wire codec of the COO baselines (``agsparse``, ``sparse_ps``, ``sparcml``, ``omnireduce``).

One message ``[indices (int32, or int64 if numel ≥ 2^31) | values]``: indices are never packed into
floats (Ok-Topk's float packing corrupts indices past 2^24); the entry count follows from the size.
Row-form gradients travel as rows, one index per row.

Legend: ``_K`` entries, ``_B`` bytes.
"""

from __future__ import annotations

import torch

from .types import index_dtype
from .wire import pack, view_as


def entry_bytes(numel: int, row_width: int, dtype: torch.dtype) -> int:
    """Wire bytes of one COO entry: its index plus ``row_width`` values."""
    isz = torch.empty(0, dtype=index_dtype(numel)).element_size()
    return isz + row_width * torch.empty(0, dtype=dtype).element_size()


def encode_coo(idx_K: torch.Tensor, val_K: torch.Tensor, numel: int) -> torch.Tensor:
    """One uint8 message ``[indices | values]`` (indices in the wire dtype for ``numel``)."""
    return pack(idx_K.to(index_dtype(numel)), val_K)


def decode_coo(
    buf_B: torch.Tensor, numel: int, row_shape: tuple[int, ...], dtype: torch.dtype, wire_indices: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``encode_coo``: ``(idx_K, val_K)``; the count follows from the message size.

    Indices come back as int64, or in their wire dtype with ``wire_indices`` (half the memory).
    """
    width = 1
    for s in row_shape:
        width *= s
    idt = index_dtype(numel)
    isz = torch.empty(0, dtype=idt).element_size()
    k = buf_B.numel() // entry_bytes(numel, width, dtype)
    idx = view_as(buf_B, 0, k, idt)
    idx = idx if wire_indices else idx.to(torch.int64)
    vals = view_as(buf_B, k * isz, k * width, dtype).view((k,) + row_shape)
    return idx, vals


def finish(out: torch.Tensor, dtype: torch.dtype, op: str, n: int) -> torch.Tensor:
    """Cast an exact sum to the gradient dtype, then divide for ``mean`` — the order ``dense`` uses."""
    out = out.to(dtype).reshape(-1)
    if op == "mean":
        out = out.div_(n)
    return out
