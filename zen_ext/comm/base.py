"""The Communicator protocol every scheme talks to, with per-rank byte and message accounting.

Both implementations (``TorchCommunicator`` over torch.distributed, ``SimWorld`` ranks in one process)
count bytes with the same logical model below, so a scheme's traffic is identical in both:

* ``exchange_v``: each rank sends an int64 count to every peer, then one message per non-empty payload
  (2 rounds). Inside a declared ``slot`` (a recurring, agreed call site: a Synchronizer bucket), from
  the second call on, the count travels in the payload message itself (1 round): see "Counts in the
  payload" below.
* ``all_gather_v``: the counts (8 bytes each, in one round, or ``⌈log2 n⌉`` Bruck rounds at a few
  hundred ranks and more), then the payloads in the rounds of the algorithm ``comm/gather.py`` picks
  (direct, ring or Bruck), each message counted with the blocks it really carries. Inside a slot, from
  the second call on, the counts travel in the blocks (no count round; see below).
* ``all_reduce``: a ring (reduce-scatter then all-gather): ``2·(n−1)/n`` of the buffer each way,
  ``2·(n−1)`` rounds.
* ``broadcast``: the root sends the buffer to every peer (1 round).
* ``sendrecv``: fixed-size point-to-point messages both sides size without a header (1 round).

``CommStats.rounds`` counts the communication rounds a rank waits through (each waits for the last).

Traffic to oneself is free and never counted. Checks are not traffic and are left out, like the
agreement payloads of ``all_gather_object``: the int64 call signature that travels next to each count
(so a header is 16 bytes on the wire) and ``dense``'s 8-byte signature all-gather.

**Device.** Every tensor a collective sees lives on ``comm.device`` (NCCL: the current CUDA device,
resolved when used; gloo and SimWorld: the CPU unless told otherwise): counts, headers, object gathers
and agreement payloads are built there, and a transport stages a payload from another device.

**Call signature.** ``SyncScheme.sync`` declares what it synchronizes (dense numel, dtype, op) with
``comm.signed(...)``. While declared, every header carries it and each receiver compares it with its
own before any payload moves, so ranks that pass different gradients get a RuntimeError naming both
ranks' values instead of a wrong sum or a hang. A sync whose first collective is an ``all_reduce`` or a
``broadcast`` (``dense``) checks it with one 8-byte all-gather first. Every rank receives every other
rank's signature, so when any two differ, every rank detects it at the same collective and raises.

**Counts in the payload** (``slot``). A receiver must post a receive of the exact size before a byte
arrives (NCCL and gloo have no probe), which is why a plain ``exchange_v`` sends the counts in a round
of their own. On the emulated cluster that round costs as much as a 300 KB payload round at 16 hosts
(``benchmarks/comm/results/count_round.md``). Where the same exchange recurs (every step syncs the same buckets),
the counts of its last call size the next one: inside ``with comm.slot(name):``, the k-th
``exchange_v`` sends peer ``j`` one message of ``inline_segment_bytes(cap)`` bytes, ``[count,
signature | the first min(count, cap) elements | zeros]``, where ``cap = next_capacity(the count this
pair carried in that call last time)`` (some headroom; 0 after an empty message). Both sides know
``cap`` without a message: it is a function of counts both saw on the wire, under a key both build
from the slot name, the signed call site and the ordinal (never from the data being exchanged, so
ranks that pass different gradients still exchange messages of matching sizes and then fail at the
signature check). A payload longer than its ``cap`` sends the rest in a second round between the two
ranks only. The k-th ``all_gather_v`` of a slot does the same with every rank's block: rank ``j``'s
block is ``[count, signature | first min(count, cap_j) elements | zeros]``, ``cap_j`` from the count
rank ``j`` gathered last time (every rank saw it), the payload rounds ``comm/gather.py``'s for those
block sizes, and a rank whose payload outgrew its block sends the rest to every peer in one more round
(every rank knows which did once the blocks are in). The first call of a key, and any call outside a
slot, uses the count round. The capacity rule and the segment layout: ``comm/inline.py``.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from . import gather
from .inline import COUNT_BYTES as _COUNT_BYTES, counted_bytes, next_capacity
_SIG_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
               torch.uint8, torch.int8, torch.int16, torch.bool)
_SIG_OPS = ("sum", "mean", "contributors")


def encode_signature(numel: int, dtype: torch.dtype, op: str) -> int:
    """One int64 word naming a sync call: bit 62 set, numel in bits 12..61, dtype in 4..11, op in 0..3."""
    d = _SIG_DTYPES.index(dtype) + 1 if dtype in _SIG_DTYPES else 255
    o = _SIG_OPS.index(op) + 1 if op in _SIG_OPS else 15
    return (1 << 62) | ((numel & ((1 << 50) - 1)) << 12) | (d << 4) | o


def describe_signature(word: int) -> str:
    """The inverse of ``encode_signature``, as text for error messages (0: outside any sync)."""
    if word == 0:
        return "no sync call (a different collective)"
    d, o = (word >> 4) & 0xFF, word & 0xF
    dtype = _SIG_DTYPES[d - 1] if 0 < d <= len(_SIG_DTYPES) else "another dtype"
    op = _SIG_OPS[o - 1] if 0 < o <= len(_SIG_OPS) else "another op"
    return f"numel {(word >> 12) & ((1 << 50) - 1)}, dtype {dtype}, op {op!r}"


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0
    rounds: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_recv = self.msgs_sent = self.msgs_recv = self.rounds = 0

    def snapshot(self) -> "CommStats":
        return CommStats(**asdict(self))

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def as_dict(self) -> dict:
        return asdict(self)


def backend_device(backend: str) -> torch.device:
    """The device a process group of ``backend`` takes tensors on (NCCL: the current CUDA device, read at
    each call; gloo and the rest: the CPU)."""
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GatherHandle:
    """A started ``all_gather_v``: each rank's message, yielded as it lands (``as_completed``).

    Lets a consumer (ZEN's pull decode) work on one server's partition while the others are still on
    the wire. ``waits[j]`` blocks until rank ``j``'s message is complete; ``finish`` runs the rest (the
    remaining rounds, which other ranks need this rank to forward) and runs even when the consumer
    stops early, so no request outlives the handle. ``order``: the peers in the order their messages
    arrive (default: ring order); ``plan``: the ``gather.GatherPlan`` the transport ran (accounting).
    """

    def __init__(self, rank: int, parts: list[torch.Tensor], waits: dict | None = None, finish=None,
                 order: list[int] | None = None, plan: "gather.GatherPlan | None" = None) -> None:
        self.rank = rank
        self.parts = parts
        self._waits = waits or {}
        self._finish = finish
        n = len(parts)
        self.order = order if order is not None else [(rank + s) % n for s in range(1, n)]
        self.plan = plan

    def as_completed(self):
        """Yield ``(rank, message)``: this rank's own first (no wire), then the peers as they arrive."""
        try:
            yield self.rank, self.parts[self.rank]
            for j in self.order:
                wait = self._waits.get(j)
                if wait is not None:
                    self.parts[j] = wait()
                yield j, self.parts[j]
        finally:
            if self._finish is not None:
                self._finish()
                self._finish = None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator(abc.ABC):
    """Collectives a sparse synchronization needs, on one group of ``size`` ranks.

    Subclasses implement the ``_`` methods; the public methods validate and account.
    """

    rank: int
    size: int

    def __init__(self) -> None:
        self.stats = CommStats()
        # The same counters per collective ("exchange_v", "all_gather_v", ...): which part of a sync's
        # traffic each collective is (benchmarks put ZEN's pull against its own link bound).
        self.op_stats: dict[str, CommStats] = {}
        self._sig_word = 0  # the declared sync call (0: none), see the module docstring
        self._sig_where = ""
        self._sig_checked = False
        self._slot: list | None = None  # [name, exchanges so far] while a slot is declared
        # (slot name, call site, ordinal) -> (send capacities, receive capacities) per peer, elements.
        self._capacities: dict[tuple, tuple[list[int], list[int]]] = {}
        # (slot name, call site, ordinal) -> every rank's block capacity of that all_gather_v, elements.
        self._gather_capacities: dict[tuple, list[int]] = {}

    # --- device and options -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where every tensor this communicator's collectives see lives (resolved at each use)."""
        return torch.device("cpu")

    def options(self) -> dict:
        """What shapes this communicator's collectives (transport, backend, device type).

        Ranks must agree on it: ``SyncScheme.check_agreement`` and the Synchronizer compare it.
        """
        return {"transport": type(self).__name__, "device_type": self.device.type}

    # --- call signature -----------------------------------------------------------------------------
    @contextmanager
    def signed(self, numel: int, dtype: torch.dtype, op: str, where: str):
        """Declare the sync call in progress (see the module docstring); nests, restoring the outer one."""
        saved = (self._sig_word, self._sig_where, self._sig_checked)
        self._sig_word, self._sig_where, self._sig_checked = encode_signature(numel, dtype, op), where, False
        try:
            yield
        finally:
            self._sig_word, self._sig_where, self._sig_checked = saved

    def _verify_signatures(self, words: Sequence[int]) -> None:
        """Raise RuntimeError unless every rank's signature word (``words[j]``: rank ``j``'s) is this rank's.

        Transports call it right after the header exchange, before any payload moves.
        """
        mine = self._sig_word
        self._sig_checked = True
        for j, w in enumerate(words):
            if j != self.rank and int(w) != mine:
                raise RuntimeError(
                    f"zen: ranks disagree on the gradient passed to {self._sig_where or 'a collective'}: rank "
                    f"{self.rank} has {describe_signature(mine)}, rank {j} has {describe_signature(int(w))}; "
                    f"every rank must synchronize the same numel, dtype and op")

    def _check_signature_first(self) -> None:
        """Before an all_reduce/broadcast that opens a declared sync: one small all-gather of the words."""
        if self._sig_word and not self._sig_checked and self.size > 1:
            self._verify_signatures(self._gather_words(self._sig_word))

    def _gather_words(self, word: int) -> list[int]:
        """All-gather one int64 per rank (subclasses override with one fixed-size collective)."""
        parts = self._all_gather_v(torch.tensor([word], dtype=torch.int64, device=self.device))
        return [int(p[0]) for p in parts]

    # --- slots -------------------------------------------------------------------------------------
    @contextmanager
    def slot(self, name):
        """Declare a recurring call site that every rank reaches in the same order (a Synchronizer's
        bucket): its exchanges carry their counts in the payload messages from their second call on
        (see "Counts in the payload" in the module docstring). ``name``: hashable, the same on every rank
        (never derived from gradient values). Nests, restoring the outer slot."""
        saved = self._slot
        self._slot = [name, 0]
        try:
            yield
        finally:
            self._slot = saved

    @property
    def in_slot(self) -> bool:
        """Whether a slot is declared: its recurring collectives carry their counts in the payload from
        their second call on (the planner prices that steady form then, the count round otherwise)."""
        return self._slot is not None

    def _slot_key(self) -> tuple | None:
        """The key of this call inside the declared slot (None outside one): the slot's name, the signed
        call site and the call's ordinal, agreed on every rank since they reach the slot's calls in the
        same order, and never derived from the data."""
        if self._slot is None or self.size == 1:
            return None
        key = (self._slot[0], self._sig_where, self._slot[1])
        self._slot[1] += 1
        return key

    # --- public API -------------------------------------------------------------------------------
    def exchange_v(self, send: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Variable-size all-to-all: ``send[j]`` goes to rank ``j``; returns ``recv[j]`` from rank ``j``.

        All tensors are 1-D and of one dtype. Counts travel in a round of their own, or, inside a
        ``slot`` that has seen this call before, in the payload messages (module docstring).
        """
        if len(send) != self.size:
            raise ValueError(f"exchange_v needs one tensor per rank ({self.size}), got {len(send)}")
        dtypes = {t.dtype for t in send}
        if len(dtypes) != 1 or any(t.dim() != 1 for t in send):
            raise ValueError(f"exchange_v tensors must be 1-D of one dtype, got {sorted(map(str, dtypes))}")
        send = [t.contiguous() for t in send]
        key = self._slot_key()
        caps = self._capacities.get(key) if key is not None else None
        peers = [j for j in range(self.size) if j != self.rank]
        if caps is None:
            recv = self._exchange_v(send)
            self._account(sent=len(peers) * _COUNT_BYTES, recv=len(peers) * _COUNT_BYTES, msgs=len(peers),
                          rounds=2 if peers else 0, op="exchange_v")
            for j in peers:
                if send[j].numel():
                    self._account(sent=_nbytes(send[j]), msgs_sent=1, op="exchange_v")
                if recv[j].numel():
                    self._account(recv=_nbytes(recv[j]), msgs_recv=1, op="exchange_v")
        else:
            recv = self._exchange_v_inline(send, *caps)
            self._account_inline(send, recv, *caps)
        if key is not None:
            self._capacities[key] = ([next_capacity(t.numel()) for t in send],
                                     [next_capacity(t.numel()) for t in recv])
        return recv

    def _account_inline(self, send, recv, send_caps: list[int], recv_caps: list[int]) -> None:
        """One count-carrying message per peer and direction (head and capacity, padding included: it is
        on the wire), then the overflow of the pairs whose payload outgrew its capacity, a second round
        for a rank that has any."""
        esz = send[0].element_size()
        overflow = False
        for j in (j for j in range(self.size) if j != self.rank):
            for t, cap, direction in ((send[j], send_caps[j], "sent"), (recv[j], recv_caps[j], "recv")):
                nb = counted_bytes(cap, esz)
                extra = max(0, t.numel() - cap) * esz
                overflow |= extra > 0
                self._account(**{direction: nb + extra}, **{f"msgs_{direction}": 1 + (extra > 0)}, op="exchange_v")
        self._account(rounds=2 if overflow else 1, op="exchange_v")

    def all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Variable-size all-gather of a 1-D tensor: counts first (checked), no padding on the wire, or,
        inside a ``slot`` that has seen this call before, counts in the payload blocks; the rounds are
        ``comm/gather.py``'s."""
        handle = self.all_gather_v_start(t)
        for _ in handle.as_completed():
            pass
        return handle.parts

    def all_gather_v_start(self, t: torch.Tensor) -> GatherHandle:
        """Start a variable-size all-gather of a 1-D tensor; its messages are read through the handle.

        Same wire and accounting as ``all_gather_v``; the first payload round is in flight when this
        returns, where the transport allows.
        """
        if t.dim() != 1:
            raise ValueError(f"all_gather_v_start needs a 1-D tensor, got {t.dim()}-D")
        t = t.contiguous()
        key = self._slot_key()
        caps = self._gather_capacities.get(key) if key is not None else None
        handle = self._all_gather_v_start(t) if caps is None else self._all_gather_v_start_inline(t, caps)
        if handle.plan is not None:
            sent, recv, ms, mr, rounds = gather.traffic(handle.plan, self.rank)
            self._account(sent=sent, recv=recv, msgs_sent=ms, msgs_recv=mr, rounds=rounds, op="all_gather_v")
            if key is not None:
                self._gather_capacities[key] = [next_capacity(c) for c in handle.plan.counts]
            return handle
        # A transport without a plan (tests' and benchmarks' wrappers): the direct algorithm's wire,
        # sizes in one header round.
        peers = [j for j in range(self.size) if j != self.rank]
        if peers:
            self._account(sent=len(peers) * _COUNT_BYTES, recv=len(peers) * _COUNT_BYTES, msgs=len(peers),
                          rounds=2)
        if t.numel():
            self._account(sent=len(peers) * _nbytes(t), msgs_sent=len(peers))
        for j in peers:
            if handle.parts[j].numel():
                self._account(recv=_nbytes(handle.parts[j]), msgs_recv=1)
        return handle

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``sum`` or ``max``); returns ``t``."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op ({op}) must be one of ['max', 'sum']")
        self._check_signature_first()
        self._all_reduce(t, op)
        n = self.size
        if n > 1:
            ring = 2 * (n - 1) * _nbytes(t) // n
            self._account(sent=ring, recv=ring, msgs=2 * (n - 1), rounds=2 * (n - 1))
        return t

    def reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum the ``size`` equal blocks of ``t`` (1-D, ``size·W`` elements) over the ranks: rank ``r``
        returns the sum of every rank's block ``r`` (``W`` elements; into ``out`` when given: no separate
        result buffer). Ring accounting: ``(n−1)·W`` elements each way."""
        n = self.size
        if t.dim() != 1 or t.numel() % n:
            raise ValueError(f"reduce_scatter needs a 1-D tensor of a multiple of {n} elements, got shape "
                             f"{tuple(t.shape)}")
        if out is not None and (out.shape != (t.numel() // n,) or out.dtype != t.dtype):
            raise ValueError(f"reduce_scatter out (shape {tuple(out.shape)}, {out.dtype}) must be 1-D of "
                             f"{t.numel() // n} elements of {t.dtype}")
        self._check_signature_first()
        res = self._reduce_scatter(t.contiguous(), out)
        out = res if out is None or res is out else out.copy_(res)
        if n > 1:
            nb = (n - 1) * _nbytes(out)
            self._account(sent=nb, recv=nb, msgs=n - 1, rounds=n - 1)
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (1-D, the same size on every rank) concatenated in rank order. Ring
        accounting: ``(n−1)·numel`` elements each way."""
        if t.dim() != 1:
            raise ValueError(f"all_gather needs a 1-D tensor, got {t.dim()}-D")
        self._check_signature_first()
        out = self._all_gather(t.contiguous())
        n = self.size
        if n > 1:
            nb = (n - 1) * _nbytes(t)
            self._account(sent=nb, recv=nb, msgs=n - 1, rounds=n - 1)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``; returns ``t``."""
        self._check_signature_first()
        self._broadcast(t, src)
        if self.size > 1:
            if self.rank == src:
                self._account(sent=(self.size - 1) * _nbytes(t), msgs_sent=self.size - 1, rounds=1)
            else:
                self._account(recv=_nbytes(t), msgs_recv=1, rounds=1)
        return t

    def sendrecv(self, sends: dict, recv_counts: dict, dtype: torch.dtype = torch.uint8) -> dict:
        """One round of point-to-point messages whose sizes both sides know without a header (a fixed
        schedule: SparDL's bags of ``k/P`` entries): ``sends[j]`` (1-D, ``dtype``) goes to rank ``j``,
        ``recv_counts[j]`` elements come from rank ``j``; one ``batch_isend_irecv``, no count round. The
        call signature is checked once before, as for ``all_reduce``. Every rank takes part."""
        if self.rank in sends or self.rank in recv_counts or any(t.dim() != 1 or t.dtype != dtype for t in sends.values()):
            raise ValueError(f"sendrecv needs 1-D {dtype} payloads to other ranks than this one ({self.rank})")
        self._check_signature_first()
        got = self._sendrecv({j: t.contiguous() for j, t in sends.items()}, dict(recv_counts), dtype)
        bad = [(j, got[j].numel(), c) for j, c in recv_counts.items() if got[j].numel() != c]
        if bad:
            raise RuntimeError(f"sendrecv: rank {self.rank} expected {bad[0][2]} elements from rank {bad[0][0]}, "
                               f"got {bad[0][1]} (a fixed schedule's sizes must agree on both sides)")
        esz = torch.empty(0, dtype=dtype).element_size()
        self._account(sent=sum(_nbytes(t) for t in sends.values()), recv=esz * sum(recv_counts.values()),
                      msgs_sent=sum(1 for t in sends.values() if t.numel()),
                      msgs_recv=sum(1 for c in recv_counts.values() if c), rounds=int(self.size > 1), op="sendrecv")
        return got

    def all_gather_object(self, obj) -> list:
        """All-gather a small picklable object (agreement checks, profiles); not counted as traffic."""
        import pickle

        # Built on the communicator's device: NCCL refuses CPU tensors.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        saved = self.stats.snapshot()
        saved_op = self.op_stats.get("all_gather_v", CommStats()).snapshot()
        saved_slot, self._slot = self._slot, None  # one-off sizes: the count round, not a slot's call
        try:
            parts = self.all_gather_v(data)
        finally:
            self._slot = saved_slot
        # Restore in place: callers (SimWorld.stats) hold a reference to this CommStats object.
        for key, value in saved.as_dict().items():
            setattr(self.stats, key, value)
        self.op_stats["all_gather_v"] = saved_op
        return [pickle.loads(p.cpu().numpy().tobytes()) for p in parts]

    # --- accounting ---------------------------------------------------------------------------------
    def _account(self, sent: int = 0, recv: int = 0, msgs: int = 0, msgs_sent: int = 0, msgs_recv: int = 0,
                 rounds: int = 0, op: str | None = None):
        for st in (self.stats, self.op_stats.setdefault(op, CommStats()) if op else None):
            if st is not None:
                st.rounds += rounds
                st.bytes_sent += sent
                st.bytes_recv += recv
                st.msgs_sent += msgs + msgs_sent
                st.msgs_recv += msgs + msgs_recv

    # --- transport ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _exchange_v(self, send: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def _exchange_v_inline(self, send: list[torch.Tensor], send_caps: list[int],
                           recv_caps: list[int]) -> list[torch.Tensor]:
        """The count-carrying exchange: ``send_caps[j]`` / ``recv_caps[j]`` elements reserved per peer (the
        same numbers on both sides of each pair). Transports without one run the two-round form (the
        accounting still counts the one-round wire)."""
        return self._exchange_v(send)

    @abc.abstractmethod
    def _all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    def _all_gather_v_start(self, t: torch.Tensor) -> GatherHandle:
        # Transports without asynchronous requests complete the whole gather here.
        return GatherHandle(self.rank, self._all_gather_v(t))

    def _all_gather_v_start_inline(self, t: torch.Tensor, caps: list[int]) -> GatherHandle:
        """The count-carrying gather: rank ``j``'s block is ``[count, signature | first min(count, caps[j])
        elements | zeros]`` (``caps`` the same list on every rank), the rounds ``comm/gather.py``'s for
        those block sizes, then one round in which each rank whose payload outgrew its capacity sends
        the rest to every peer (after the blocks every rank knows which did). The handle's plan carries
        ``caps``. Transports without one run the count round (their plan says so)."""
        return self._all_gather_v_start(t)

    def _sendrecv(self, sends: dict, recv_counts: dict, dtype: torch.dtype) -> dict:
        # Transports without one: through the variable-size exchange (its count round is not accounted).
        empty = torch.empty(0, dtype=dtype, device=self.device)
        recv = self._exchange_v([sends.get(j, empty) for j in range(self.size)])
        return {j: recv[j] for j in recv_counts}

    @abc.abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: str) -> None: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> None: ...

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # Transports without a native one: the blocks through the variable-size exchange, summed here
        # in rank order (the same order on every rank). ``out``: where to write it, when given.
        n = self.size
        if n == 1:
            return t.clone() if out is None else out.copy_(t)
        recv = self._exchange_v(list(t.view(n, -1)))
        out = recv[0].clone() if out is None else out.copy_(recv[0])
        for part in recv[1:]:
            out += part
        return out

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._all_gather_v(t)) if self.size > 1 else t.clone()
