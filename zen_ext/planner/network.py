"""The α–β network of the cost model and the time of measured traffic on it: one rank with full-duplex
links takes ``α·max(msgs_sent, msgs_recv) + max(bytes_sent, bytes_recv)/B``; a sync takes as long as
its slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..comm.base import CommStats


@dataclass(frozen=True)
class Network:
    """A uniform full-duplex network: ``bandwidth_gbps`` per link and direction, ``latency_us`` per message."""

    bandwidth_gbps: float = 10.0
    latency_us: float = 50.0

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"zen.bandwidth_gbps ({self.bandwidth_gbps!r}) must be > 0")
        if not self.latency_us >= 0:
            raise ValueError(f"zen.latency_us ({self.latency_us!r}) must be >= 0")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6


def rank_time_s(stats: CommStats, net: Network) -> float:
    """``α·max(msgs_sent, msgs_recv) + max(bytes_sent, bytes_recv)/B`` for one rank."""
    return (net.alpha_s * max(stats.msgs_sent, stats.msgs_recv)
            + max(stats.bytes_sent, stats.bytes_recv) / net.bytes_per_s)


def modeled_time_s(stats: Sequence[CommStats], net: Network) -> float:
    """Time of a sync: the slowest rank's ``rank_time_s``."""
    return max((rank_time_s(s, net) for s in stats), default=0.0)
