"""The α–β network of the cost model and the time of measured traffic on it: one rank with full-duplex
links takes ``α·rounds + φ·(max(msgs_sent, msgs_recv) − rounds) + max(bytes_sent, bytes_recv)/B``
(each round waits for the last and pays the latency ``α``; messages beyond one per round travel at the
same time and each pays the flow cost ``φ``: per-message work, incast); a sync takes as long as its
slowest rank. Traffic without rounds (recorded before they were counted) pays ``α`` per message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..comm.base import CommStats


@dataclass(frozen=True)
class Network:
    """A uniform full-duplex network: ``bandwidth_gbps`` per link and direction, ``latency_us`` per round,
    ``flow_us`` per message beyond one in a round (``None``: the latency, as if each waited for the last)."""

    bandwidth_gbps: float = 10.0
    latency_us: float = 50.0
    flow_us: float | None = None

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"zen.bandwidth_gbps ({self.bandwidth_gbps!r}) must be > 0")
        if not self.latency_us >= 0:
            raise ValueError(f"zen.latency_us ({self.latency_us!r}) must be >= 0")
        if self.flow_us is not None and not self.flow_us >= 0:
            raise ValueError(f"zen.flow_us ({self.flow_us!r}) must be >= 0")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6

    @property
    def flow_s(self) -> float:
        return self.alpha_s if self.flow_us is None else self.flow_us * 1e-6

    def wire_s(self, rounds: float, msgs: float, bytes_s: float) -> float:
        """``α·rounds + φ·(msgs − rounds) + bytes_s`` (no rounds recorded: ``α·msgs + bytes_s``)."""
        if rounds <= 0:
            return self.alpha_s * msgs + bytes_s
        return self.alpha_s * rounds + self.flow_s * max(0.0, msgs - rounds) + bytes_s


def rank_time_s(stats: CommStats, net: Network) -> float:
    """One rank's time (the module docstring's formula)."""
    return net.wire_s(stats.rounds, max(stats.msgs_sent, stats.msgs_recv),
                      max(stats.bytes_sent, stats.bytes_recv) / net.bytes_per_s)


def modeled_time_s(stats: Sequence[CommStats], net: Network) -> float:
    """Time of a sync: the slowest rank's ``rank_time_s``."""
    return max((rank_time_s(s, net) for s in stats), default=0.0)
