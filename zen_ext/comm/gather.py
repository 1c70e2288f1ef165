"""The variable-size all-gather's round structure: direct, ring or Bruck, their messages and bytes.

Every transport (``comm/torch_dist.py``, ``comm/simulated.py``) runs a gather in the same two phases,
so rounds, messages and bytes are the same in a real process group and in SimWorld:

1. **Counts**: an all-gather of every rank's ``(count, call signature)`` pair in fixed-size messages
   (whose sizes every receiver knows: no header for the header), then one host read of the table:
   one round of ``n−1`` 16-byte messages each way (``direct``), or, where that many tiny messages cost
   more than the rounds saved (``count_algo``; beyond a few hundred ranks), ``⌈log2 n⌉`` Bruck rounds.
   Every rank then knows every rank's count and signature: the signatures are checked here, before
   any payload moves, on every rank at once.
2. **Payloads**, in the algorithm ``choose`` picks from the counts (identical on every rank, since
   every rank holds the same table; ``gather_impl`` forces one):

   * ``direct``: one round; every rank sends its block to the ``n−1`` others at once.
   * ``ring``: ``n−1`` rounds; each rank forwards the block it received last round to its successor.
   * ``bruck``: ``⌈log2 n⌉`` rounds (any ``n``, non-powers of two included); in round ``k`` a rank
     sends the ``min(2^k, n−2^k)`` consecutive blocks it holds, starting with its own, to rank
     ``r−2^k`` and receives as many from ``r+2^k``, one message each way.
   * ``bruck4``: the same with radix 4, ``⌈log4 n⌉`` rounds of 3 messages each way: in round ``k``
     (``D = 4^k``) a rank sends its first ``min(D, n−j·D)`` blocks to ``r−j·D`` and receives as many
     from ``r+j·D``, ``j = 1, 2, 3`` (half the rounds of ``bruck`` for three flows at a time).

Blocks are numbered relative to the rank (block ``i`` is rank ``(r+i) mod n``'s), so every message is
one contiguous range of a rank's receive buffer (``Msg.first``, ``Msg.count``) and no block is copied
on its way: a rank's buffer ends in relative order, and part ``j`` is a view of it.

Wire: a count message carries ``count`` pairs of int64 (the count bytes are traffic, 8 per pair; the
signature word is a check and not counted, as in ``comm/base.py``); a payload message carries the
concatenated blocks and is left out on both sides when empty.

Inside a Communicator slot, from a call's second time on (``comm/inline.py``), there is no count
phase: every block is ``[count, signature | payload | zeros]`` of a capacity every rank derives from
the last call's counts, the payload algorithm is chosen for those block sizes, and a rank whose payload
outgrew its block sends the rest to every peer in one more round (``GatherPlan.caps``; ``traffic``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from .inline import COUNT_BYTES as _COUNT_BYTES, counted_bytes, inline_segment_bytes

GATHER_IMPLS = ("auto", "direct", "ring", "bruck", "bruck4")
_RADIX = {"bruck": 2, "bruck4": 4}


@dataclass(frozen=True)
class Msg:
    """One message of a round: to/from ``peer``, blocks ``first .. first+count−1`` (relative to this rank)."""

    peer: int
    first: int
    count: int


@dataclass(frozen=True)
class GatherCosts:
    """What ``choose`` and ``count_algo`` weigh: seconds per round (latency on the critical path),
    seconds per extra payload message a rank handles in one round (simultaneous flows: incast, TCP
    flows sharing a link, per-message CPU; the direct pull ran at 5–7× its link bound at 16 emulated
    hosts, benchmarks/cluster/results/cluster_pull16.md), seconds per extra 16-byte count message in one round, and link bytes per second.
    Ranks must agree on them (every rank builds them from the same configuration)."""

    round_s: float = 50e-6
    msg_s: float = 50e-6
    count_msg_s: float = 2e-6
    bytes_per_s: float = 1.25e9


def bruck_steps(n: int) -> list[tuple[int, int]]:
    """``(distance, blocks)`` of each Bruck round: ``(2^k, min(2^k, n−2^k))`` while ``2^k < n``."""
    out, d = [], 1
    while d < n:
        out.append((d, min(d, n - d)))
        d *= 2
    return out


def radix_steps(n: int, radix: int) -> list[list[tuple[int, int]]]:
    """Per round of a radix-``radix`` Bruck, ``(distance, blocks)`` of each peer: ``(j·D, min(D, n−j·D))``
    for ``j = 1 .. radix−1`` while ``j·D < n`` (``D = radix^k``)."""
    out, d = [], 1
    while d < n:
        out.append([(j * d, min(d, n - j * d)) for j in range(1, radix) if j * d < n])
        d *= radix
    return out


def count_algo(n: int, costs: "GatherCosts") -> str:
    """The count phase's structure: ``direct`` (one round of ``n−1`` tiny messages) unless the extra
    messages cost more than the ``⌈log2 n⌉ − 1`` rounds Bruck adds (a function of ``n``: agreed)."""
    steps = len(bruck_steps(n))
    return "direct" if (n - 2) * costs.count_msg_s <= (steps - 1) * costs.round_s else "bruck"


def count_schedule(n: int, rank: int, costs: "GatherCosts") -> list[tuple[list[Msg], list[Msg]]]:
    """The count phase's rounds (``Msg`` ranges are rows of the relative count table)."""
    return schedule(count_algo(n, costs), n, rank)


def count_rounds(n: int, costs: "GatherCosts") -> int:
    """Rounds of the count phase (1, or ``⌈log2 n⌉``)."""
    return 0 if n < 2 else (1 if count_algo(n, costs) == "direct" else len(bruck_steps(n)))


def schedule(algo: str, n: int, rank: int) -> list[tuple[list[Msg], list[Msg]]]:
    """The payload rounds of ``algo`` as ``(receives, sends)`` per round, for ``rank`` of ``n``."""
    if n == 1:
        return []
    if algo == "direct":
        return [([Msg((rank + i) % n, i, 1) for i in range(1, n)],
                 [Msg((rank - i) % n, 0, 1) for i in range(1, n)])]
    if algo == "ring":
        # Round k: receive block n−1−k from the predecessor, forward block (n−k) mod n (received in
        # round k−1; the own block in round 0) to the successor.
        return [([Msg((rank - 1) % n, n - 1 - k, 1)], [Msg((rank + 1) % n, (n - k) % n, 1)])
                for k in range(n - 1)]
    if algo in _RADIX:
        # To rank − j·D: this rank's first min(D, n − j·D) blocks (its own first), which that rank
        # places at j·D.
        return [([Msg((rank + d) % n, d, c) for d, c in step], [Msg((rank - d) % n, 0, c) for d, c in step])
                for step in radix_steps(n, _RADIX[algo])]
    raise ValueError(f"gather_impl ({algo!r}) must be one of {list(GATHER_IMPLS)}")


def arrival_order(algo: str, n: int) -> list[int]:
    """Relative blocks in the order their rounds deliver them (the own block, 0, first)."""
    if algo == "ring":
        return [0] + list(range(n - 1, 0, -1))
    return list(range(n))


def arrival_round(algo: str, n: int) -> list[int]:
    """``out[i]``: the payload round that completes relative block ``i`` (block 0: −1, no wire)."""
    out = [-1] * n
    for k, (recvs, _) in enumerate(schedule(algo, n, 0)):
        for m in recvs:
            for i in range(m.first, m.first + m.count):
                out[i] = k
    return out


def _round_loads(algo: str, nbytes: Sequence[float]) -> list[float]:
    """Per payload round, the busiest rank's bytes sent or received (plain Python: a choice reads no
    device value)."""
    n = len(nbytes)
    if algo == "direct":
        total = sum(nbytes)
        return [max(max(b * (n - 1), total - b) for b in nbytes)]
    if algo == "ring":
        return [max(nbytes)] * (n - 1)
    twice = [0.0]
    for b in list(nbytes) * 2:
        twice.append(twice[-1] + b)
    loads = []
    for step in radix_steps(n, _RADIX[algo]):
        sent = [sum(twice[x + c] - twice[x] for _, c in step) for x in range(n)]
        recv = [sum(twice[x + d + c] - twice[x + d] for d, c in step) for x in range(n)]
        loads.append(max(max(sent), max(recv)))
    return loads


def predict_s(algo: str, nbytes: Sequence[float], costs: GatherCosts) -> float:
    """α–β time of the payload phase: per round, ``round_s`` plus ``msg_s`` per message a rank handles
    beyond one each way, plus the busiest link's bytes; rounds add up (each waits for the last)."""
    n = len(nbytes)
    if n < 2:
        return 0.0
    extra_msgs = (n - 2) if algo == "direct" else (_RADIX[algo] - 2 if algo in _RADIX else 0)
    return sum(costs.round_s + extra_msgs * costs.msg_s + load / costs.bytes_per_s
               for load in _round_loads(algo, nbytes))


@functools.lru_cache(maxsize=64)
def _cheapest(nbytes: tuple, costs: GatherCosts) -> str:
    # Cached: every rank of a SimWorld (and every call of a steady training run) asks the same question.
    return min(("direct", "bruck", "bruck4"), key=lambda a: predict_s(a, nbytes, costs))


def choose(impl: str, nbytes: Sequence[float], costs: GatherCosts) -> str:
    """The payload algorithm: ``impl`` when forced, else the cheapest by ``predict_s`` (ties: ``direct``,
    the fewer rounds). A function of the counts every rank holds, so every rank picks the same."""
    if impl != "auto":
        if impl not in GATHER_IMPLS:
            raise ValueError(f"gather_impl ({impl!r}) must be one of {list(GATHER_IMPLS)}")
        return impl
    if len(nbytes) <= 2:
        return "direct"  # one round, one message each way: all three are the same
    return _cheapest(tuple(float(b) for b in nbytes), costs)


@dataclass
class GatherPlan:
    """What a started gather did: its payload algorithm and every rank's count (elements); ``caps``:
    every rank's block capacity when the counts travelled in the blocks (``comm/inline.py``), None when
    they had a round of their own."""

    algo: str
    counts: list[int]
    elem_bytes: int
    costs: GatherCosts = GatherCosts()
    caps: list[int] | None = None


def inline_block_bytes(caps: Sequence[float], elem_bytes: int) -> list[float]:
    """Every rank's block on the wire when the counts travel in the blocks (what ``choose`` weighs)."""
    return [inline_segment_bytes(c, elem_bytes) for c in caps]


def traffic(plan: GatherPlan, rank: int) -> tuple[int, int, int, int, int]:
    """``(bytes_sent, bytes_recv, msgs_sent, msgs_recv, rounds)`` of ``rank`` in ``plan``, both phases."""
    n = len(plan.counts)
    if n == 1:
        return 0, 0, 0, 0, 0
    sent = recv = ms = mr = 0
    esz = plan.elem_bytes
    counting = count_schedule(n, rank, plan.costs) if plan.caps is None else []
    for recvs, sends in counting:
        sent += sum(m.count for m in sends) * _COUNT_BYTES
        recv += sum(m.count for m in recvs) * _COUNT_BYTES
        ms += len(sends)
        mr += len(recvs)
    if plan.caps is None:
        rel = [plan.counts[(rank + i) % n] * esz for i in range(n)]
    else:  # every block carries its head, so no message is empty
        rel = [counted_bytes(plan.caps[(rank + i) % n], esz) for i in range(n)]
    rounds = schedule(plan.algo, n, rank)
    for recvs, sends in rounds:
        for m in sends:
            b = sum(rel[m.first:m.first + m.count])
            sent += b
            ms += b > 0
        for m in recvs:
            b = sum(rel[m.first:m.first + m.count])
            recv += b
            mr += b > 0
    overflow = 0
    if plan.caps is not None:
        # The rest of each payload that outgrew its block, from its rank to every peer, in one round.
        tails = [max(0, c - cap) * esz for c, cap in zip(plan.counts, plan.caps)]
        if any(tails):
            overflow = 1
            if tails[rank]:
                sent += (n - 1) * tails[rank]
                ms += n - 1
            recv += sum(b for j, b in enumerate(tails) if j != rank)
            mr += sum(1 for j, b in enumerate(tails) if j != rank and b)
    return sent, recv, ms, mr, len(counting) + len(rounds) + overflow
