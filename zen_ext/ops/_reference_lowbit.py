"""Pure-torch reference of the low-bit value ops (``zen_ext::quantize_blocks`` / ``dequantize_blocks``):
what ``zen_ext.ops`` runs where a device has no kernel, and the oracle the kernels must equal bit for bit
(tests/ops/test_lowbit_ops.py). Used by ``zen.dgc.value_bits`` (``core/lowbit.py``).

The values are cut into segments (``seg_ends``: cumulative element ends, e.g. one segment per receiving
peer), and each segment into blocks of ``block`` values; a block never straddles two segments, so a
segment's codes and scales are contiguous slices a message can carry alone. Per block:

* ``scale = amax / qmax`` in fp32 (``amax`` the block's largest ``|x|``, NaN if any ``x`` is NaN;
  ``qmax`` 127 for 8 bits, 7 for 4 bits: symmetric, so 0 is exact and signs cost nothing); at 4 bits a
  finite scale > 0 is truncated to bf16 (``wire_scale``: the dtype 4-bit scales travel in; 0 if it
  truncates to 0, below ``2^-133``);
* ``q = rint(x / scale)`` clamped to ``[-qmax, qmax]`` (round to nearest, ties to even: deterministic,
  the same on every device), ``q = 0`` where ``scale`` is not a finite number > 0 (an all-zero block, an
  ``amax`` below ``qmax`` times the smallest subnormal, or a non-finite value);
* ``x̂ = q · scale`` in fp32: exactly 0 for a zero block, NaN for a block holding inf or NaN (so an
  overflow still reaches the engine as one).

The fused forms (one pass each where the scheme used to run several ops; ``core/zen_lowbit.py``):

* ``quantize_sent_``: the sender's step: ``values[order]`` quantized, and where a residual is given the
  sender's error feedback ``residual[res_pos[order]] += x − x̂`` (fp32; DGC's positions are unique);
* ``dequantize_add_blocks_``: the owner's aggregation: ``acc[pos[i]] += x̂_i`` in the order of ``i`` (fp32,
  as ``index_add_``; senders overlap, so the order is part of the result) and ``touched[pos[i]] = True``;
* ``quantize_owned_``: the owner's pull: ``s = acc[pos] (+ residual[pos])`` quantized, and the owner
  residual at ``pos`` becomes ``s − applied(x̂)`` where finite (``applied``: ``x̂ / divisor`` cast to the
  gradient's dtype and back, times ``divisor``: what every rank applies, in sum units).

Layout: 8 bits, one int8 code a byte; 4 bits, ``q + 8`` in a nibble, two a byte, the even element of a
pair in the low nibble, a segment's codes starting on a byte (``ceil(c/2)`` bytes; the last high nibble
of an odd segment is 0). Segment ``s`` of ``c_s`` values takes ``ceil(c_s·bits/8)`` code bytes and
``ceil(c_s/block)`` scales (the ops hand them out as fp32; on the wire fp32 at 8 bits, bf16 at 4:
``SCALE_DTYPE``), the segments back to back in both.
"""

from __future__ import annotations

import torch

FUSED_LOWBIT_OPS = ("quantize_sent_", "dequantize_add_blocks_", "quantize_owned_")
"""The fused forms (module docstring), in ``force_reference`` to run the unfused sequences."""
QMAX = {8: 127, 4: 7}
"""The largest code magnitude for each supported width."""
SCALE_DTYPE = {8: torch.float32, 4: torch.bfloat16}
"""The dtype a block's scale travels in (``csrc/lowbit.h`` ``scale_bytes_of``)."""


def wire_scale(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``scale`` as it travels: at 4 bits each finite scale > 0 truncated to bf16 (its high half: down,
    so ``qmax · scale`` never passes ``amax`` nor overflows; ``q · scale`` is exact in fp32); else unchanged."""
    if bits != 4 or not scale.numel():
        return scale
    ok = (scale > 0) & torch.isfinite(scale)
    down = (scale.view(torch.int32) & -65536).view(torch.float32)
    return torch.where(ok, down, scale)


def check_args(bits: int, block: int, seg_ends: list[int], numel: int, op: str) -> None:
    if bits not in QMAX:
        raise RuntimeError(f"{op}: bits ({bits}) must be 8 or 4")
    if block < 2 or block % 2 or block > 1024:
        raise RuntimeError(f"{op}: block ({block}) must be even and in [2, 1024]")
    prev = 0
    for e in seg_ends:
        if e < prev:
            raise RuntimeError(f"{op}: seg_ends ({list(seg_ends)}) must be non-decreasing from 0")
        prev = e
    if prev != numel:
        raise RuntimeError(f"{op}: seg_ends ({list(seg_ends)}) must end at the number of values ({numel})")


def layout(seg_ends: list[int], bits: int, block: int) -> tuple[list[int], list[int], list[int]]:
    """Per segment: its first element, its first code byte and its first block (each with a final total)."""
    elem, code, blk = [0], [0], [0]
    for e in seg_ends:
        c = e - elem[-1]
        elem.append(e)
        code.append(code[-1] + (c * bits + 7) // 8)
        blk.append(blk[-1] + (c + block - 1) // block)
    return elem, code, blk


def _block_index(seg_ends: list[int], block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: its block (global) and its offset within its segment."""
    elem, _, blk = layout(seg_ends, 8, block)
    counts = torch.tensor([e - s for s, e in zip(elem[:-1], elem[1:])], dtype=torch.int64, device=device)
    seg_K = torch.repeat_interleave(torch.arange(len(seg_ends), device=device), counts)
    off_K = torch.arange(elem[-1], device=device) - torch.tensor(elem[:-1], dtype=torch.int64, device=device)[seg_K]
    blk_K = torch.tensor(blk[:-1], dtype=torch.int64, device=device)[seg_K] + off_K // block
    return blk_K, off_K


def quantize_blocks(values: torch.Tensor, seg_ends: list[int], bits: int, block: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8, scales fp32, dequantized fp32)`` of the 1-D float ``values`` (module docstring)."""
    seg_ends = [int(e) for e in seg_ends]
    if values.dim() != 1 or not values.is_floating_point():
        raise RuntimeError("quantize_blocks: values must be a 1-D float tensor")
    check_args(bits, block, seg_ends, values.numel(), "quantize_blocks")
    device = values.device
    _, code, blk = layout(seg_ends, bits, block)
    x = values.to(torch.float32)
    K, nb, qmax = x.numel(), blk[-1], QMAX[bits]
    blk_K, off_K = _block_index(seg_ends, block, device)
    # amax per block, NaN-propagating: a [blocks, block] matrix padded with zeros.
    lane = off_K % block
    mat = torch.zeros(nb, block, dtype=torch.float32, device=device)
    mat[blk_K, lane] = x.abs()
    scales = wire_scale(mat.amax(1) / qmax, bits) if nb else torch.zeros(0, dtype=torch.float32, device=device)
    s_K = scales[blk_K]
    ok = (s_K > 0) & torch.isfinite(s_K)
    q = torch.where(ok, torch.round(x / torch.where(ok, s_K, torch.ones_like(s_K))), torch.zeros_like(x))
    qi = q.clamp(-qmax, qmax).to(torch.int64)
    deq = qi.to(torch.float32) * s_K  # through the integer: a code 0 gives +0.0 (x/s may round to -0.0)
    codes = torch.zeros(code[-1], dtype=torch.uint8, device=device)
    if bits == 8:
        codes.copy_(qi.to(torch.int8).view(torch.uint8))
    elif K:
        elem, _, _ = layout(seg_ends, bits, block)
        seg_code = torch.tensor(code[:-1], dtype=torch.int64, device=device)
        counts = torch.tensor([e - s for s, e in zip(elem[:-1], elem[1:])], dtype=torch.int64, device=device)
        byte_K = torch.repeat_interleave(seg_code, counts) + off_K // 2
        nib = ((qi + 8) << ((off_K % 2) * 4)).to(torch.int64)
        acc = torch.zeros(code[-1], dtype=torch.int64, device=device).index_add_(0, byte_K, nib)
        codes.copy_(acc.to(torch.uint8))
    return codes, scales, deq


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, seg_ends: list[int], bits: int, block: int
                      ) -> torch.Tensor:
    """The fp32 values ``q · scale`` of ``quantize_blocks``' codes and scales."""
    seg_ends = [int(e) for e in seg_ends]
    K = seg_ends[-1] if seg_ends else 0
    check_args(bits, block, seg_ends, K, "dequantize_blocks")
    _, code, blk = layout(seg_ends, bits, block)
    if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != code[-1]:
        raise RuntimeError(f"dequantize_blocks: codes must be 1-D uint8 of {code[-1]} bytes")
    if scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() != blk[-1]:
        raise RuntimeError(f"dequantize_blocks: scales must be 1-D float32 of {blk[-1]} blocks")
    device = codes.device
    blk_K, off_K = _block_index(seg_ends, block, device)
    if bits == 8:
        q = codes.view(torch.int8).to(torch.float32)
    else:
        elem, _, _ = layout(seg_ends, bits, block)
        counts = torch.tensor([e - s for s, e in zip(elem[:-1], elem[1:])], dtype=torch.int64, device=device)
        byte_K = torch.repeat_interleave(torch.tensor(code[:-1], dtype=torch.int64, device=device), counts) + off_K // 2
        b = codes.to(torch.int64)[byte_K] if K else torch.zeros(0, dtype=torch.int64, device=device)
        q = (((b >> ((off_K % 2) * 4)) & 15) - 8).to(torch.float32)
    return q * scales[blk_K]


def _index(t: torch.Tensor | None, n: int | None, what: str, op: str) -> None:
    if t is None or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or (n is not None and t.numel() != n):
        raise RuntimeError(f"{op}: {what} must be a 1-D int32 or int64 tensor" + (f" of {n} elements" if n is not None else ""))


def _fp32(t: torch.Tensor | None, what: str, op: str) -> None:
    if t is None or t.dim() != 1 or t.dtype != torch.float32:
        raise RuntimeError(f"{op}: {what} must be a 1-D float32 tensor")


def quantize_sent_(values: torch.Tensor, order: torch.Tensor, residual: torch.Tensor | None,
                   res_pos: torch.Tensor | None, seg_ends: list[int], bits: int, block: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blocks(values[order])``, and with ``residual`` (fp32) ``residual[res_pos[order]] += x − x̂``."""
    _index(order, None, "order", "quantize_sent_")
    x = values.index_select(0, order.to(torch.int64))
    codes, scales, deq = quantize_blocks(x, seg_ends, bits, block)
    if residual is not None:
        _fp32(residual, "residual", "quantize_sent_")
        _index(res_pos, values.numel(), "res_pos", "quantize_sent_")
        idx = res_pos.to(torch.int64).index_select(0, order.to(torch.int64))
        residual.index_add_(0, idx, x.to(torch.float32) - deq)
    return codes, scales, deq


def dequantize_add_blocks_(acc: torch.Tensor, touched: torch.Tensor, pos: torch.Tensor, codes: torch.Tensor,
                           scales: torch.Tensor, seg_ends: list[int], bits: int, block: int) -> None:
    """``acc[pos[i]] += dequantize_blocks(...)[i]`` in the order of ``i``, ``touched[pos] = True``."""
    K = int(seg_ends[-1]) if len(seg_ends) else 0
    _fp32(acc, "acc", "dequantize_add_blocks_")
    if touched.dim() != 1 or touched.dtype != torch.bool or touched.numel() != acc.numel():
        raise RuntimeError(f"dequantize_add_blocks_: touched must be a 1-D bool tensor of {acc.numel()} elements")
    _index(pos, K, "pos", "dequantize_add_blocks_")
    vals = dequantize_blocks(codes, scales, seg_ends, bits, block)
    if K:
        p = pos.to(torch.int64)
        acc.index_add_(0, p, vals)
        touched.index_fill_(0, p, True)


def applied(deq: torch.Tensor, dtype: torch.dtype, divisor: int) -> torch.Tensor:
    """An owner's dequantized sum as every rank applies it, back in sum units (fp32): ``deq / divisor`` cast
    to the gradient's dtype, times ``divisor``, so the owner residual also keeps the cast's rounding."""
    if divisor == 1:
        return deq if dtype == torch.float32 else deq.to(dtype).to(torch.float32)
    return (deq / divisor).to(dtype).to(torch.float32) * divisor


def quantize_owned_(acc: torch.Tensor, pos: torch.Tensor, residual: torch.Tensor | None, seg_ends: list[int],
                    bits: int, block: int, applied_dtype: torch.dtype, divisor: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``s = acc[pos] (+ residual[pos])``; ``residual[pos] = s − applied(x̂)`` where
    finite (the old value kept elsewhere). ``pos`` unique."""
    _fp32(acc, "acc", "quantize_owned_")
    _index(pos, None, "pos", "quantize_owned_")
    if divisor < 1:
        raise RuntimeError(f"quantize_owned_: divisor ({divisor}) must be >= 1")
    p = pos.to(torch.int64)
    S = acc.index_select(0, p)
    if residual is not None:
        _fp32(residual, "residual", "quantize_owned_")
        if residual.numel() != acc.numel():
            raise RuntimeError(f"quantize_owned_: residual must have acc's {acc.numel()} elements")
        S = S + residual.index_select(0, p)
    codes, scales, deq = quantize_blocks(S, seg_ends, bits, block)
    if residual is not None:
        new = S - applied(deq, applied_dtype, divisor)
        residual.index_copy_(0, p, torch.where(torch.isfinite(new), new, residual.index_select(0, p)))
    return codes, scales


def decode_pulls_lowbit_(out: torch.Tensor, msgs: list[torch.Tensor], keys_R: torch.Tensor, idx_bytes: int,
                         bits: int, block: int, divisor: int, *, permute=None, dequantize=None) -> None:
    """Every owner's low-bit pull message written into ``out`` (1-D, ``numel``; zeroed by the caller).

    ``msgs[i]`` is owner ``i``'s message of ``n = len(msgs)``: ``[format, count | index part | scales |
    codes]`` (``core/lowbit.py``; index part as ``decode_pull_``'s: COO positions, hash bitmap, or none when
    dense, then ``count`` is the partition's size). Its values ``q · scale / divisor`` (fp32), cast to
    ``out``'s dtype, land at the global indices ``P⁻¹(p·n + i)`` of its positions ``p`` in ascending order
    (value j at the j-th smallest: the owner quantized its sums in that order). One host read of the headers.
    ``permute`` / ``dequantize``: the pure-torch ones by default (the oracle); ``ops`` passes its
    dispatching ones where the fused op has no kernel (CUDA), so the pieces run as kernels there.
    """
    from . import _reference as R

    permute = permute or R.permute
    dequantize = dequantize or dequantize_blocks
    n, numel = len(msgs), out.shape[0]
    present = [i for i, m in enumerate(msgs) if m.numel()]
    if not present:
        return
    heads = torch.stack([R._bytes_as(msgs[i], 0, 2, torch.int64) for i in present]).tolist()
    idx, codes, scales, ends = [], [], [], [0]
    for i, (f, k) in zip(present, heads):
        msg, m_i, at = msgs[i], R.part_size(numel, i, n), R.HEADER_BYTES
        if f == R.FMT_BITMAP:
            nw = R.num_words(m_i)
            p = torch.nonzero_static(R.words_to_mask(R._bytes_as(msg, at, nw, torch.int64), m_i), size=k).flatten()
            at += 8 * nw
        elif f == R.FMT_COO:
            p = R._bytes_as(msg, at, k, torch.int32 if idx_bytes == 4 else torch.int64).to(torch.int64)
            at += k * idx_bytes
        elif f == R.FMT_DENSE and k == m_i:
            p = torch.arange(m_i, device=out.device)
        else:
            raise ValueError(f"decode_pulls_lowbit_: bad format {f} with count {k} of a partition of {m_i}")
        nb = (k + block - 1) // block
        nc = (k * bits + 7) // 8
        sb = SCALE_DTYPE[bits].itemsize
        if msg.numel() != at + sb * nb + nc:
            raise ValueError(f"decode_pulls_lowbit_: message {i} of {msg.numel()} bytes does not match format {f} "
                             f"with count {k}")
        idx.append(permute(p * n + i, numel, keys_R, inverse=True).sort().values)  # values follow ascending indices
        scales.append(R._bytes_as(msg, at, nb, SCALE_DTYPE[bits]).to(torch.float32))
        codes.append(msg[at + sb * nb:])
        ends.append(ends[-1] + k)
    vals = dequantize(torch.cat(codes), torch.cat(scales), ends[1:], bits, block)
    if divisor != 1:
        vals = vals / divisor
    out.index_copy_(0, torch.cat(idx), vals.to(out.dtype))
