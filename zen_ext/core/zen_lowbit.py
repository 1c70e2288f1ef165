"""ZEN's all-reduce with low-bit values (``zen.dgc.value_bits``): ``ZenScheme._sync_group`` runs the
gradients that carry ``SparseGrad.lowbit`` here. Design, formats and why: ``core/lowbit.py``.

Host reads per group: the partition counts (as ZEN without value_bits) and the owners' carried counts;
none per peer (positions come from ``nonzero_static`` with counts already read; the pull's headers are
read by ``ops.decode_pulls_lowbit_``, once for all owners where it has no kernel). Ops per gradient are
constant in the number of tensors; the push's payloads are views per peer (no kernel), and one op decodes
every pulled message.
"""

from __future__ import annotations

import itertools

import torch

from .. import ops
from ..comm.base import Communicator
from ..ops._reference import mask_to_words
from .lowbit import SCALE_BYTES, cheapest_format, push_count, read_scales, segment_layout, wire_scales
from .wire import pack, view_as
from .zen_count import CONTRIBUTORS, divide_by_senders_, sender_counts
from .zen_wire import FMT_BITMAP, FMT_COO, FMT_DENSE, FMT_NAMES, ZenCall


def sync_group_lowbit(scheme, comm: Communicator, calls: list[ZenCall], op: str, outs: list,
                      timings: list) -> list[torch.Tensor]:
    """Synchronize ``calls`` (element form, ``sg.lowbit`` set) with quantized push and pull.

    1. Partition by h0 (one host read of the group's partition counts).
    2. Gather and quantize each owner's segment, with DGC's sender error feedback, in one op
       (``_quantize_sent``); push ``[pos | scales | codes]`` to each owner.
    3. Owner: dequantize every contribution, sum in fp32 into its compact buffer and mark the touched
       positions, in one op (``ops.dequantize_add_blocks_``); one host read of the group's touched counts.
    4. Owner: the carried positions (touched ones, or all when dense is cheapest), plus the owner
       residual there, quantized, and the new owner residual (the sum minus what every rank will
       apply), in one op (``quantize_owned``); pull ``[format, count | index part | scales | codes]``.
    5. Every rank: one op writes every owner's message into the result (``ops.decode_pulls_lowbit_``:
       positions to indices, dequantize, mean's division before the cast, scatter; headers read by the op).
    With ``op="contributors"`` the owner divides each position's sum by its senders at the end of step 3
    (``core/zen_count.py``), so step 4 quantizes the averages.
    """
    n = comm.size
    if op == CONTRIBUTORS and any(c.sg.lowbit.owner_residual is not None for c in calls):
        raise ValueError("zen: op 'contributors' with low-bit values takes no owner residual (LowBitValues."
                         "owner_residual must be None): the residual of an average over a varying number of "
                         "senders has no meaning in the next step's sum")
    push_aggregate_lowbit(scheme, comm, calls, op)
    carried = torch.cat([c.count_1 for c in calls]).tolist()

    # Step 4: owner residual, quantize, pull.
    pulls = []
    for c, count in zip(calls, carried):
        c.timer.start("pull_s")
        lb = c.sg.lowbit
        fmt = cheapest_format(count, c.m, c.isz, lb.bits, scheme.pull_format, lb.block)
        if fmt == FMT_DENSE:
            pos_C = torch.arange(c.m, device=c.device)
        else:
            pos_C = torch.nonzero_static(c.touched, size=count).flatten()  # the count is read: no sync here
        # Quantized in ascending global-index order (the bucket's tensors one after another), not in hash order:
        # a block then mostly holds one tensor's sums, so a large tensor's scale does not code a small one's as 0
        # (benchmarks/comm/results/value_bits_zeros.md). Every rank derives the order from the positions.
        pos_C = pos_C[torch.argsort(c.part.indices_of(comm.rank, pos_C))]
        codes, scales = quantize_owned(c, pos_C, [pos_C.numel()], n if op == "mean" else 1)
        head = torch.tensor([fmt, pos_C.numel()], dtype=torch.int64, device=c.device)
        if fmt == FMT_BITMAP:
            index = mask_to_words(c.touched)
        elif fmt == FMT_COO:
            index = pos_C.to(c.idt)
        else:
            index = torch.empty(0, dtype=torch.uint8, device=c.device)
        msg = pack(head, index, wire_scales(scales, lb.bits), codes)
        del c.acc, c.touched
        pulls.append((c, fmt, comm.all_gather_v(msg)))
        c.timer.stop()

    # Step 5: every owner's message decoded into the result by one op (it reads the headers itself; the
    # oracle's one host read of them on devices without the kernel).
    results = []
    for (c, fmt, pulled), out, timing in zip(pulls, outs, timings):
        c.timer.start("decode_s")
        lb = c.sg.lowbit
        res = out if out is not None else torch.empty(c.sg.numel, dtype=c.dtype, device=c.device)
        ops.zero_(res)
        ops.decode_pulls_lowbit_(res, pulled, c.part.keys_on(c.device), c.isz, lb.bits, lb.block,
                                 n if op == "mean" else 1)
        c.timer.write_into(timing)
        if timing is not None:
            timing["pull_format"] = FMT_NAMES[fmt]
        results.append(res)
    return results


def push_aggregate_lowbit(scheme, comm: Communicator, calls: list[ZenCall], op: str, exchange=None) -> None:
    """Steps 1-3 of ``sync_group_lowbit`` (shared with the reduce-scatter, ``core/rs_zen.py``): leaves on each
    call ``c.part``, ``c.m``, ``c.acc`` (fp32 ``[m]``: the sum of the dequantized contributions), ``c.touched``
    (bool ``[m]``) and ``c.count_1`` (the touched count, on the device). ``exchange``: None pushes each
    call in its own exchange under its signature; else a callable taking every call's per-peer payloads
    and returning every call's received ones (``ZenScheme.push_aggregate``'s rule)."""
    n, rank = comm.size, comm.rank
    # Step 1: partition.
    for c in calls:
        c.timer.start("hash_s")
        c.part = scheme.partitioner(c.sg.numel, n)
        counts_P, order_K, pos_K, _ = c.part.partition(c.sg.indices)
        c.counts_P, c.order_K, c.pos_K = counts_P.to(torch.int64), order_K, pos_K.to(c.idt)
        c.timer.stop()
    bounds_G = torch.stack([c.counts_P for c in calls]).cumsum(1).tolist()

    # Step 2: quantize per owner, sender feedback, push.
    sends = []
    for c, bounds in zip(calls, bounds_G):
        c.timer.start("push_s")
        lb = c.sg.lowbit
        codes, scales = _quantize_sent(c, bounds)
        scales = wire_scales(scales, lb.bits)
        elem, code_at, blk_at = segment_layout(bounds, lb.bits, lb.block)
        send = []
        for j in range(n):
            s, e = elem[j], elem[j + 1]
            if e == s:
                send.append(torch.empty(0, dtype=torch.uint8, device=c.device))
            else:
                send.append(pack(c.pos_K[s:e], scales[blk_at[j]:blk_at[j + 1]], codes[code_at[j]:code_at[j + 1]]))
        del c.pos_K, codes, scales
        if exchange is None:
            with comm.signed(c.sg.dense_numel, c.dtype, op, where=f"scheme {scheme.name!r}.sync"):
                c.recv = comm.exchange_v(send)
        else:
            sends.append(send)
        c.timer.stop()
    if exchange is not None:  # the caller's one exchange for the whole group (under its signature)
        for c, recv in zip(calls, exchange(sends)):
            c.recv = recv

    # Step 3: owner aggregation in fp32.
    for c in calls:
        c.timer.start("aggregate_s")
        lb = c.sg.lowbit
        c.m = c.part.part_size(rank)
        counts = [push_count(r.numel(), c.isz, lb.bits, lb.block) for r in c.recv]
        pos, sc, cd = [], [], []
        for r, k in zip(c.recv, counts):
            if k:
                nb = (k + lb.block - 1) // lb.block
                pos.append(view_as(r, 0, k, c.idt))
                sc.append(read_scales(r, k * c.isz, nb, lb.bits))
                cd.append(r[k * c.isz + SCALE_BYTES[lb.bits] * nb:])
        ends = list(itertools.accumulate(counts))
        c.acc = torch.zeros(c.m, dtype=torch.float32, device=c.device)
        c.touched = torch.zeros(c.m, dtype=torch.bool, device=c.device)
        if pos:  # dequantize, sum in sender order, mark: one op
            ops.dequantize_add_blocks_(c.acc, c.touched, torch.cat(pos), torch.cat(cd), torch.cat(sc).float(), ends, lb.bits,
                                       lb.block)
        if op == CONTRIBUTORS:  # each position divided by its senders before the pull quantizes it
            divide_by_senders_(c.acc, sender_counts(pos, c.m, c.device))
        c.count_1 = c.touched.sum().reshape(1)
        del c.recv
        c.timer.stop()


def _quantize_sent(c: ZenCall, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sender's step 2 for one call: its values in ``order_K`` (grouped by owner) quantized with a
    segment per owner, and DGC's error feedback: written in the same pass where DGC's memory is one fp32
    buffer of these very values (``LowBitValues.sender_residual``), else handed the dequantized values."""
    lb = c.sg.lowbit
    fused = lb.sender_residual() if lb.sender_residual is not None else None
    if fused is not None and fused[2] is c.sg.values:
        codes, scales, _ = ops.quantize_sent_(c.sg.values, c.order_K, fused[0], fused[1], bounds, lb.bits, lb.block)
        return codes, scales
    codes, scales, deq = ops.quantize_sent_(c.sg.values, c.order_K, None, None, bounds, lb.bits, lb.block)
    if lb.sender_feedback is not None:
        lb.sender_feedback(c.order_K, deq)
    return codes, scales


def quantize_owned(c: ZenCall, pos_C: torch.Tensor, seg_ends: list[int], divisor: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's step 4 (shared with the reduce-scatter): the sums at its unique compact positions
    ``pos_C`` plus its owner residual there, quantized in segments ``seg_ends`` (one per receiver in the
    reduce-scatter); the owner residual there becomes the sum minus what the receivers will apply (the
    old one kept where that is not finite): one op (``ops.quantize_owned_``). Returns ``(codes, scales)``."""
    lb = c.sg.lowbit
    R = lb.owner_residual(c.m, c.device) if lb.owner_residual is not None else None
    return ops.quantize_owned_(c.acc, pos_C, R, seg_ends, lb.bits, lb.block, c.dtype, divisor)
