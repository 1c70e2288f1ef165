"""The Communicator protocol every scheme talks to, with per-rank byte and message accounting.

Both implementations (``TorchCommunicator`` over torch.distributed, ``SimWorld`` ranks in one process)
count bytes with the same logical model below, so a scheme's traffic is identical in both:

* ``exchange_v``: each rank sends an int64 count to every peer, then one message per non-empty payload.
* ``all_gather_v``: an int64 size to every peer, then its payload to every peer (point to point).
* ``all_reduce``: a ring (reduce-scatter then all-gather): ``2·(n−1)/n`` of the buffer each way.
* ``broadcast``: the root sends the buffer to every peer.

Traffic to oneself is free and never counted.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

_COUNT_BYTES = 8


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_recv = self.msgs_sent = self.msgs_recv = 0

    def snapshot(self) -> "CommStats":
        return CommStats(**asdict(self))

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def as_dict(self) -> dict:
        return asdict(self)


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

    # --- public API -------------------------------------------------------------------------------
    def exchange_v(self, send: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Variable-size all-to-all: ``send[j]`` goes to rank ``j``; returns ``recv[j]`` from rank ``j``.

        All tensors are 1-D and of one dtype; counts travel first, then the payloads.
        """
        if len(send) != self.size:
            raise ValueError(f"exchange_v needs one tensor per rank ({self.size}), got {len(send)}")
        dtypes = {t.dtype for t in send}
        if len(dtypes) != 1 or any(t.dim() != 1 for t in send):
            raise ValueError(f"exchange_v tensors must be 1-D of one dtype, got {sorted(map(str, dtypes))}")
        send = [t.contiguous() for t in send]
        recv = self._exchange_v(send)
        peers = [j for j in range(self.size) if j != self.rank]
        self._account(sent=len(peers) * _COUNT_BYTES, recv=len(peers) * _COUNT_BYTES, msgs=len(peers))
        for j in peers:
            if send[j].numel():
                self._account(sent=_nbytes(send[j]), msgs_sent=1)
            if recv[j].numel():
                self._account(recv=_nbytes(recv[j]), msgs_recv=1)
        return recv

    def all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Variable-size all-gather of a 1-D tensor; sizes first, no padding on the wire."""
        if t.dim() != 1:
            raise ValueError(f"all_gather_v needs a 1-D tensor, got {t.dim()}-D")
        t = t.contiguous()
        out = self._all_gather_v(t)
        peers = [j for j in range(self.size) if j != self.rank]
        self._account(sent=len(peers) * _COUNT_BYTES, recv=len(peers) * _COUNT_BYTES, msgs=len(peers))
        if t.numel():
            self._account(sent=len(peers) * _nbytes(t), msgs_sent=len(peers))
        for j in peers:
            if out[j].numel():
                self._account(recv=_nbytes(out[j]), msgs_recv=1)
        return out

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``sum`` or ``max``); returns ``t``."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op ({op}) must be one of ['max', 'sum']")
        self._all_reduce(t, op)
        n = self.size
        if n > 1:
            ring = 2 * (n - 1) * _nbytes(t) // n
            self._account(sent=ring, recv=ring, msgs=2 * (n - 1))
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``; returns ``t``."""
        self._broadcast(t, src)
        if self.size > 1:
            if self.rank == src:
                self._account(sent=(self.size - 1) * _nbytes(t), msgs_sent=self.size - 1)
            else:
                self._account(recv=_nbytes(t), msgs_recv=1)
        return t

    def all_gather_object(self, obj) -> list:
        """All-gather a small picklable object (agreement checks, profiles); not counted as traffic."""
        import pickle

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        saved = self.stats.snapshot()
        parts = self.all_gather_v(data)
        # Restore in place: callers (SimWorld.stats) hold a reference to this CommStats object.
        for key, value in saved.as_dict().items():
            setattr(self.stats, key, value)
        return [pickle.loads(p.numpy().tobytes()) for p in parts]

    # --- accounting ---------------------------------------------------------------------------------
    def _account(self, sent: int = 0, recv: int = 0, msgs: int = 0, msgs_sent: int = 0, msgs_recv: int = 0):
        self.stats.bytes_sent += sent
        self.stats.bytes_recv += recv
        self.stats.msgs_sent += msgs + msgs_sent
        self.stats.msgs_recv += msgs + msgs_recv

    # --- transport ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _exchange_v(self, send: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @abc.abstractmethod
    def _all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    @abc.abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: str) -> None: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> None: ...
