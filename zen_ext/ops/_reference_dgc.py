"""Pure-torch reference of DGC's ops (``zen_ext::dgc_*``): what ``zen_ext.ops`` runs where a device has no
kernel (a build without the C++ op, CUDA tensors with a CPU-only build), and the oracle the kernels must
equal bit for bit (tests/ops/test_dgc_reference.py). The algorithms are DGC's sampled threshold search
(``zen_ext.compress.dgc.thresholds`` drives it): sampling, the one-pass velocity update with candidate
selection, the refinement passes among the candidates, and the compaction of what they keep.

Every function mirrors the kernel's IEEE operations (two roundings for ``u·m + g``, never a fused
multiply-add; thresholds as values of the memory's dtype), so a bucket selects the same entries on
either path.

Legend: ``_S`` samples, ``_C`` candidates, ``_U`` selection units (or runs), ``_T`` tensors.
"""

from __future__ import annotations

import torch

REFINE_BAND = (0.8, 1.25)
"""A count within ``[0.8·k, 1.25·k]`` is accepted; outside it the threshold moves (``_Search``;
csrc/dgc_search.h's ``kBandLo``/``kBandHi``)."""
_MEMORY_DTYPES = (torch.float32, torch.float64)


def check_accumulate_dtypes(R: torch.Tensor, g_T: list[torch.Tensor], op: str) -> None:
    """csrc/dgc_dtypes.h's rule: memory of fp32 or fp64; gradients of its dtype, or bf16/fp16 with fp32."""
    if R.dtype not in _MEMORY_DTYPES:
        raise RuntimeError(f"{op}: memory of {R.dtype} (supported: float32, float64)")
    if not g_T:
        raise RuntimeError(f"{op}: needs at least one gradient")
    gdt = g_T[0].dtype
    if any(g.dtype != gdt for g in g_T):
        raise RuntimeError(f"{op}: every gradient must be of {gdt}")
    if gdt != R.dtype and not (R.dtype == torch.float32 and gdt in (torch.bfloat16, torch.float16)):
        raise RuntimeError(f"{op}: gradients of {gdt} with memory of {R.dtype} (supported: the memory's dtype, "
                           "or bf16/fp16 with fp32 memory)")
    if sum(g.numel() for g in g_T) != R.numel():
        raise RuntimeError(f"{op}: the gradients hold {sum(g.numel() for g in g_T)} elements, R {R.numel()}")


def _concat(g_T: list[torch.Tensor]) -> torch.Tensor:
    """The concatenation of the 1-D tensors ``g_T``: one op whatever their number."""
    return g_T[0] if len(g_T) == 1 else torch.cat(g_T)


def dgc_accumulate_select_(R, U, g_T, momentum, thr_U, ends_U, ok=None, capacity=-1):
    """``zen_ext::dgc_accumulate_select_`` in torch ops: the velocity update (``U = U·m + g; R += U``, or
    ``R += g``; nothing where ``ok`` is false), then the candidates ``|R| ≥ thr`` of each run (runs end
    at ``ends_U``) as ``(positions, R's values, runs, count [1])``; with ``capacity ≥ 0`` padded or cut
    to that many (position ``numel``, value 0, run ``len(ends_U)``), ``count`` every candidate's."""
    check_accumulate_dtypes(R, g_T, "dgc_accumulate_select_")
    if capacity < -1:
        raise RuntimeError(f"dgc_accumulate_select_: capacity ({capacity}) must be >= 0, or -1 for all")
    n, runs = R.numel(), ends_U.numel()
    long = dict(dtype=torch.int64, device=R.device)
    # Step 1: the update, unless the flag says a gradient is not finite (then nothing is written).
    if ok is None or bool(ok.reshape(-1)[0]):
        g = _concat(g_T)
        if U is not None:
            U.mul_(momentum).add_(g)  # two roundings, as the kernels
            R.add_(U)
        else:
            R.add_(g)
        # Step 2: the candidates, with each run's threshold (two compares, as the kernels: NaN never).
        sizes_U = torch.diff(ends_U, prepend=ends_U.new_zeros(1))
        t = thr_U.to(R.dtype).repeat_interleave(sizes_U, output_size=n)
        pos = ((R >= t) | (R <= -t)).nonzero().flatten()
    else:
        pos = torch.zeros(0, **long)
    val = R.index_select(0, pos)
    run = torch.searchsorted(ends_U, pos, right=True)
    count = torch.full((1,), pos.numel(), **long)
    if capacity < 0:
        return pos, val, run, count
    # Step 3: a buffer of the capacity: the first candidates, then padding past every run.
    k = min(capacity, pos.numel())
    pos_P = torch.full((capacity,), n, **long)
    run_P = torch.full((capacity,), runs, **long)
    val_P = R.new_zeros(capacity)
    pos_P[:k], val_P[:k], run_P[:k] = pos[:k], val[:k], run[:k]
    return pos_P, val_P, run_P, count


def dgc_sample_keys(R, U, g_T, momentum, grid_S, unit_S, hash_U, stride_U, shift):
    """``zen_ext::dgc_sample_keys`` in torch ops: sample ``s`` of unit ``u = unit_S[s]`` at
    ``grid_S[s] + (hash_U[u] + shift) mod stride_U[u]``, its value ``|R + U·m + g|`` (NaN as 0, inf as the
    largest float), as the key ``u·2³² + (2³¹ − 1 − bits(value))``."""
    if R.dtype != torch.float32 or R.dim() != 1:
        raise RuntimeError(f"dgc_sample_keys: R must be a contiguous 1-D float32 tensor, got {R.dtype} of shape "
                           f"{tuple(R.shape)}")
    check_accumulate_dtypes(R, g_T, "dgc_sample_keys")
    if shift < 0:
        raise RuntimeError(f"dgc_sample_keys: shift ({shift}) must be >= 0")
    # Step 1: the positions, the pending update's value there, its magnitude.
    pos_S = grid_S + (hash_U + shift).remainder(stride_U).index_select(0, unit_S)
    g_S = _concat(g_T).index_select(0, pos_S)
    delta = g_S if U is None else U.index_select(0, pos_S) * momentum + g_S
    v_S = torch.nan_to_num((R.index_select(0, pos_S) + delta).abs(), nan=0.0)
    # Step 2: the key, whose ascending order is by unit, then by value descending.
    return (unit_S.to(torch.int64) << 32) | (0x7FFFFFFF - v_S.view(torch.int32)).to(torch.int64)


def dgc_sort_unkey(keys, low_U, tiny, key_bits):
    """``zen_ext::dgc_sort_unkey`` in torch ops: the keys sorted ascending, as their float32 values, and
    ``max(value at low_U[u], tiny)`` per unit."""
    if not 1 <= key_bits <= 64:
        raise RuntimeError(f"dgc_sort_unkey: key_bits ({key_bits}) must be in [1, 64]")
    # Equal keys are equal values: stability changes nothing (stable takes torch's radix sort on the CPU).
    k = keys.sort(stable=True).values
    vals = (0x7FFFFFFF - (k & 0xFFFFFFFF)).to(torch.int32).view(torch.float32)
    return vals, vals.index_select(0, low_U).clamp(min=tiny)


def at_rank(sorted_S: torch.Tensor, start_U: torch.Tensor, ns_U: torch.Tensor, rank_U: torch.Tensor) -> torch.Tensor:
    """The sample at 1-based (fractional) rank ``rank_U`` of each unit's descending sort (csrc/dgc_search.h's
    ``at_rank``)."""
    return sorted_S[(rank_U.ceil() - 1).clamp(min=0).minimum(ns_U - 1).long() + start_U]


class _Search:
    """Per-unit thresholds whose counts lie in ``REFINE_BAND·k``, on device tensors ``[U]`` only.

    The first probe is each unit's sample density quantile. While only one side of the target is
    known, the next probe moves the sample rank by ``k / count`` (exact if the sample were perfectly
    representative). Once one probe counted too many and another too few, the next one interpolates
    between the closest two in (threshold, log count), which a lumpy sample cannot make oscillate.
    A probe inside the band is kept. Every unit moves at once (no host branch, no loop over units).
    """

    def __init__(self, sorted_S, start_U, ns_U, k_U, first_U) -> None:
        self.sorted_S, self.start_U, self.ns_U, self.k_U = sorted_S, start_U, ns_U, k_U
        self.rank = first_U
        self.thr = at_rank(sorted_S, start_U, ns_U, first_U)
        self.done = torch.zeros(ns_U.shape[0], dtype=torch.bool, device=sorted_S.device)
        # Closest probe with too many selected (highest such threshold) and with too few (lowest).
        zero = torch.zeros_like(self.rank)
        self.has_over, self.t_over, self.c_over = self.done.clone(), zero, zero
        self.has_under, self.t_under, self.c_under = self.done.clone(), zero, zero

    def update(self, count_U: torch.Tensor) -> None:
        """Record the counts at ``self.thr`` and move ``self.thr`` to the next probes."""
        lo, hi = REFINE_BAND
        k, c, t = self.k_U, count_U.to(torch.float64), self.thr.to(torch.float64)
        self.done = self.done | ((c >= lo * k) & (c <= hi * k))
        over = (c > hi * k) & (~self.has_over | (t > self.t_over))
        under = (c < lo * k) & (~self.has_under | (t < self.t_under))
        self.t_over, self.c_over = torch.where(over, t, self.t_over), torch.where(over, c, self.c_over)
        self.t_under, self.c_under = torch.where(under, t, self.t_under), torch.where(under, c, self.c_under)
        self.has_over, self.has_under = self.has_over | over, self.has_under | under
        # Next probe: rank step on the sample, or interpolation once the target is bracketed.
        rank = (self.rank * k / c.clamp(min=1)).clamp(min=1).minimum(self.ns_U)
        t_rank = at_rank(self.sorted_S, self.start_U, self.ns_U, rank).to(torch.float64)
        log_over, log_under = self.c_over.clamp(min=0.5).log(), self.c_under.clamp(min=0.5).log()
        w = (log_over - k.log()) / (log_over - log_under).clamp(min=1e-12)
        t_interp = self.t_over + (self.t_under - self.t_over) * w
        t_next = torch.where(self.has_over & self.has_under, t_interp, t_rank)
        self.rank = torch.where(self.done, self.rank, rank)
        # A probe is a value of the memory's dtype and no finer than float32: in float64 it would carry
        # the last-bit differences of log() between devices (csrc/dgc_search.h rounds the same way).
        if self.thr.dtype == torch.float64:
            t_next = t_next.to(torch.float32)
        self.thr = torch.where(self.done, self.thr, t_next.to(self.thr.dtype))


def dgc_threshold_search(sorted_S, start_U, ns_U, k_U, first_U, v_C, unit_C, t_low_U, passes, *, all_reduce=None,
                         early_stop=False):
    """``zen_ext::dgc_threshold_search`` in torch ops: ``(thr_U, keep_C)`` after ``passes`` refinements.

    ``all_reduce`` (optional) sums each pass's int64 counts in place over a group (tensor parallelism:
    every rank then moves alike; the kernel cannot call out between passes). ``early_stop``: stop once
    every unit is in the band (one host read per pass, so only where reading costs nothing; the kernel
    stops per unit, and a unit in the band keeps its probe, so the results are the same)."""
    units, device = start_U.numel(), v_C.device
    if units == 0:
        return v_C.new_empty(0), torch.zeros(v_C.shape, dtype=torch.bool, device=device)
    search = _Search(sorted_S, start_U, ns_U, k_U, first_U)
    abs_C = v_C.abs()
    # Padding of a capacity-sized candidate buffer has unit U (past every unit): the running-sum counts
    # end before it, and it is never kept.
    unit_clamped = unit_C.clamp(max=units - 1)
    # The candidates are in position order, so each unit's are one run: a count per unit is the
    # difference of a running sum at the runs' ends (no atomics; an index_add into U counters
    # serialized on the GPU: 54 % of a bucket's GPU time on an H200).
    cut_U1 = torch.searchsorted(unit_C, torch.arange(units + 1, dtype=unit_C.dtype, device=device))
    for _ in range(passes):
        thr_U = torch.maximum(search.thr, t_low_U)
        run_C1 = torch.nn.functional.pad((abs_C >= thr_U.index_select(0, unit_clamped)).cumsum(0), (1, 0))
        counts_U = run_C1.index_select(0, cut_U1[1:]) - run_C1.index_select(0, cut_U1[:-1])
        if all_reduce is not None:
            all_reduce(counts_U)
        search.update(counts_U)
        if early_stop and bool(search.done.all()):
            break
    thr_U = torch.maximum(search.thr, t_low_U)
    return thr_U, (abs_C >= thr_U.index_select(0, unit_clamped)) & (unit_C < units)


def dgc_gather_kept(keep_C, pos_C, v_C, ok, count_C):
    """``zen_ext::dgc_gather_kept`` in torch ops: the kept candidates first (in order), zeros after, and
    ``[ok (1 when absent), count_C[0], kept]``."""
    keep = keep_C.nonzero().flatten()
    n = keep.numel()
    pos_K, v_K = torch.zeros_like(pos_C), torch.zeros_like(v_C)
    pos_K[:n] = pos_C.index_select(0, keep)
    v_K[:n] = v_C.index_select(0, keep)
    flag = ok.reshape(1).to(torch.int64) if ok is not None else torch.ones(1, dtype=torch.int64, device=pos_C.device)
    kept = torch.full((1,), n, dtype=torch.int64, device=pos_C.device)
    return pos_K, v_K, torch.cat([flag, count_C.reshape(-1)[:1].to(torch.int64), kept])


def dgc_all_finite(g_T):
    """``zen_ext::dgc_all_finite`` in torch ops: whether every element of the tensors is finite (one
    concatenation: a norm would overflow on huge finite values, and an op per tensor grows with them)."""
    return torch.isfinite(_concat(g_T)).all()


# --- DGC's 4-bit residual (zen.dgc.residual_dtype "int4"; zen_ext/compress/dgc/int4.py drives it) -------------
INT4_BLOCK = 256
"""Elements per quantization block: two fp32 scales (min, max) per 256 elements are 1/32 byte per element,
so codes and scales hold 0.53 bytes per element (csrc/dgc_int4.h's ``kBlock``)."""
_INT4_WIRE = (torch.float32, torch.bfloat16, torch.float16)
_FLT_MAX = torch.finfo(torch.float32).max


def check_int4(codes, scales, g_T, ends_T, blocks_T, op: str) -> None:
    """csrc/dgc_int4.h's rule: uint8 codes of ``B/2`` bytes a block and fp32 ``[min, max]`` scales per block;
    one contiguous gradient (fp32, bf16 or fp16, one dtype) per tensor, tensor ``t`` ending at element
    ``ends_T[t]`` and block ``blocks_T[t]`` (cumulative, ``ceil(numel / B)`` blocks each)."""
    if codes.dtype != torch.uint8 or codes.dim() != 1 or scales.dtype != torch.float32 or scales.dim() != 1:
        raise RuntimeError(f"{op}: codes must be 1-D uint8 and scales 1-D float32, got {codes.dtype} and {scales.dtype}")
    if not g_T or len(g_T) != ends_T.numel() or len(g_T) != blocks_T.numel():
        raise RuntimeError(f"{op}: one gradient per tensor of ends_T/blocks_T ({ends_T.numel()}), got {len(g_T)}")
    if g_T[0].dtype not in _INT4_WIRE or any(g.dtype != g_T[0].dtype for g in g_T):
        raise RuntimeError(f"{op}: gradients of one dtype of {list(_INT4_WIRE)}, got {[g.dtype for g in g_T]}")
    numel_T = torch.tensor([g.numel() for g in g_T], dtype=torch.int64)
    nb_T = (numel_T + INT4_BLOCK - 1) // INT4_BLOCK
    if not (torch.equal(numel_T.cumsum(0), ends_T.cpu()) and torch.equal(nb_T.cumsum(0), blocks_T.cpu())):
        raise RuntimeError(f"{op}: ends_T/blocks_T do not match the gradients' sizes")
    nb = int(nb_T.sum())
    if codes.numel() != nb * INT4_BLOCK // 2 or scales.numel() != 2 * nb:
        raise RuntimeError(f"{op}: {nb} blocks need {nb * INT4_BLOCK // 2} code bytes and {2 * nb} scales, got "
                           f"{codes.numel()} and {scales.numel()}")


def _int4_tensors(g_T):
    """Per tensor: (its first element, its first block, numel, blocks)."""
    at = blk = 0
    for g in g_T:
        n = g.numel()
        nb = -(-n // INT4_BLOCK)
        yield at, blk, n, nb
        at, blk = at + n, blk + nb


def _step(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``(max − min)/15`` divided, not multiplied by a rounded 1/15 (as torch's CUDA division by a Python
    number would): a tensor divisor keeps the IEEE division of the kernels on every device."""
    return (hi - lo) / lo.new_full((1,), 15.0)


def int4_dequantize(codes, scales, b0: int, nb: int, n: int) -> torch.Tensor:
    """The ``n`` values of blocks ``[b0, b0 + nb)``: ``min + q·((max − min)/15)`` in fp32, the product and
    the sum rounded apart (csrc/dgc_int4.h's ``dequant``)."""
    half = INT4_BLOCK // 2
    c = codes[b0 * half:(b0 + nb) * half].view(nb, half)
    q = torch.stack((c & 15, c >> 4), 2).view(nb, INT4_BLOCK).to(torch.float32)  # low nibble first
    s = scales[2 * b0:2 * (b0 + nb)].view(nb, 2)
    lo, hi = s[:, :1], s[:, 1:]
    return (lo + q * _step(lo, hi)).view(-1)[:n]


_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """csrc/dgc_int4.h's ``mix32`` on int64 tensors holding uint32 values (products stay below 2^59)."""
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _M32
    return h ^ (h >> 16)


def int4_uniform(i: torch.Tensor, seed: int) -> torch.Tensor:
    """csrc/dgc_int4.h's ``uniform_of``: stochastic rounding's draw in [0, 1) for int64 elements ``i``."""
    s = _mix32((i >> 32) ^ (seed & _M32))
    return (_mix32((i & _M32) ^ s) >> 8).to(torch.float32) * (1.0 / 16777216.0)


def int4_quantize_into(codes, scales, b0: int, e: torch.Tensor, seed: int = -1, first: int = 0) -> None:
    """Write the fp32 values ``e`` (one tensor, ``ceil(n/B)`` blocks from ``b0``) as codes and scales:
    per block ``min``, ``max`` and ``q = round((x − min)·s)`` with ``s = min(15/(max − min), FLT_MAX)``
    (0 where ``max == min``), round half to even (``seed < 0``) or ``floor((x − min)·s + u)`` with ``u``
    the draw of element ``first + j`` under ``seed`` (stochastic rounding), clamped to [0, 15]; codes
    past ``n`` are 0."""
    n = e.numel()
    if n == 0:
        return
    nb = -(-n // INT4_BLOCK)
    pad = nb * INT4_BLOCK - n
    # The last value repeated: the padding changes no block's min or max.
    ep = (torch.cat([e, e[-1:].expand(pad)]) if pad else e).view(nb, INT4_BLOCK)
    lo, hi = ep.amin(1), ep.amax(1)
    s = torch.where(hi > lo, torch.full_like(lo, 15.0).div(hi - lo).clamp(max=_FLT_MAX), torch.zeros_like(lo))
    t = (ep - lo[:, None]) * s[:, None]
    if seed < 0:
        t = torch.round(t)
    else:
        idx = torch.arange(first, first + nb * INT4_BLOCK, dtype=torch.int64, device=e.device)
        t = torch.floor(t + int4_uniform(idx, seed).view(nb, INT4_BLOCK))
    q = t.clamp(0, 15).to(torch.uint8)
    if pad:
        q.view(-1)[n:] = 0
    half = INT4_BLOCK // 2
    codes[b0 * half:(b0 + nb) * half] = (q[:, 0::2] | (q[:, 1::2] << 4)).view(-1)
    scales[2 * b0:2 * (b0 + nb)] = torch.stack((lo, hi), 1).view(-1)


def _velocity(U, g, at: int, n: int, momentum: float, update: bool) -> torch.Tensor:
    """What the step adds to the residual: ``U ← U·m + g`` then ``U`` (``update``), ``U`` as it is, or ``g``."""
    if U is None:
        return g
    u = U[at:at + n]
    if update:
        u.mul_(momentum).add_(g)  # two roundings, as the kernels
    return u


def dgc_int4_select(codes, scales, U, g_T, momentum, update, ends_T, blocks_T, thr_U, ends_U, ok=None, capacity=-1):
    """``zen_ext::dgc_int4_select`` in torch ops: per element ``a = Q⁻¹(e) + v`` (``v``: ``_velocity``; ``U``
    written only where ``ok`` is true or absent), nothing stored but ``U``; returns the candidates
    ``|a| ≥ thr`` of each run (runs end at ``ends_U``) as ``dgc_accumulate_select_`` does, ``a``'s values
    as theirs. One tensor's fp32 values at a time (the kernels: one block's)."""
    check_int4(codes, scales, g_T, ends_T, blocks_T, "dgc_int4_select")
    if capacity < -1:
        raise RuntimeError(f"dgc_int4_select: capacity ({capacity}) must be >= 0, or -1 for all")
    long = dict(dtype=torch.int64, device=codes.device)
    pos_P, val_P = [torch.zeros(0, **long)], [torch.zeros(0, dtype=torch.float32, device=codes.device)]
    if ok is None or bool(ok.reshape(-1)[0]):
        for (at, b0, n, nb), g in zip(_int4_tensors(g_T), g_T):
            a = int4_dequantize(codes, scales, b0, nb, n) + _velocity(U, g, at, n, momentum, update)
            run = torch.searchsorted(ends_U, torch.arange(at, at + n, **long), right=True)
            t = thr_U.to(torch.float32).index_select(0, run)
            hit = ((a >= t) | (a <= -t)).nonzero().flatten()
            pos_P.append(hit + at)
            val_P.append(a.index_select(0, hit))
    pos, val = torch.cat(pos_P), torch.cat(val_P)
    run = torch.searchsorted(ends_U, pos, right=True)
    count = torch.full((1,), pos.numel(), **long)
    if capacity < 0:
        return pos, val, run, count
    k = min(capacity, pos.numel())
    out_p = torch.full((capacity,), int(ends_T[-1]), **long)
    out_r = torch.full((capacity,), ends_U.numel(), **long)
    out_v = torch.zeros(capacity, dtype=torch.float32, device=codes.device)
    out_p[:k], out_v[:k], out_r[:k] = pos[:k], val[:k], run[:k]
    return out_p, out_v, out_r, count


def dgc_int4_requantize_(codes, scales, U, g_T, ends_T, blocks_T, thr_U, ends_U, flush_stride, flush_phase, seed=-1):
    """``zen_ext::dgc_int4_requantize_`` in torch ops: the error feedback of a step, quantized. Per element
    ``a = Q⁻¹(e) + (U or g)`` (``U`` already this step's velocity); sent are ``|a| ≥ thr`` of its run and,
    with ``flush_stride > 0``, the tensor's elements ``j ≡ flush_phase (mod flush_stride)``; a sent element
    keeps ``a − wire(clamp(a))`` (the cast's rounding error; 0 for fp32 gradients), the rest ``a``; the
    result is quantized in place (``int4_quantize_into``; ``seed ≥ 0``: stochastic rounding)."""
    check_int4(codes, scales, g_T, ends_T, blocks_T, "dgc_int4_requantize_")
    wire = g_T[0].dtype
    top = torch.finfo(wire).max
    long = dict(dtype=torch.int64, device=codes.device)
    for (at, b0, n, nb), g in zip(_int4_tensors(g_T), g_T):
        if n == 0:
            continue
        a = int4_dequantize(codes, scales, b0, nb, n) + (U[at:at + n] if U is not None else g)
        j = torch.arange(n, **long)
        t = thr_U.to(torch.float32).index_select(0, torch.searchsorted(ends_U, j + at, right=True))
        sent = (a >= t) | (a <= -t)
        if flush_stride > 0:
            sent |= j.remainder(flush_stride) == flush_phase
        e = torch.where(sent, a - a.clamp(-top, top).to(wire).to(torch.float32), a)
        int4_quantize_into(codes, scales, b0, e, seed, at)


def dgc_int4_gather(codes, scales, ends_T, blocks_T, pos):
    """The residual ``Q⁻¹(e)`` at int64 element positions ``pos`` (torch ops: the samples of the threshold
    search and the flushed elements; csrc/dgc_int4.h's ``dequant`` at each)."""
    t = torch.searchsorted(ends_T, pos, right=True)
    first_T = ends_T - torch.diff(ends_T, prepend=ends_T.new_zeros(1))
    block0_T = blocks_T - torch.diff(blocks_T, prepend=blocks_T.new_zeros(1))
    pp = pos - first_T.index_select(0, t) + block0_T.index_select(0, t) * INT4_BLOCK  # position in padded blocks
    byte = codes.index_select(0, pp >> 1)
    q = torch.where((pp & 1).bool(), byte >> 4, byte & 15).to(torch.float32)
    b = pp // INT4_BLOCK
    lo, hi = scales.index_select(0, 2 * b), scales.index_select(0, 2 * b + 1)
    return lo + q * _step(lo, hi)
