"""Hash-bitmap encoding for the pull phase (ZEN paper §3.3.2, Algorithm 2).

Server ``i`` owns the ordered index set ``𝕀_i``; after aggregation it marks which positions of
``𝕀_i`` are non-zero with one bit each and sends the bitmap plus the values in ``𝕀_i`` order. Each
worker receives ``Σ_i |𝕀_i| / 8 = numel / 8`` bitmap bytes in total, independent of ``n`` (a plain
bitmap over hashed partitions would cost ``n·numel/8``). Positions decode to global indices through
``HashPartitioner.indices_of`` (no table).

``zen`` itself now encodes and decodes its bitmaps inside the fused pull ops (``zen_ext.ops.encode_pull``
/ ``decode_pull_``, 64-bit words scanned with popcount and count-trailing-zeros, same bytes); these
byte-level helpers remain for analysis and for ``benchmarks/cluster/bench_overhead.py``'s before/after decode.

Legend: ``_M`` bitmap length in bits (``|𝕀_i|``), ``_B`` bytes.
"""

from __future__ import annotations

import numpy as np
import torch

_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # per device, built once (no copy per call)


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    return w


def bitmap_bytes(num_bits: int) -> int:
    return (num_bits + 7) // 8


def encode_bitmap(mask_M: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask into bytes, least significant bit first; returns uint8 ``bitmap_B``."""
    if mask_M.device.type == "cpu":  # numpy's packbits is one C pass; the torch path below is ~10x slower
        return torch.from_numpy(np.packbits(mask_M.numpy(), bitorder="little"))
    m = mask_M.numel()
    padded = torch.zeros(bitmap_bytes(m) * 8, dtype=torch.uint8, device=mask_M.device)
    padded[:m] = mask_M.to(torch.uint8)
    return (padded.view(-1, 8) * _bit_weights(mask_M.device)).sum(1, dtype=torch.uint8)


def decode_bitmap(bitmap_B: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Positions (int64, ascending) of the set bits among the first ``num_bits``."""
    if bitmap_B.device.type == "cpu":
        bits_np = np.unpackbits(bitmap_B.numpy(), count=num_bits, bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits_np))
    bits = (bitmap_B.unsqueeze(1) & _bit_weights(bitmap_B.device)).ne(0).view(-1)[:num_bits]
    return bits.nonzero().flatten()
