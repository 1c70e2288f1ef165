"""DGC's 4-bit residual (``zen.dgc.residual_dtype: "int4"``): error feedback kept as MicroAdam keeps it.

Per tensor, the residual ``e`` is cut into blocks of ``INT4_BLOCK`` (256) consecutive elements; a block
keeps its min ``δ`` and max ``Δ`` (fp32) and 4-bit codes ``q = round((x − δ)·15/(Δ − δ))``, two a byte;
``Q⁻¹``: ``x ≈ δ + q·(Δ − δ)/15``, at most ``(Δ − δ)/30`` away. A step:

1. ``dgc_int4_select``: ``a = Q⁻¹(e) + v`` per element (``v``: the gradient, or the velocity ``U ← m·U + g``
   with momentum correction, updated in that pass), the candidates ``|a| ≥ t_low``; ``a`` is not stored.
   The threshold's samples dequantize ``e`` where they read it (``dgc_int4_gather``).
2. the threshold search among the candidates, as for the fp32 residual (``thresholds.py``).
3. ``dgc_int4_requantize_``: ``a`` again, the sent elements' error (0, or a half-precision cast's rounding)
   in their place, each block quantized anew, in place.

So no full-size fp32 buffer exists at any time: the compiled ops hold one block's values, the torch
reference one tensor's. The residual's own rounding is dropped (MicroAdam's ``e ← Q(a − TopK(a))``);
conservation (``sent + residual == accumulated``) then holds up to ``(Δ − δ)/30`` per element.

Why these choices: after the selection every unsent ``|a|`` lies below its unit's threshold, so a
block's range is about twice the threshold whatever its size: blocks of 256 lose little precision
against 64 and cut the scales to 1/32 byte per element (0.53 bytes per element in all, against 4 for
fp32). fp32 scales hold the block's exact min and max: no directed rounding, and a constant block
(zeros included) comes back exactly. Blocks never straddle two tensors, so the state stays keyed by
parameter name: ``residual_codes`` (uint8, ``ceil(n/256)·128`` bytes) and ``residual_scales`` (fp32,
``2·ceil(n/256)``). The momentum, where momentum correction keeps one, stays fp32 (it is the running
sum the residual is fed from; MicroAdam quantizes only the error feedback).

Checkpoints convert: a float residual met by an int4 run is quantized, a 4-bit one met by a float run
is dequantized (``convert_residuals``), once per parameter, with an info log.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ... import ops
from ...core.types import SparseGrad
from ...ops import _reference_dgc
from .thresholds import FREE_HOST_READ_DEVICES, sampled_thresholds

log = logging.getLogger("zen_ext.compress.dgc")

INT4_BLOCK = ops.INT4_BLOCK
CODES, SCALES = "residual_codes", "residual_scales"
INT4_WIRE = (torch.float32, torch.bfloat16, torch.float16)
"""Gradient dtypes the 4-bit residual serves (fp64 gradients keep an fp64 residual)."""


def int4_applies(residual_dtype: str, wire: torch.dtype) -> bool:
    """Whether a bucket of ``wire`` gradients keeps its residual in 4 bits."""
    return residual_dtype == "int4" and wire in INT4_WIRE


class Int4Layout:
    """The blocks of one bucket layout: per tensor ``ceil(n/B)`` blocks, the cumulative element and block
    ends on the device (the kernels' ``ends_T``, ``blocks_T``), and each tensor's code and scale sizes."""

    def __init__(self, numels: tuple[int, ...], device) -> None:
        nb = [-(-n // INT4_BLOCK) for n in numels]
        self.blocks = sum(nb)
        self.code_numels = tuple(b * INT4_BLOCK // 2 for b in nb)
        self.scale_numels = tuple(2 * b for b in nb)
        self.ends_T = torch.tensor(np.cumsum(numels), dtype=torch.int64, device=device)
        self.blocks_T = torch.tensor(np.cumsum(nb), dtype=torch.int64, device=device)


class Int4Memory:
    """One bucket's 4-bit residual as the threshold search reads it (``sampled_thresholds(int4=...)``)."""

    dtype = torch.float32
    """The dtype of the values ``a`` (and of the thresholds)."""

    def __init__(self, state, lay, device) -> None:
        if lay.int4 is None:
            lay.int4 = Int4Layout(lay.numels, device)
        self.q = lay.int4
        self.device = torch.device(device)
        self.codes, _ = state.flat(lay.names, self.q.code_numels, CODES, torch.uint8, device)
        self.scales, _ = state.flat(lay.names, self.q.scale_numels, SCALES, torch.float32, device)

    def gather(self, pos: torch.Tensor) -> torch.Tensor:
        """``Q⁻¹(e)`` at element positions ``pos``."""
        return ops.dgc_int4_gather(self.codes, self.scales, self.q.ends_T, self.q.blocks_T, pos)

    def select(self, U, g_T, momentum, update, thr_U, ends_U, ok, capacity):
        """``dgc_int4_select`` over this residual."""
        return ops.dgc_int4_select(self.codes, self.scales, U, g_T, momentum, update, self.q.ends_T, self.q.blocks_T,
                                   thr_U.to(torch.float32), ends_U, ok, capacity)


def compress_int4(sp, flats: list[torch.Tensor], lay, density: float, flush: int, tp_comm) -> SparseGrad | None:
    """``DGCSparsifier.compress``'s steps 2-5 for a bucket with a 4-bit residual (``sp``: the sparsifier;
    ``density`` and ``flush``: this step's). Returns None where a gradient is not finite (nothing written:
    the caller sends the non-finite entries)."""
    cfg, state = sp.config, sp.state
    device, wire, total = flats[0].device, flats[0].dtype, lay.numel
    flats = [f if f.is_contiguous() else f.contiguous() for f in flats]  # the ops read one pointer per tensor
    convert_residuals(state, lay.names, lay.numels, to_int4=True)
    mem = Int4Memory(state, lay, device)
    U = state.flat(lay.names, lay.numels, "momentum", torch.float32, device)[0] if cfg.momentum_correction else None
    sp._snapshot(mem.codes, [(mem.codes, False), (mem.scales, True), (U, True)])
    finite = ops.dgc_all_finite(flats)
    tiny = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps  # zeros never travel
    if density >= 1.0:  # dense_steps: every non-zero entry travels
        thr_U = torch.full((lay.units,), tiny, dtype=torch.float32, device=device)
        cap = -1 if device.type in FREE_HOST_READ_DEVICES else total
        pos_K, v_K, _, count = mem.select(U, flats, cfg.momentum, True, thr_U, lay.unit_ends_N, finite, cap)
        ok, n = torch.cat([finite.reshape(1).to(torch.int64), count]).tolist()  # one host read
        if not ok:
            return None
        pos_K, v_K = pos_K[:n], v_K[:n]
    else:
        got = sampled_thresholds(None, lay, density, tp_comm, tiny, cfg, state.step, pending=(U, flats, finite),
                                 int4=mem)
        if got is None:
            return None
        thr_U, pos_K, v_K = got
    state.set_per_unit(list(lay.names), "threshold", thr_U, lay.unit_of_T)
    pos, sent = pos_K, _to_wire(v_K, wire)
    phase = 0
    if flush:
        # The rotating flush (``_finish``'s rule): a position the top-k sent sends 0 here, the others their
        # value; read before the codes change. Membership is the selection's own compare, no bool bucket.
        phase = state.step % flush
        pos_F = lay.flush_positions(state.step, flush, device)
        a_F = mem.gather(pos_F) + (U.index_select(0, pos_F) if U is not None else ops.gather_list(flats, pos_F))
        t_F = thr_U.index_select(0, torch.searchsorted(lay.unit_ends_N, pos_F, right=True))
        in_K = (a_F >= t_F) | (a_F <= -t_F)
        sent_F = _to_wire(a_F, wire).masked_fill(in_K, 0)
        pos, sent = torch.cat([pos_K, pos_F]), torch.cat([sent, sent_F])
    seed = state.step % (1 << 31) if cfg.int4_rounding == "stochastic" else -1
    ops.dgc_int4_requantize_(mem.codes, mem.scales, U, flats, mem.q.ends_T, mem.q.blocks_T, thr_U, lay.unit_ends_N,
                             flush, phase, seed)
    if U is not None and cfg.momentum_masking:  # after the requantize, which reads this step's velocity
        U.index_fill_(0, pos, 0)
    return SparseGrad(pos, sent, total)


def _to_wire(v: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """``v`` as sent: clamped to ``wire``'s finite range and cast (the kernel keeps ``v`` minus this)."""
    if wire == torch.float32:
        return v
    top = torch.finfo(wire).max
    return v.clamp(-top, top).to(wire)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's residual (any float dtype) as ``(codes, scales)``, on its device."""
    e = values.detach().reshape(-1).to(torch.float32)
    nb = -(-e.numel() // INT4_BLOCK)
    codes = torch.zeros(nb * INT4_BLOCK // 2, dtype=torch.uint8, device=e.device)
    scales = torch.zeros(2 * nb, dtype=torch.float32, device=e.device)
    _reference_dgc.int4_quantize_into(codes, scales, 0, e)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """``quantize``'s inverse: the tensor's ``numel`` fp32 values."""
    return _reference_dgc.int4_dequantize(codes, scales, 0, scales.numel() // 2, numel).clone()


def convert_residuals(state, names, numels, to_int4: bool) -> None:
    """Bring restored residuals into this run's form: a float ``residual`` quantized (``to_int4``), or
    4-bit codes and scales dequantized; an entry already in this form, or of another size (which
    restarts from zeros with ``SparsifierState.tensor``'s warning), is left alone. Dictionary look-ups
    only once converted."""
    for name, n in zip(names, numels):
        entry = state.params.get(name)
        if not entry:
            continue
        if to_int4 and "residual" in entry and CODES not in entry and entry["residual"].numel() == n:
            entry[CODES], entry[SCALES] = quantize(entry.pop("residual"))
            log.info("zen: DGC residual %r converted from a float checkpoint to 4 bits", name)
        elif (not to_int4 and CODES in entry and "residual" not in entry
              and entry.get(SCALES) is not None and entry[SCALES].numel() == 2 * math.ceil(n / INT4_BLOCK)
              and entry[CODES].numel() == entry[SCALES].numel() * INT4_BLOCK // 4):
            entry["residual"] = dequantize(entry.pop(CODES), entry.pop(SCALES), n)
            log.info("zen: DGC residual %r converted from a 4-bit checkpoint to float", name)


def int4_add_at(state, lay, pos: torch.Tensor, err: torch.Tensor) -> None:
    """Add ``err`` (fp32) to the 4-bit residual at the bucket's element positions ``pos`` (unique, or
    duplicates whose errors add): ``zen.dgc.value_bits``' sender feedback on a 4-bit residual. Only the
    blocks ``pos`` touches change: each is dequantized, added to and quantized anew between its new min
    and max, rounded to nearest (as ``dgc_int4_requantize_`` without stochastic rounding). A constant
    number of torch ops per bucket; the padding past a tensor's last element repeats a real value, so it
    moves no block's min or max, and its codes stay 0."""
    if not pos.numel():
        return
    device = pos.device
    mem = Int4Memory(state, lay, device)
    q = mem.q
    B, half = INT4_BLOCK, INT4_BLOCK // 2
    # Per touched block: its tensor, its first element and the tensor's end.
    start_T = torch.cat([q.ends_T.new_zeros(1), q.ends_T[:-1]])
    bstart_T = torch.cat([q.blocks_T.new_zeros(1), q.blocks_T[:-1]])
    t_K = torch.searchsorted(q.ends_T, pos, right=True)
    blk_K = bstart_T[t_K] + (pos - start_T[t_K]) // B
    blocks, slot_K = torch.unique(blk_K, return_inverse=True)
    t_B = torch.searchsorted(q.blocks_T, blocks, right=True)
    first_B = start_T[t_B] + (blocks - bstart_T[t_B]) * B
    elem = first_B[:, None] + torch.arange(B, device=device)
    valid = elem < q.ends_T[t_B][:, None]
    # Dequantize the touched blocks, add the errors.
    c = mem.codes.view(-1, half).index_select(0, blocks)
    codes = torch.stack((c & 15, c >> 4), 2).view(-1, B).to(torch.float32)
    s = mem.scales.view(-1, 2).index_select(0, blocks)
    lo, hi = s[:, :1], s[:, 1:]
    x = lo + codes * _reference_dgc._step(lo, hi)
    x.view(-1).index_add_(0, slot_K * B + (pos - first_B[slot_K]), err.to(torch.float32))
    x = torch.where(valid, x, x[:, :1])
    # Quantize them anew (``_reference_dgc.int4_quantize_into``'s rule, round to nearest).
    nlo, nhi = x.amin(1), x.amax(1)
    sc = torch.where(nhi > nlo, torch.full_like(nlo, 15.0).div(nhi - nlo).clamp(max=torch.finfo(torch.float32).max),
                     torch.zeros_like(nlo))
    qn = torch.round((x - nlo[:, None]) * sc[:, None]).clamp(0, 15).to(torch.uint8)
    qn = torch.where(valid, qn, torch.zeros_like(qn))
    mem.codes.view(-1, half).index_copy_(0, blocks, qn[:, 0::2] | (qn[:, 1::2] << 4))
    mem.scales.view(-1, 2).index_copy_(0, blocks, torch.stack((nlo, nhi), 1))
