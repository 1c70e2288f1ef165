"""Phase timings that stay honest on CUDA without adding host synchronizations to the hot path.

``time.perf_counter`` around asynchronous CUDA work measures only the launch, so the time of a phase
lands on whichever later phase happens to synchronize. ``PhaseTimer`` records a CUDA event at every
phase boundary instead and reads the elapsed times once, when the caller asks for them
(``write_into``), which costs one host synchronization per sync call, and only when timings are
wanted. On the CPU it is plain ``perf_counter``.
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """Seconds per named phase of one synchronization on ``device``.

    Example::

        >>> t = PhaseTimer(grad.device, enabled=timings is not None)  # doctest: +SKIP
        >>> t.start("hash_s"); ...; t.start("push_s"); ...; t.stop()  # doctest: +SKIP
        >>> t.write_into(timings)  # doctest: +SKIP
    """

    __slots__ = ("enabled", "cuda", "_marks", "_open")

    def __init__(self, device: torch.device | str, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object, object]] = []  # (phase, start mark, end mark)
        self._open: tuple[str, object] | None = None

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, phase: str) -> None:
        """Close the open phase (if any) and open ``phase``."""
        if not self.enabled:
            return
        m = self._mark()
        if self._open is not None:
            self._marks.append((self._open[0], self._open[1], m))
        self._open = (phase, m)

    def stop(self) -> None:
        """Close the open phase."""
        if not self.enabled or self._open is None:
            return
        self._marks.append((self._open[0], self._open[1], self._mark()))
        self._open = None

    def write_into(self, timings: dict | None) -> None:
        """Add each phase's seconds to ``timings`` (on CUDA: one synchronization on the last event)."""
        if not self.enabled or timings is None:
            return
        self.stop()
        if self.cuda and self._marks:
            self._marks[-1][2].synchronize()
        for phase, a, b in self._marks:
            sec = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            timings[phase] = timings.get(phase, 0.0) + sec
        self._marks = []
