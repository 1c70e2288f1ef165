"""Low-bit values on ZEN's wire (``zen.dgc.value_bits``: 8 or 4), with error feedback at both ends.

DGC keeps 1-5 % of a bucket, and then most of ZEN's bytes are values (pushed COO, pulled after the
bitmap). With ``value_bits`` every value travels as a symmetric code of 8 or 4 bits with one scale per
block of ``VALUE_BLOCK[bits]`` values (fp32 at 8 bits, bf16 at 4: ``SCALE_BYTES``; ``ops.quantize_blocks``,
format in ``ops/_reference_lowbit.py``):

1. **Push**: a rank groups its selected values by owner (h0, as ZEN does), quantizes each owner's
   segment in blocks (a block never straddles two owners, so a message carries its own scales), and
   hands what the owners will see back to DGC (``LowBitValues.sender_feedback``): DGC's residual becomes
   ``accumulated − dequantized(sent)``, so the quantization error is delayed, not dropped.
2. **Owner**: it dequantizes every contribution and sums in fp32, adds its **owner residual** (one fp32
   per position of its index set 𝕀_i: ``|𝕀_i| ≈ numel/n``, kept in DGC's state, saved with it) at the
   positions it carries, quantizes the sum for the pull, and keeps ``sum − applied`` as the new owner
   residual (``applied``: what every rank will write, the gradient dtype's cast included). Positions not
   touched this step keep their residual until they are touched again (so the pull carries the same
   positions as without value_bits: the residual never densifies the message). A non-finite sum keeps
   the old residual there (an overflowed step is skipped, and DGC's journal restores the rest).
   DoubleSqueeze's server-side error feedback, over ZEN's balanced hash partition.
3. **Pull**: ``[format, count | index part | scales | codes]``, the index part as without value_bits
   (hash bitmap, COO positions, or none when dense: then every position of 𝕀_i travels, its residual
   included), the format the cheapest for these value bytes. The values follow their positions' global
   indices in ascending order, not the owner's hash order, so a block holds one tensor's sums where it can
   (in hash order every block mixes all the bucket's tensors, and a large tensor's scale coded a small one's
   sums as 0: ``benchmarks/comm/results/value_bits_zeros.md``). Every rank, the owner included, decodes the
   same message with the same ops, so replicas stay bitwise identical.

Message layouts: push ``[pos (index dtype) | scales (ceil(c/B), fp32 or bf16) | codes (ceil(c·bits/8))]`` per
peer (empty when nothing goes there; its count follows from its size: ``push_count``); pull above, the
bitmap padded to 8 bytes.

Why ``VALUE_BLOCK`` is 128 at 8 bits and 16 at 4, and 4-bit scales bf16: a block's scale is its largest
``|x|``, and DGC's selected values are the tail of the distribution, so the largest of a block grows with the
block and a coarse grid loses the small ones. At 8 bits (±127 steps) 128 values lose little (relative L2 error
0.009 on the recorded DGC traces) for 4/128 = 0.031 bytes a value of fp32 scales. At 4 bits (±7 steps) blocks
of 128 coded 45 % of the pushed values 0 from random weights (relative L2 error 0.13) and trained from scratch
1.1 % behind DGC in the gradient's dtype; blocks of 32 halved the zeros (L2 0.09-0.10) but still trained 0.59 %
behind at DGC 1 % (10 seeds); blocks of 16 (L2 0.075-0.081) trained 0.22 % behind (0.29 % at DGC 5 %; 10 seeds,
fp32 scales: ``docs/results/value_bits_history/time_to_quality_value_bits_scratch_b16_fp32_scales.md``).
Their scales travel as bf16, truncated inside the quantizing ops (``wire_scale``: the sender's error feedback
and every receiver use the value that travels), so blocks of 16 cost 2/16 = 0.125 bytes a value, what fp32
scales per 32 did: 3.0× fewer bytes than fp32 values at DGC 1 % (``benchmarks/comm/results/value_bits_zeros.md``,
``benchmarks/comm/results/value_bits_bytes.md``; quality in ``docs/sparsifiers.md``). A bf16 scale is within
2^-7 (relative) below ``amax/qmax`` (truncated: ``qmax · scale`` never passes ``amax``; tested), far below a 4-bit step. A
non-uniform code kept more values off zero at the same bytes but not the L2 error (blocks of 128, DGC 5 %
trace: powers of two 4 % zeros, L2 0.18; FP4 E2M1 40 %, L2 0.11; the zeros file's second table).

Legend: ``_K`` values of a rank, ``_C`` positions a pull carries, ``_M`` one partition's index-set size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..ops._reference_lowbit import SCALE_DTYPE, layout
from .wire import view_as

VALUE_BLOCK = {8: 128, 4: 16}
"""Values per scale at each width (module docstring: why 128 and 16)."""
SCALE_BYTES = {bits: dt.itemsize for bits, dt in SCALE_DTYPE.items()}
"""Bytes of a block's scale on the wire: fp32 at 8 bits, bf16 at 4 (module docstring: why)."""
VALUE_BITS = (8, 4)
"""``zen.dgc.value_bits``' values."""


@dataclass
class LowBitValues:
    """What a SparseGrad carries when its values travel in low bits (``SparseGrad.lowbit``).

    ``sender_feedback(order_K, deq_K)``: the values at ``order_K`` (indices into the SparseGrad's values)
    reach their owners as ``deq_K`` (fp32); the sparsifier keeps ``sent − deq`` in its residual. None: the
    memory is not to be touched (non-finite values, sent as they are).
    ``owner_residual(m, device)``: this rank's owner residual for this bucket (fp32 ``[m]``, zeros at
    first), None when owner-side error feedback is off.
    ``sender_residual()``: where the sender's memory is one fp32 buffer, ``(R, pos_K, values)``: the buffer,
    the SparseGrad's positions in it and the values the feedback is of; the scheme then writes the feedback
    in its quantizing pass (``ops.quantize_sent_``: ``R[pos_K[order_K]] += sent − deq``, what
    ``sender_feedback`` does) when those values are the ones it quantizes. None: ``sender_feedback`` only.
    """

    bits: int
    block: int = 0
    sender_feedback: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    owner_residual: Callable[[int, torch.device], torch.Tensor] | None = None
    sender_residual: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self):
        self.block = self.block or VALUE_BLOCK[self.bits]  # 0: the width's own block


def value_bytes(count: int, bits: int, block: int | None = None) -> int:
    """Bytes of ``count`` values in one segment: the scales and the codes (``block`` None: the width's own)."""
    block = block or VALUE_BLOCK[bits]
    return SCALE_BYTES[bits] * ((count + block - 1) // block) + (count * bits + 7) // 8


def wire_scales(scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The ops' fp32 scales in their wire dtype (exact: at 4 bits the ops already truncated them to bf16)."""
    return scales.to(SCALE_DTYPE[bits])


def read_scales(buf_B: torch.Tensor, offset: int, count: int, bits: int) -> torch.Tensor:
    """``count`` scales at byte ``offset`` of a received message, in their wire dtype: the caller casts the
    concatenation of every message's to fp32 once (``.float()``; a no-op at 8 bits), so a bucket costs one
    cast, not one per peer."""
    return view_as(buf_B, offset, count, SCALE_DTYPE[bits])


def push_bytes(count: int, idx_bytes: int, bits: int, block: int | None = None) -> int:
    """Bytes of a push message of ``count`` values."""
    return count * idx_bytes + value_bytes(count, bits, block)


def push_count(size: int, idx_bytes: int, bits: int, block: int | None = None) -> int:
    """The count of a push message of ``size`` bytes (``push_bytes`` is strictly increasing)."""
    lo, hi = 0, size // idx_bytes if idx_bytes else size * 8 // bits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if push_bytes(mid, idx_bytes, bits, block) <= size:
            lo = mid
        else:
            hi = mid - 1
    if push_bytes(lo, idx_bytes, bits, block) != size:
        raise RuntimeError(f"zen: a low-bit push message of {size} bytes matches no count ({idx_bytes}-byte "
                           f"indices, {bits}-bit values): the ranks disagree on zen.dgc.value_bits")
    return lo


def pull_costs(count: int, part_size: int, idx_bytes: int, bits: int, block: int | None = None) -> dict[int, int]:
    """Body bytes of each pull format (``zen_wire``'s codes) for ``count`` low-bit values of a partition."""
    from .bitmap import bitmap_bytes
    from .zen_wire import FMT_BITMAP, FMT_COO, FMT_DENSE

    bm = bitmap_bytes(part_size)
    return {
        FMT_DENSE: value_bytes(part_size, bits, block),
        FMT_BITMAP: bm + (-bm % 8) + value_bytes(count, bits, block),
        FMT_COO: count * idx_bytes + value_bytes(count, bits, block),
    }


def cheapest_format(count: int, part_size: int, idx_bytes: int, bits: int, forced: str = "auto",
                    block: int | None = None) -> int:
    """``zen_wire.cheapest_format`` for low-bit values."""
    from .zen_wire import FMT_BY_NAME

    if forced != "auto":
        return FMT_BY_NAME[forced]
    costs = pull_costs(count, part_size, idx_bytes, bits, block)
    return min(costs, key=lambda f: (costs[f], -f))


def segment_layout(seg_ends: list[int], bits: int, block: int | None = None):
    """Per segment: first element, first code byte, first scale (``ops/_reference_lowbit.layout``)."""
    return layout(seg_ends, bits, block or VALUE_BLOCK[bits])
