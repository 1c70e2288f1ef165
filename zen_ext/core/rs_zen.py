"""``zen`` reduce-scatter: ZEN's balanced push, then a targeted pull to the owners of contiguous ranges.

1. Push as ZEN's all-reduce does (``ZenScheme.push_aggregate``, core/zen.py): h0 hash-partitions each
   rank's entries over ``n`` servers, so every server receives ~1/n of them whatever the skew, and
   sums them into its compact buffer of ``|𝕀_i| ≈ N/n`` positions.
2. Targeted pull: server ``i`` sends owner ``r`` only the aggregated entries of ``𝕀_i ∩ R_r``, in the
   cheapest of COO (positions inside the intersection), a bitmap over the intersection, or dense. The
   intersection ``S_ir`` in position order is fixed by the layout (numel, n, ranges), so both sides
   compute it once per layout: the server its positions grouped by owner, the owner its range's units
   grouped by server (``_Layout``). Each rank pulls ``|R_r ∩ ∪I|`` entries instead of the whole
   union: at DGC 1 % on 16 ranks, ~1/16 of today's all-reduce pull.

Bytes per rank: push ``≈ K·(n−1)/n·(i + v)`` as the all-reduce; pull: server ``i`` sends
``Σ_{r≠i} cost(u_r/n)``, owner ``r`` receives ``(n−1)·cost(u_r/n)``, with ``u_r`` the union of
entries in ``R_r`` and ``cost`` the cheapest encoding plus a 16-byte header (``predict_zen_bytes``).
Two exchanges per group of gradients (a bucket's DGC group and embeddings together: ``exchange_packed``
in core/wire.py); host reads per group: the push counts, the aggregated per-owner counts, the pulled
headers, and with several gradients the packed messages' size tables (flat in ``n``), plus the layout's
tables once per layout.

Pull wire format per (server, owner): empty when no entry, else ``[header int64×2 = (format, count) |
body]``: COO ``positions in S_ir (int32, or int64 past 2^31) | values``; bitmap ``⌈|S_ir|/64⌉``
little-endian int64 words ``| values``; dense ``|S_ir|`` values. Values are the sums in the gradient's
dtype; ``mean`` divides the owner's range after decoding (the order ``dense`` uses). With
``zen.dgc.value_bits`` the values are ``scales | codes`` and ``S_ir`` is in ascending global index, not in
position order (``_reduce_scatter_lowbit``), so the pushed values and the reply both quantize in blocks
that hold one tensor of the bucket after another (position order mixes them all in every block).

Legend: ``_M`` a server's partition, ``_R`` this rank's range (units: rows of a row-form gradient).
"""

from __future__ import annotations

import itertools
import threading

import torch

from .. import ops
from ..ops._reference import mask_to_words, words_to_mask
from .rs_base import ReduceScatterScheme, RSProfile, as_units
from .wire import exchange_packed, pack, view_as
from . import lowbit
from .zen import ZenScheme
from .zen_lowbit import push_aggregate_lowbit, quantize_owned
from .zen_wire import FMT_BITMAP, FMT_DENSE, FMT_NAMES, HEADER_BYTES, ZenCall, cheapest_format

_MAX_LAYOUTS = 64


def predict_zen_bytes(p: RSProfile) -> dict:
    """Bytes the busiest rank sends or receives over push and pull (``bytes``), messages, rounds (2)."""
    n, e = p.n, p.idx_bytes + p.val_bytes
    if n == 1:
        return {"bytes": 0, "msgs": 0, "rounds": 0}
    ks = [sum(row) for row in p.counts]
    push_sent = [k * (n - 1) / n * e for k in ks]
    push_recv = [(sum(ks) - k) / n * e for k in ks]
    pull = []
    for r in range(n):
        u, s = p.union(r) / n, p.lengths[r] / n
        pull.append(0 if u == 0 else HEADER_BYTES + min(u * e, -(-s // 64) * 8 + u * p.val_bytes, s * p.val_bytes))
    pull_sent = sum(pull) - min(pull)  # a server sends to every owner but itself
    sent = max(ps + pull_sent for ps in push_sent)
    recv = max(pr + (n - 1) * c for pr, c in zip(push_recv, pull))
    return {"bytes": int(max(sent, recv) + 16 * (n - 1)), "msgs": 2 * (n - 1), "rounds": 2}


class _Layout:
    """The pull's tables for one (numel, n, ranges, rank, order): which of this server's positions each
    owner gets (``own_order`` grouped by owner at ``own_cuts``) and where each server's entries land in this
    rank's range (``tgt`` offsets grouped by server at ``tgt_cuts``), ``S_ir`` inside a group in position
    order, or with ``index_order`` in ascending global index (the low-bit pull, whose blocks must not mix
    the bucket's tensors: ``_reduce_scatter_lowbit``). Kept as int32 where they fit:
    ``4·(|𝕀_rank| + |R_rank|)`` bytes per layout, about ``8·N/n``."""

    def __init__(self, part, ranges: list[tuple[int, int]], rank: int, device: torch.device,
                 index_order: bool = False) -> None:
        # Built once per layout, but it sets the first step's peak memory (several position-sized int64
        # arrays at once): each intermediate is freed as soon as it is used, and arithmetic runs in place.
        n, numel = part.num_parts, part.numel
        ends = torch.tensor([e for _, e in ranges], dtype=torch.int64, device=device)
        idt = torch.int32 if numel < 2**31 else torch.int64
        # Server side: the owner of each of this server's positions.
        m = part.part_size(rank)
        x_M = part.indices_of(rank, torch.arange(m, dtype=torch.int64, device=device))
        owner_M = torch.searchsorted(ends, x_M, right=True, out_int32=True)  # owners < n: int32 is exact
        own_counts = torch.bincount(owner_M, minlength=n)
        if index_order:  # the ranges tile [0, N) in rank order: ascending indices are grouped by owner too
            del owner_M
            self.own_order = torch.argsort(x_M).to(idt)
            del x_M
        else:
            del x_M
            self.own_order = torch.sort(owner_M, stable=True)[1].to(idt)
            del owner_M
        # Owner side: the server and position of each unit of this rank's range.
        lo, hi = ranges[rank]
        y_R = ops.permute(torch.arange(lo, hi, dtype=torch.int64, device=device), numel, part.keys_on(device))
        srv_R = y_R % n
        if index_order:  # a server's units in ascending offset, i.e. ascending global index
            del y_R
            self.tgt = torch.sort(srv_R, stable=True)[1].to(idt)
        else:
            key = srv_R * (numel // n + 2)
            key += y_R.div_(n, rounding_mode="floor")
            del y_R
            self.tgt = torch.argsort(key).to(idt)
            del key
        counts = torch.stack([own_counts, torch.bincount(srv_R, minlength=n)])
        cuts = torch.cat([counts.new_zeros(2, 1), counts.cumsum(1)], 1)
        self.own_cuts_dev = cuts[0]
        self.own_cuts, self.tgt_cuts = cuts.tolist()  # once per layout


class ZenReduceScatter(ReduceScatterScheme):
    """Balanced push (hash partition) → aggregate → targeted pull to the owners of the ranges.

    Args:
        seed: shared hash seed (as ``zen``'s).
        pull_format: ``"auto"`` picks the cheapest encoding per (server, owner); ``"coo"``,
            ``"bitmap"``, ``"dense"`` force one.
        num_rehash, parallel_factor, serial_factor: Algorithm 1 parameters (as ``zen``'s).
    """

    name = "zen"
    carries_low_bits = True  # zen.dgc.value_bits: _reduce_scatter_lowbit

    def __init__(self, seed: int = 0, pull_format: str = "auto", num_rehash: int = 3, parallel_factor: float = 2.0,
                 serial_factor: float = 0.1) -> None:
        self.zen = ZenScheme(seed, pull_format, num_rehash, parallel_factor, serial_factor)
        self._layouts: dict[tuple, _Layout] = {}
        self._lock = threading.Lock()

    def options(self) -> dict:
        return self.zen.options()

    def _layout(self, part, ranges, rank, device, index_order: bool = False) -> _Layout:
        key = (part.numel, part.num_parts, part.seed, tuple(ranges), rank, device, index_order)
        lay = self._layouts.get(key)
        if lay is None:
            lay = _Layout(part, ranges, rank, device, index_order)
            with self._lock:
                if len(self._layouts) >= _MAX_LAYOUTS:
                    self._layouts.clear()
                self._layouts[key] = lay
        return lay

    def _reduce_scatter_group(self, comm, grads, ranges, op, outs, timings, keys):
        """1–3. Partition, push, aggregate: ``ZenScheme.push_aggregate`` for the whole group, its push one
           packed exchange (under the reduce-scatter's signature).
        4. Per owner, count this server's aggregated entries in ``S_ir``; one host read for the group
           (with the aggregated counts, which also carry the CUDA op's outside-partition check).
        5. Targeted pull: one exchange for the group, each owner's message in its cheapest format.
        6. One host read of every pulled header of the group, then each server's entries are copied
           into this rank's range (zeroed first); ``mean`` divides it.
        """
        n, rank = comm.size, comm.rank
        units = [as_units(g, rs) for g, rs in zip(grads, ranges)]
        low = [i for i, (sg, _) in enumerate(units) if sg.lowbit is not None]
        if low:  # zen.dgc.value_bits: the quantized form (_reduce_scatter_lowbit), the rest as always
            results: list = [None] * len(grads)
            got = self._reduce_scatter_lowbit(comm, [units[i] for i in low], op, [timings[i] for i in low])
            for i, r in zip(low, got):
                results[i] = r
            rest = [i for i in range(len(grads)) if i not in low]
            if rest:
                for i, r in zip(rest, self._reduce_scatter_group(comm, [grads[i] for i in rest], [ranges[i] for i in rest],
                                                                 op, [outs[i] for i in rest], [timings[i] for i in rest],
                                                                 [keys[i] for i in rest])):
                    results[i] = r
            return results
        calls = [ZenCall(sg, t) for (sg, _), t in zip(units, timings)]
        # Steps 1-3: partition, push, aggregate.
        self.zen.push_aggregate(comm, calls, op, exchange=lambda sends: exchange_packed(comm, sends))
        # Step 4: per-owner counts.
        for c, (_, urs) in zip(calls, units):
            c.timer.start("pull_s")
            c.lay = self._layout(c.part, urs, rank, c.device)
            touched = words_to_mask(c.words, c.m)
            c.ts = touched[c.lay.own_order]
            csum = torch.zeros(c.m + 1, dtype=torch.int64, device=c.device)
            torch.cumsum(c.ts, 0, out=csum[1:])
            c.oc = csum[c.lay.own_cuts_dev[1:]] - csum[c.lay.own_cuts_dev[:-1]]
        flat = torch.cat([c.count_1.reshape(-1) for c in calls] + [c.oc for c in calls]).tolist()
        at = 0
        for c in calls:
            words = flat[at : at + c.count_1.numel()]
            at += c.count_1.numel()
            if len(words) > 1 and words[1]:
                raise RuntimeError(f"aggregate_push: {words[1]} pushed position(s) lie outside this server's partition")
        owner_counts = [flat[at + i * n : at + (i + 1) * n] for i in range(len(calls))]
        # Step 5: targeted pull.
        pulled = exchange_packed(comm, [self._encode(c, oc, n) for c, oc in zip(calls, owner_counts)])
        for c, recv in zip(calls, pulled):
            c.recv = recv
            del c.acc, c.words, c.ts
        # Step 6: decode.
        heads = [b[:HEADER_BYTES] for c in calls for b in c.recv if b.numel()]
        head_vals = torch.cat(heads).view(torch.int64).tolist() if heads else []
        results, h = [], 0
        for c, (_, urs), out, timing in zip(calls, units, outs, timings):
            c.timer.start("decode_s")
            lo, hi = urs[rank]
            res = torch.zeros((hi - lo) * c.width, dtype=c.dtype, device=c.device)
            rows = res.view(hi - lo, c.width)
            for i, buf in enumerate(c.recv):
                if not buf.numel():
                    continue
                fmt, cnt = head_vals[2 * h], head_vals[2 * h + 1]
                h += 1
                tg = c.lay.tgt[c.lay.tgt_cuts[i] : c.lay.tgt_cuts[i + 1]].long()
                rows.index_copy_(0, *self._decode(buf, fmt, cnt, tg, c))
            if op == "mean":
                res.div_(n)
            c.timer.write_into(timing)
            if timing is not None:
                timing["scheme"] = self.name
                timing["pull_formats"] = c.formats  # this server's messages per format
            results.append(res)
        return results

    def _reduce_scatter_lowbit(self, comm, units, op, timings):
        """``_reduce_scatter_group`` for gradients whose values travel in low bits (``zen.dgc.value_bits``,
        ``core/lowbit.py``): the same steps, with

        1-3. the quantized push and fp32 aggregation of the all-reduce (``push_aggregate_lowbit``; the sender's
             error feedback included), one packed exchange for the group;
        4.   per owner, this server's touched entries in ``S_ir``, here in ascending global index (one host
             read for the group); the push already sends each owner its values in the gradient's order,
             ascending index (tensor by tensor) for DGC's;
        5.   each owner's entries plus the server's owner residual, quantized in one op with a segment per
             owner (``quantize_owned``: the owner residual keeps what that loses); message ``[format, count
             | index part | scales | codes]`` (index part: positions in ``S_ir``, a bitmap over ``S_ir``, or
             none when the whole intersection travels); one packed exchange;
        6.   one host read of the pulled headers, one dequantize for every server's values, one copy into
             this rank's range (``mean`` divides after the cast, as the all-reduce's decoders do).
        """
        n, rank = comm.size, comm.rank
        calls = [ZenCall(sg, t) for (sg, _), t in zip(units, timings)]
        # Steps 1-3.
        push_aggregate_lowbit(self.zen, comm, calls, op, exchange=lambda sends: exchange_packed(comm, sends))
        # Step 4.
        for c, (_, urs) in zip(calls, units):
            c.timer.start("pull_s")
            # S_ir in ascending global index (tensor by tensor), not in position (hash) order, where every
            # block of a reply mixed the bucket's tensors and a large one's scale coded a small one's sums
            # as 0 (benchmarks/comm/results/value_bits_zeros.md); both ends use the same table.
            c.lay = self._layout(c.part, urs, rank, c.device, index_order=True)
            c.ts = c.touched[c.lay.own_order.long()]
            csum = torch.zeros(c.m + 1, dtype=torch.int64, device=c.device)
            torch.cumsum(c.ts, 0, out=csum[1:])
            c.oc = csum[c.lay.own_cuts_dev[1:]] - csum[c.lay.own_cuts_dev[:-1]]
        flat = torch.cat([c.oc for c in calls]).tolist()
        # Step 5.
        sends = [self._encode_lowbit(c, flat[i * n:(i + 1) * n], n, op) for i, c in enumerate(calls)]
        for c, recv in zip(calls, exchange_packed(comm, sends)):
            c.recv = recv
            del c.acc, c.touched, c.ts
        # Step 6.
        heads = [b[:HEADER_BYTES] for c in calls for b in c.recv if b.numel()]
        head_vals = torch.cat(heads).view(torch.int64).tolist() if heads else []
        results, h = [], 0
        for c, (_, urs), timing in zip(calls, units, timings):
            c.timer.start("decode_s")
            lb = c.sg.lowbit
            lo, hi = urs[rank]
            where, sc, cd, ends = [], [], [], []
            for i, buf in enumerate(c.recv):
                if not buf.numel():
                    continue
                fmt, cnt = head_vals[2 * h], head_vals[2 * h + 1]
                h += 1
                tg = c.lay.tgt[c.lay.tgt_cuts[i]: c.lay.tgt_cuts[i + 1]].long()
                s, off = tg.numel(), HEADER_BYTES
                if fmt == FMT_DENSE:
                    where.append(tg)
                elif fmt == FMT_BITMAP:
                    nw = -(-s // 64)
                    bits = words_to_mask(view_as(buf, off, nw, torch.int64), s)
                    where.append(tg[torch.nonzero_static(bits, size=cnt).flatten()])
                    off += nw * 8
                else:
                    where.append(tg[view_as(buf, off, cnt, c.idt).to(torch.int64)])
                    off += cnt * c.isz
                nb = (cnt + lb.block - 1) // lb.block
                sc.append(lowbit.read_scales(buf, off, nb, lb.bits))
                cd.append(buf[off + lowbit.SCALE_BYTES[lb.bits] * nb: off + lowbit.value_bytes(cnt, lb.bits, lb.block)])
                ends.append((ends[-1] if ends else 0) + cnt)
            res = torch.zeros(hi - lo, dtype=c.dtype, device=c.device)
            if ends:
                vals = ops.dequantize_blocks(torch.cat(cd), torch.cat(sc).float(), ends, lb.bits, lb.block)
                if op == "mean":
                    vals = vals / n
                res.index_copy_(0, torch.cat(where), vals.to(c.dtype))
            c.timer.write_into(timing)
            if timing is not None:
                timing["scheme"] = self.name
                timing["pull_formats"] = c.formats
            results.append(res)
        return results

    def _encode_lowbit(self, c, oc: list[int], n: int, op: str) -> list[torch.Tensor]:
        """Each owner's low-bit pull message from this server (empty where it has no entry)."""
        lb, cuts, total = c.sg.lowbit, c.lay.own_cuts, sum(oc)
        sel = torch.nonzero_static(c.ts, size=total).flatten() if total else c.ts.new_empty(0, dtype=torch.int64)
        fmts = [lowbit.cheapest_format(k, cuts[r + 1] - cuts[r], c.isz, lb.bits, self.zen.pull_format, lb.block)
                if k else -1 for r, k in enumerate(oc)]
        c.formats = {name: fmts.count(f) for f, name in FMT_NAMES.items() if f in fmts}
        # The carried entries (in own_order's space), a segment per owner: the touched ones, or the whole
        # intersection where dense is cheapest (then its untouched entries carry their owner residual).
        carried, counts, at = [], [], 0
        for r, (k, fmt) in enumerate(zip(oc, fmts)):
            if fmt == FMT_DENSE:
                carried.append(torch.arange(cuts[r], cuts[r + 1], device=c.device))
                counts.append(cuts[r + 1] - cuts[r])
            else:
                carried.append(sel[at: at + k])
                counts.append(k)
            at += k
        C = torch.cat(carried) if carried else sel
        ends = list(itertools.accumulate(counts))
        codes, scales = quantize_owned(c, c.lay.own_order.long().index_select(0, C), ends, n if op == "mean" else 1)
        scales = lowbit.wire_scales(scales, lb.bits)
        _, code_at, blk_at = lowbit.segment_layout(ends, lb.bits, lb.block)
        head = torch.tensor([v for f, k in zip(fmts, counts) for v in (f, k)], dtype=torch.int64, device=c.device)
        send, at = [], 0
        for r, (k, fmt) in enumerate(zip(oc, fmts)):
            a, b = cuts[r], cuts[r + 1]
            if not k:
                send.append(torch.empty(0, dtype=torch.uint8, device=c.device))
                continue
            vals = (scales[blk_at[r]:blk_at[r + 1]], codes[code_at[r]:code_at[r + 1]])
            hdr = head[2 * r: 2 * r + 2]
            if fmt == FMT_DENSE:
                send.append(pack(hdr, *vals))
            elif fmt == FMT_BITMAP:
                send.append(pack(hdr, mask_to_words(c.ts[a:b]), *vals))
            else:
                send.append(pack(hdr, (sel[at: at + k] - a).to(c.idt), *vals))
            at += k
        return send

    def _encode(self, c, oc: list[int], n: int) -> list[torch.Tensor]:
        """Each owner's pull message from this server (empty where it has no entry)."""
        cuts, total = c.lay.own_cuts, sum(oc)
        sel = torch.nonzero_static(c.ts, size=total).flatten() if total else c.ts.new_empty(0, dtype=torch.int64)
        vals = c.acc[c.lay.own_order[sel]].to(c.dtype)
        fmts = [self._choose(k, cuts[r + 1] - cuts[r], c.isz, c.vsz) if k else -1 for r, k in enumerate(oc)]
        c.formats = {name: fmts.count(f) for f, name in FMT_NAMES.items() if f in fmts}
        head = torch.tensor([v for f, k in zip(fmts, oc) for v in (f, k)], dtype=torch.int64, device=c.device)
        send, at = [], 0
        for r, (k, fmt) in enumerate(zip(oc, fmts)):
            a, b = cuts[r], cuts[r + 1]
            if not k:
                send.append(torch.empty(0, dtype=torch.uint8, device=c.device))
                continue
            hdr = head[2 * r : 2 * r + 2]
            if fmt == FMT_DENSE:
                send.append(pack(hdr, c.acc[c.lay.own_order[a:b]].to(c.dtype)))
            elif fmt == FMT_BITMAP:
                send.append(pack(hdr, mask_to_words(c.ts[a:b]), vals[at : at + k]))
            else:
                send.append(pack(hdr, (sel[at : at + k] - a).to(c.idt), vals[at : at + k]))
            at += k
        return send

    @staticmethod
    def _decode(buf: torch.Tensor, fmt: int, cnt: int, tg: torch.Tensor, c) -> tuple[torch.Tensor, torch.Tensor]:
        """``(where, values)`` of one pulled message: offsets into this rank's range and their rows."""
        s, w, off = tg.numel(), c.width, HEADER_BYTES
        if fmt == FMT_DENSE:
            return tg, view_as(buf, off, s * w, c.dtype).view(s, w)
        if fmt == FMT_BITMAP:
            nw = -(-s // 64)
            bits = words_to_mask(view_as(buf, off, nw, torch.int64), s)
            where = tg[torch.nonzero_static(bits, size=cnt).flatten()]
            return where, view_as(buf, off + nw * 8, cnt * w, c.dtype).view(cnt, w)
        pos = view_as(buf, off, cnt, c.idt).to(torch.int64)
        return tg[pos], view_as(buf, off + cnt * c.isz, cnt * w, c.dtype).view(cnt, w)

    def _choose(self, count: int, size: int, isz: int, vsz: int) -> int:
        return cheapest_format(count, size, isz, vsz, self.zen.pull_format)

