"""``spardl``: SparDL's Spar-Reduce-Scatter, Bruck all-gather and global residual collection (Zhao et al.,
Algorithm 1; d = 1, no Spar-All-Gather teams). A **lossy** scheme: ``auto`` never picks it.

DGC's top-k union grows with the rank count (sparse gradient accumulation). ZEN keeps the union and
sends it losslessly; SparDL re-sparsifies to ``k/P`` entries per block at every step of a
reduce-scatter, so each rank sends ``k(P−1)/P`` (index, value) pairs in the Spar-Reduce-Scatter (SRS)
and as many in the Bruck all-gather, whatever ``P``, in ``⌈log2 P⌉`` rounds each, and keeps what it
dropped in a residual.

**Where it sits.** SparDL selects ``k/P`` entries per block from the local gradient plus its
residual, so it takes the *dense* accumulated gradient of the slices DGC serves, and owns their
residual. The pair is: DGC (``compress/dgc/sparsifier.py``) clips, warms up and accumulates as always
(momentum correction included, so CatchUpAdamW and every ``zen.dgc`` option still apply), and when
the Synchronizer's scheme ``takes_accumulated`` it hands over its flat memory instead of selecting:
an ``AccumulatedGrad`` (``core/types.py``: the memory ``R = local gradient + residual``, this step's
density, the momentum to mask). SparDL selects from ``R`` and writes the new residual back into ``R``
in place, so the residual lives in DGC's state, keyed by parameter name, and is checkpointed with it.
DGC's rotating flush (``zen.dgc.flush_fraction``) comes with it (``AccumulatedGrad.flush``): every
selection of a block sends the block's flushed positions first, inside its ``k_b``, and the top-k the
rest, so a flushed coordinate reaches the result as the sum over all ranks and its residual is reset
on every rank, as under DGC's own selection. Anything else it is given (natural's embedding rows, a
non-finite gradient DGC passes through, a direct call with a plain gradient) has no memory to keep a
dropped entry in, so it goes through ``zen`` losslessly.

Algorithm, for rank ``w`` of ``P`` (blocks: ``even_ranges(N, P)``, or the owners' ranges for the
reduce-scatter form; ``k_b = ⌈density·|b|⌉`` entries per block, known on every rank, so every message
has a size both sides know and travels without a count round, ``Communicator.sendrecv``):

1. ``G ← R``; global residuals keep a copy ``G_copy`` (Alg. 1 lines 1–3). Local residuals instead
   select ``k_b`` per block of ``G`` once (the local residual ``G − selected`` stays in ``R``) and run
   the steps below on the selection, dropping what they drop.
2. SRS, non-recursive bags (any ``P``): for ``l = ⌈log2 P⌉`` steps with distance ``d = 2^(l−s)``, select
   top-``k_b`` of each block of the bag sent next (blocks ``w+d … w+min(2d, P)−1``, the seed's
   optimization: only those), keep ``ξ = held − sent`` in ``G`` (the in-procedure residual, on the
   rank that dropped it, Alg. 1 lines 5–7), send the bag to ``w+d``; receive blocks ``w … w+min(d,
   P−d)−1`` from ``w−d`` and add them (Theorem 1: always blocks still held).
3. Select the own block (line 9). Reduce-scatter form: this is the result.
4. Bruck all-gather of every rank's block (``⌈log2 P⌉`` rounds, any ``P``).
5. Global residuals (lines 11–13): at the indices ``I`` of the result the residual is ``ξ``; elsewhere
   (local and end-procedure residuals) it is ``G_copy``, this rank's own accumulated value.

**Conservation** (exact on integer-valued inputs, tested): every block is sparsified once per rank,
and what rank ``u`` sent of it was added by exactly one rank, so ``Σ_w ξ_w = Σ_w G_w − result`` at
every index; off ``I`` the result is 0 and ``Σ_w G_copy_w = Σ_w G_w``. So ``result + Σ_w residual_w =
Σ_w G_w`` everywhere. The reduce-scatter form does not learn ``I`` (no all-gather), so it keeps ``ξ``
everywhere (every dropped value on the rank that dropped it), which conserves the same way. Values
travel in the gradient's dtype (clamped to its finite range); the cast's rounding stays in ``ξ``.

Momentum masking (DGC's): the momentum is zeroed where this rank's residual was reset by its own
selection (in ``I`` for the all-reduce), as DGC zeroes it where it sent.

Bytes per rank (``eb`` = index + value bytes): SRS sends ``Σ_{b≠own} k_b·eb ≈ k(P−1)/P·eb`` and the
all-gather as many again; messages 1 per round, rounds ``⌈log2 P⌉`` each (``predict_traffic``).

Legend: ``_N`` dense length, ``_M`` entries of a message, ``_C`` blocks of a bag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm import gather
from ..comm.base import Communicator
from .coo import decode_coo, encode_coo, entry_bytes
from .cost import Dims, ProfileView, Traffic, WorkCounts
from .scheme import SyncScheme
from .timing import PhaseTimer
from .types import AccumulatedGrad, FlushPositions, SparseGrad
from .zen import ZenScheme

RESIDUALS = ("global", "local")


@dataclass
class SparDLConfig:
    """The ``zen.spardl`` section (read only by ``scheme: "spardl"``)."""

    residual: str = "global"
    """Which dropped values SparDL keeps: ``"global"`` (Algorithm 1: local, end-procedure and
    in-procedure residuals; every dropped value is kept somewhere) or ``"local"`` (only what each rank
    drops of its own gradient before the first send, as DGC does; what later steps drop is lost).
    Default global."""

    def __post_init__(self) -> None:
        if self.residual not in RESIDUALS:
            raise ValueError(f"zen.spardl.residual ({self.residual!r}) must be one of {list(RESIDUALS)}")


def block_ks(ranges: list[tuple[int, int]], density: float) -> list[int]:
    """Entries each block sends: ``⌈density·|b|⌉``, at most ``|b|`` (the same on every rank)."""
    return [min(e - s, math.ceil(density * (e - s))) if e > s else 0 for s, e in ranges]


def srs_distances(n: int) -> list[int]:
    """The SRS steps' distances ``2^(l−1), …, 2, 1`` with ``l = ⌈log2 n⌉``."""
    return [1 << i for i in reversed(range((n - 1).bit_length()))]


def srs_bags(n: int, rank: int, d: int) -> tuple[list[int], list[int]]:
    """The blocks ``rank`` sends to ``rank + d`` and those it receives from ``rank − d`` at distance ``d``."""
    top = min(2 * d, n)
    return [(rank + j) % n for j in range(d, top)], [(rank + j) % n for j in range(top - d)]


class _Blocks:
    """Block-wise top-k over a flat buffer: the blocks, their ``k_b``, and the selection. With a
    rotating flush (``flush``) each block's flushed positions are part of every selection of it, inside
    its ``k_b`` (at least their number), and the top-k picks the rest among the others."""

    def __init__(self, ranges: list[tuple[int, int]], density: float, wire: torch.dtype,
                 flush: FlushPositions | None = None) -> None:
        self.ranges, self.ks, self.wire = ranges, block_ks(ranges, density), wire
        self.numel = ranges[-1][1]
        self.eb = entry_bytes(self.numel, 1, wire)
        self.flush = flush
        if flush is not None:  # the flush's share comes out of k_b, as DGC's out of its density
            below = flush.count_below([x for r in ranges for x in r])
            self.flush_at = [(below[2 * b], below[2 * b + 1]) for b in range(len(ranges))]
            self.ks = [max(k, hi - lo) for k, (lo, hi) in zip(self.ks, self.flush_at)]

    def nbytes(self, blocks: list[int]) -> int:
        return sum(self.ks[b] for b in blocks) * self.eb

    def select(self, buf_N: torch.Tensor, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k_b`` ``|buf|`` of each block (its flushed positions first, then the largest others):
        ``(positions, values in the wire dtype)``; ``buf`` keeps ``buf − sent`` there (the cast's
        rounding, or 0). No host read: every size is known."""
        live = [b for b in blocks if self.ks[b]]
        dev = buf_N.device
        if not live:
            return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=self.wire, device=dev)
        fs = [self.flush_at[b][1] - self.flush_at[b][0] for b in live] if self.flush is not None else [0] * len(live)
        ks = [self.ks[b] - f for b, f in zip(live, fs)]  # what the top-k picks
        lens = [self.ranges[b][1] - self.ranges[b][0] for b in live]
        bmax, kmax = max(lens), max(ks)
        pos_M = torch.empty(0, dtype=torch.int64, device=dev)
        pos_F, row_F = self._flushed(live, fs, dev) if sum(fs) else (None, None)
        if kmax:
            col = torch.arange(bmax, device=dev)
            start_C = torch.tensor([self.ranges[b][0] for b in live], device=dev)
            pos_CB = start_C[:, None] + col
            pad = col >= torch.tensor(lens, device=dev)[:, None]
            key = buf_N[pos_CB.clamp_(max=self.numel - 1)].abs().masked_fill_(pad, -1)
            if pos_F is not None:  # the flushed positions travel anyway: out of the top-k's reach
                key.view(-1).index_fill_(0, row_F * bmax + pos_F - start_C[row_F], -1)
            pos_CK = pos_CB.gather(1, key.topk(kmax, dim=1).indices)
            if min(ks) == kmax:
                pos_M = pos_CK.reshape(-1)
            else:  # the first k_b of each row (topk sorts by magnitude), sizes known: no host read
                k_C = torch.tensor(ks, device=dev)
                m = sum(ks)
                row = torch.repeat_interleave(torch.arange(len(live), device=dev), k_C, output_size=m)
                pos_M = pos_CK[row, torch.arange(m, device=dev) - (torch.cumsum(k_C, 0) - k_C)[row]]
        if pos_F is not None:
            pos_M = torch.cat([pos_F, pos_M])
        v_M = buf_N[pos_M]
        top = torch.finfo(self.wire).max
        sent = (v_M.clamp(-top, top) if top < torch.finfo(v_M.dtype).max else v_M).to(self.wire)
        buf_N.index_put_((pos_M,), v_M - sent.to(v_M.dtype))
        return pos_M, sent

    def _flushed(self, live: list[int], fs: list[int], dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The flushed positions of the ``live`` blocks (slices of the ascending ``flush.positions`` at
        host-known bounds) and the row of ``live`` each belongs to. A bag is a run of consecutive blocks
        that wraps at most once, so its positions are one or two slices: launches flat in the ranks."""
        spans: list[list[int]] = []
        for b in live:
            lo, hi = self.flush_at[b]
            if spans and spans[-1][1] == lo:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi])
        pos_F = torch.cat([self.flush.positions[lo:hi] for lo, hi in spans])
        row_F = torch.repeat_interleave(torch.arange(len(live), device=dev), torch.tensor(fs, device=dev),
                                        output_size=sum(fs))
        return pos_F, row_F

    def decode(self, buf_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_coo(buf_B, self.numel, (), self.wire)


def spardl_reduce(comm: Communicator, grad: AccumulatedGrad, ranges: list[tuple[int, int]], residual: str,
                  all_gather: bool, timer: PhaseTimer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–5 of the module docstring on ``grad.memory`` (rewritten into the new residual); returns
    ``(positions, values)`` of the result: every block's (``all_gather``) or this rank's block's."""
    n, w = comm.size, comm.rank
    mem = grad.memory
    blk = _Blocks(ranges, grad.density, grad.dtype, grad.flush)
    timer = timer or PhaseTimer(mem.device, enabled=False)
    consumed = [] if grad.momentum is not None else None  # positions this rank's selections reset
    # Step 1: what the SRS works on.
    timer.start("select_s")
    if residual == "local":
        pos_L, val_L = blk.select(mem, list(range(n)))  # mem keeps the local residual
        work = torch.zeros_like(mem).index_put_((pos_L,), val_L.to(mem.dtype))
        if consumed is not None:
            consumed.append(pos_L)
        copy = None
    else:
        work, copy = mem, (mem.clone() if all_gather else None)
    track = consumed if residual == "global" else None
    # Step 2: the SRS steps.
    for d in srs_distances(n):
        timer.start("select_s")
        out_b, in_b = srs_bags(n, w, d)
        pos, val = blk.select(work, out_b)
        if track is not None:
            track.append(pos)
        timer.start("srs_s")
        src = (w - d) % n
        got = comm.sendrecv({(w + d) % n: encode_coo(pos, val, blk.numel)}, {src: blk.nbytes(in_b)})[src]
        timer.start("select_s")
        idx, vals = blk.decode(got)
        work.index_add_(0, idx, vals.to(work.dtype))
    # Step 3: the own block.
    pos, val = blk.select(work, [w])
    if track is not None:
        track.append(pos)
    if not all_gather:
        _mask_momentum(grad, consumed, None)
        return pos, val
    # Step 4: Bruck all-gather.
    timer.start("allgather_s")
    parts = bruck_all_gather(comm, encode_coo(pos, val, blk.numel), [blk.nbytes([r]) for r in range(n)])
    decoded = [blk.decode(p) for p in parts]
    pos = torch.cat([p for p, _ in decoded])
    val = torch.cat([v for _, v in decoded])
    # Step 5: global residuals: ξ at the result's indices, this rank's own accumulated value elsewhere.
    timer.start("residual_s")
    in_I = torch.zeros(mem.numel(), dtype=torch.bool, device=mem.device).index_fill_(0, pos, True)
    if copy is not None:
        mem.copy_(torch.where(in_I, work, copy))
    _mask_momentum(grad, consumed, in_I if residual == "global" else None)
    return pos, val


def _mask_momentum(grad: AccumulatedGrad, consumed: list | None, in_I: torch.Tensor | None) -> None:
    if consumed is None or not consumed:
        return
    mask = torch.zeros(grad.memory.numel(), dtype=torch.bool, device=grad.memory.device)
    mask.index_fill_(0, torch.cat(consumed), True)
    grad.momentum.masked_fill_(mask & in_I if in_I is not None else mask, 0)


def bruck_all_gather(comm: Communicator, mine: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's uint8 message (``sizes[r]`` bytes, known everywhere) in the ``⌈log2 n⌉`` Bruck rounds of
    ``comm/gather.py``, each one fixed-size ``sendrecv``; returns them in rank order."""
    n, r = comm.size, comm.rank
    rel: list[torch.Tensor] = [mine] + [mine[:0]] * (n - 1)  # block i: rank (r + i) % n's
    for recvs, sends in gather.schedule("bruck", n, r):
        (q,), (s,) = recvs, sends
        lens = [sizes[(r + i) % n] for i in range(q.first, q.first + q.count)]
        payload = torch.cat(rel[s.first:s.first + s.count])
        got = comm.sendrecv({s.peer: payload}, {q.peer: sum(lens)})[q.peer]
        rel[q.first:q.first + q.count] = list(got.split(lens))
    return [rel[(j - r) % n] for j in range(n)]


def even_blocks(numel: int, n: int) -> list[tuple[int, int]]:
    """The all-reduce's blocks: ``⌈numel/n⌉`` elements each, the last ones shorter (or empty)."""
    size = -(-numel // n)
    return [(min(numel, b * size), min(numel, (b + 1) * size)) for b in range(n)]


class SparDLScheme(SyncScheme):
    """SparDL's all-reduce: Spar-Reduce-Scatter then Bruck all-gather, with global (or local) residuals."""

    name = "spardl"
    lossless = False
    takes_accumulated = True
    reduce_scatter_form = "spardl"
    wire_phases = ("srs_s", "allgather_s")

    def __init__(self, residual: str = "global", seed: int = 0, pull_format: str = "auto") -> None:
        SparDLConfig(residual)  # validates
        self.residual, self.seed, self.pull_format = residual, seed, pull_format
        self.lossless_scheme = ZenScheme(seed=seed, pull_format=pull_format)
        """What gradients without memory go through (the module docstring)."""

    def options(self) -> dict:
        return {"residual": self.residual, "seed": self.seed, "pull_format": self.pull_format}

    def _sync(self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
              key: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 1–5 (module docstring) on an ``AccumulatedGrad``; anything else through ``zen``."""
        if not isinstance(grad, AccumulatedGrad):
            return self.lossless_scheme.sync_validated(comm, grad, op, timings, key, out)
        timer = PhaseTimer(grad.memory.device, enabled=timings is not None)
        pos, val = spardl_reduce(comm, grad, even_blocks(grad.numel, comm.size), self.residual, True, timer)
        timer.start("decode_s")
        res = out.zero_() if out is not None else torch.zeros(grad.numel, dtype=grad.dtype, device=val.device)
        res.index_put_((pos,), val)
        if op == "mean":
            res.div_(comm.size)
        timer.write_into(timings)
        return res

    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        """The fixed-size rounds of ``_sync`` at the profile's density (the mean of the ranks' entries
        over the numel, unless ``opts["density"]`` says), each ``Traffic.sendrecv``."""
        n = p.n
        tr = Traffic(n)
        numel = p.numel * p.row_width
        density = opts.get("density", sum(q.raw_nnz for q in p.locals) * p.row_width / max(1, n * numel))
        predict_spardl_rounds(tr, even_blocks(numel, n), density, entry_bytes(numel, 1, _dtype_of(p.value_bytes)), True)
        return tr

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        d = Dims.of(w)
        n = max(1, d.n)
        dense = d.N * d.W
        entries = d.K * (n - 1) / n
        return {"select_s": {"fill_s_per_byte": 3 * dense * d.ab, "sort_s_per_entry": dense},
                "srs_s": {"scatter_s_per_elem": entries}, "allgather_s": {"fill_s_per_byte": d.K * (d.ib + d.vb)},
                "residual_s": {"fill_s_per_byte": 2 * dense * d.ab}, "decode_s": {"scatter_s_per_elem": d.K}}


def _dtype_of(value_bytes: int) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(value_bytes, torch.float32)


def predict_spardl_rounds(tr: Traffic, ranges: list[tuple[int, int]], density: float, eb: int,
                          all_gather: bool) -> None:
    """Record SparDL's rounds on ``tr``: the SRS steps, then (``all_gather``) the Bruck rounds."""
    n = tr.n
    ks = block_ks(ranges, density)
    for d in srs_distances(n):
        tr.sendrecv([[((r + d) % n, sum(ks[b] for b in srs_bags(n, r, d)[0]) * eb)] for r in range(n)])
    if all_gather:
        for k, _ in enumerate(gather.bruck_steps(n)):
            rounds = []
            for r in range(n):
                (s,) = gather.schedule("bruck", n, r)[k][1]
                rounds.append([(s.peer, sum(ks[(r + i) % n] for i in range(s.first, s.first + s.count)) * eb)])
            tr.sendrecv(rounds)
