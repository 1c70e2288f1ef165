"""``sparcml``: SparCML's sparse all-reduce by recursive doubling (SSAR_Recursive_double; ZEN paper Def. 7).

Hierarchical Centralization: [Hierarchy, Incremental aggregation, Centralization]. In round ``i`` of
``log2 n`` every rank swaps its current aggregate (the sum over a group of ``2^(i−1)`` ranks) with the
partner ``rank XOR 2^(i−1)`` and merges it, so an index present on every rank is received ``log n``
times instead of ``n−1`` (paper Lemma 2); in exchange the messages grow with the group's union: paper
Eq. 2, ``T = Σ_{i=1}^{log n} γ^{2^(i−1)} · 2·M·d / b``. It is the better scheme only when ranks barely
overlap (paper §2.4: NMT at batch 1 on 8 GPUs).

Following SparCML's ``c_allreduce_recdoubling`` and ``sum_streams``:

* a stream is sorted, duplicate-free COO; once its COO bytes reach the dense bytes it becomes dense
  (the δ switch) and stays dense, so a COO message is always smaller than a dense one and the receiver
  tells them apart by size (SparCML uses ``nofitems == dim``);
* non-power-of-two ``n`` folds MPI-style: with ``p = 2^⌊log2 n⌋`` and ``rem = n − p``, each even rank
  ``r < 2·rem`` first hands its stream to ``r+1`` and sits out the rounds, then gets the result back.

Row-form gradients travel as rows (one index per row, a generalisation of SparCML's element streams,
which are the ``W = 1`` case); this only makes the baseline cheaper, never more expensive.

Transport and bytes: each pairwise step is one ``exchange_v`` in which only the partner's payload is
non-empty (idle ranks send nothing). The Communicator's byte model charges what that call really moves
on both transports: an int64 count to every peer (``8·(n−1)`` bytes and ``n−1`` small messages per
step: ``TorchCommunicator`` exchanges counts with one ``all_to_all_single``), plus the one payload. A
native ``MPI_Sendrecv`` would send only the payload; the count bytes are negligible, but in an α–β
model the extra small messages add ``(n−1)·α`` per round (see ``docs/analysis.md``). Per round rank
``r`` sends ``8·(n−1) + min(U·(ib + W·vb), numel·W·vb)`` for its group's ``U`` distinct entries.

Legend: ``_K`` entries, ``_N`` dense length (rows in row form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm.base import Communicator
from .coo import decode_coo, encode_coo, entry_bytes, finish
from .cost import Dims, ProfileView, Traffic, WorkCounts
from .scheme import SyncScheme
from .timing import PhaseTimer
from .types import SparseGrad, acc_dtype, as_sparse, index_dtype


@dataclass
class _Stream:
    """A partial sum: sorted unique ``idx``/``vals`` (COO) or, when ``idx`` is None, dense ``vals``."""

    idx: torch.Tensor | None
    vals: torch.Tensor

    @property
    def dense(self) -> bool:
        return self.idx is None


class _Codec:
    """Stream encoding for one gradient shape: COO or dense, whichever is smaller."""

    def __init__(self, numel: int, row_shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.numel, self.row_shape, self.dtype, self.device = numel, row_shape, dtype, device
        # Streams keep indices in the wire dtype (int32 below 2^31): half the memory of int64 when 128
        # simulated ranks hold a 40 %-dense stream each.
        self.idt = index_dtype(numel)
        width = 1
        for s in row_shape:
            width *= s
        self.entry_bytes = entry_bytes(numel, width, dtype)
        self.dense_bytes = numel * width * torch.empty(0, dtype=dtype).element_size()

    def maybe_densify(self, s: _Stream) -> _Stream:
        if s.dense or s.idx.numel() * self.entry_bytes < self.dense_bytes:
            return s
        out = torch.zeros((self.numel,) + self.row_shape, dtype=self.dtype, device=self.device)
        out[s.idx] = s.vals
        return _Stream(None, out)

    def encode(self, s: _Stream) -> torch.Tensor:
        if s.dense:
            return s.vals.reshape(-1).view(torch.uint8)
        return encode_coo(s.idx, s.vals, self.numel)

    def decode(self, buf: torch.Tensor) -> _Stream:
        if buf.numel() == self.dense_bytes and self.dense_bytes:
            # A copy: in SimWorld the buffer is the sender's own tensor, and results must not alias.
            return _Stream(None, buf.clone().view(self.dtype).view((self.numel,) + self.row_shape))
        return _Stream(*decode_coo(buf, self.numel, self.row_shape, self.dtype, wire_indices=True))

    def coalesce(self, idx: torch.Tensor, vals: torch.Tensor) -> _Stream:
        """Sorted unique indices with duplicates summed (fp32 for half types, rounded once)."""
        uniq, inv = torch.unique(idx.to(self.idt), sorted=True, return_inverse=True)
        acc = torch.zeros((uniq.numel(),) + self.row_shape, dtype=acc_dtype(self.dtype), device=self.device)
        acc.index_add_(0, inv, vals.to(acc.dtype))
        return self.maybe_densify(_Stream(uniq, acc.to(self.dtype)))

    def merge(self, a: _Stream, b: _Stream) -> _Stream:
        """``a + b``, ``a`` from the lower rank: both partners add the same two operands in the same
        order, so they hold the same bits after every round."""
        adt = acc_dtype(self.dtype)
        if not a.dense and not b.dense:
            return self.maybe_densify(self._merge_sorted(a, b, adt))
        if a.dense and b.dense:
            acc = a.vals.to(adt) + b.vals.to(adt)
        else:
            d, s = (a, b) if a.dense else (b, a)
            acc = d.vals.to(adt, copy=True)
            if s.idx.numel():
                acc.index_add_(0, s.idx, s.vals.to(adt))
        return _Stream(None, acc.to(self.dtype))

    def _merge_sorted(self, a: _Stream, b: _Stream, adt: torch.dtype) -> _Stream:
        """SparCML's ``sum_streams``: the union of two sorted unique streams, common indices summed.

        Positions come from ``searchsorted`` (int32), not from a sort of the concatenation: no int64
        temporaries of twice the stream length.
        """
        ka = a.idx.numel()
        pos = torch.searchsorted(a.idx, b.idx, out_int32=True)  # where b's indices would go in a
        hit = pos < ka
        hit[hit.clone()] = a.idx[pos[hit]] == b.idx[hit]
        new_idx, new_pos = b.idx[~hit], pos[~hit]
        # Final places: a's entries shift right by the new entries before them, new entries by their rank.
        dev = a.idx.device
        at_a = torch.arange(ka, dtype=torch.int32, device=dev) + torch.searchsorted(new_idx, a.idx, out_int32=True)
        at_new = new_pos + torch.arange(new_idx.numel(), dtype=torch.int32, device=dev)
        idx = torch.empty(ka + new_idx.numel(), dtype=a.idx.dtype, device=dev)
        idx[at_a], idx[at_new] = a.idx, new_idx
        vals = torch.empty((idx.numel(),) + self.row_shape, dtype=adt, device=dev)
        vals[at_a] = a.vals.to(adt)
        vals[at_a[pos[hit]]] += b.vals[hit].to(adt)
        vals[at_new] = b.vals[~hit].to(adt)
        return _Stream(idx, vals.to(self.dtype))

    def to_dense(self, s: _Stream) -> torch.Tensor:
        if s.dense:
            return s.vals
        out = torch.zeros((self.numel,) + self.row_shape, dtype=self.dtype, device=self.device)
        out[s.idx] = s.vals
        return out


class SparCMLScheme(SyncScheme):
    """Recursive-doubling sparse all-reduce with incremental aggregation and a dense switch (SparCML)."""

    name = "sparcml"
    wire_phases = ("rounds_s",)

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` losslessly.

        1. Coalesce: sort this rank's entries and sum duplicates; go dense if that is smaller.
        2. Fold: for non-power-of-two ``n``, even ranks below ``2·rem`` hand their stream to the next rank.
        3. Rounds: ``log2 p`` pairwise swaps with partner ``vrank XOR mask``, merging after each.
        4. Unfold: the folded ranks get the final stream back.
        5. Decode: the final stream as a dense tensor.
        """
        sg = as_sparse(grad)
        n, rank = comm.size, comm.rank
        codec = _Codec(sg.numel, tuple(sg.values.shape[1:]), sg.values.dtype, sg.values.device)

        # Step 1: coalesce.
        timer = PhaseTimer(sg.values.device, enabled=timings is not None)
        timer.start("coalesce_s")
        mine = codec.coalesce(sg.indices, sg.values)

        p = 1 << (n.bit_length() - 1)
        rem = n - p
        timer.start("rounds_s")
        # Step 2: fold. vrank is this rank's place among the p participants (None: sits out).
        if rem:
            if rank < 2 * rem and rank % 2 == 0:
                self._swap(comm, codec, mine, send_to=rank + 1)
                vrank = None
            elif rank < 2 * rem:
                mine = codec.merge(self._swap(comm, codec, None, recv_from=rank - 1), mine)
                vrank = rank // 2
            else:
                self._swap(comm, codec, None)
                vrank = rank - rem
        else:
            vrank = rank

        # Step 3: rounds.
        mask = 1
        while mask < p:
            if vrank is None:
                self._swap(comm, codec, None)
            else:
                pv = vrank ^ mask
                partner = pv * 2 + 1 if pv < rem else pv + rem
                got = self._swap(comm, codec, mine, send_to=partner, recv_from=partner)
                mine = codec.merge(mine, got) if vrank < pv else codec.merge(got, mine)
            mask <<= 1

        # Step 4: unfold.
        if rem:
            if rank < 2 * rem and rank % 2 == 0:
                mine = self._swap(comm, codec, None, recv_from=rank + 1)
            elif rank < 2 * rem:
                self._swap(comm, codec, mine, send_to=rank - 1)
                if mine.dense:
                    # SimWorld hands the sent dense stream over by reference: the result returned here
                    # (and divided for "mean") must not be the buffer rank - 1 is still reading.
                    mine = _Stream(None, mine.vals.clone())
            else:
                self._swap(comm, codec, None)

        # Step 5: decode.
        timer.start("decode_s")
        out = finish(codec.to_dense(mine), sg.values.dtype, op, n)
        timer.write_into(timings)
        return out

    @staticmethod
    def _swap(
        comm: Communicator, codec: _Codec, stream: _Stream | None, send_to: int | None = None,
        recv_from: int | None = None,
    ) -> _Stream | None:
        """One pairwise step as an ``exchange_v`` in which only ``send_to`` gets a payload.

        Every rank takes part (SimWorld needs all of them at each collective); ranks with nothing to
        send pass ``stream=None``.
        """
        empty = torch.empty(0, dtype=torch.uint8, device=codec.device)
        send = [empty] * comm.size
        if send_to is not None:
            send[send_to] = codec.encode(stream)
        recv = comm.exchange_v(send)
        return codec.decode(recv[recv_from]) if recv_from is not None else None

    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        """The steps of ``_sync`` (fold, rounds, unfold), each stream the union of the ranks it sums,
        dense once COO is not smaller."""
        n, tr = p.n, Traffic(p.n)
        dense_bytes = p.numel * p.row_width * p.value_bytes

        def stream_bytes(group: Sequence[int]) -> float:
            coo = p.union(group) * p.entry_bytes
            return dense_bytes if coo >= dense_bytes else coo

        def step(pairs: dict[int, tuple[int, Sequence[int]]]) -> None:
            # pairs[src] = (dst, group whose aggregate src sends)
            bytes_PP = torch.zeros(n, n, dtype=torch.float64)
            for src, (dst, group) in pairs.items():
                bytes_PP[src, dst] = stream_bytes(group)
            tr.exchange_v(bytes_PP)

        p2 = 1 << (n.bit_length() - 1)
        rem = n - p2
        groups = {r: (r,) for r in range(n)}
        if rem:
            step({r: (r + 1, groups[r]) for r in range(0, 2 * rem, 2)})
            for r in range(1, 2 * rem, 2):
                groups[r] = (r - 1, r)
        real = [2 * v + 1 if v < rem else v + rem for v in range(p2)]
        mask = 1
        while mask < p2:
            step({real[v]: (real[v ^ mask], groups[real[v]]) for v in range(p2)})
            groups = {**groups,
                      **{real[v]: tuple(sorted(groups[real[v]] + groups[real[v ^ mask]])) for v in range(p2)}}
            mask <<= 1
        if rem:
            step({r: (r - 1, tuple(range(n))) for r in range(1, 2 * rem, 2)})
        return tr

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        d = Dims.of(w)
        rounds = max(1, (d.n - 1).bit_length())
        merged = sum(min(d.U, d.K * (1 << i)) for i in range(1, rounds + 1))
        return {"coalesce_s": {"sort_s_per_entry": d.K},
                "rounds_s": {"sort_s_per_entry": merged, "fill_s_per_byte": merged * (d.ib + d.W * d.vb)},
                "decode_s": {"fill_s_per_byte": d.dense_out, "scatter_s_per_elem": d.U * d.W}}
