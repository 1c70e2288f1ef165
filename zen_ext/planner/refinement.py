"""What real syncs teach the cost model (``cost_model.py``): the α–β inputs of one measured sync
(``Wire``) and, per scheme and phase, a fitted line ``measured ≈ slope · predicted + offset``
(``Refinement``) that the planner applies to later predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


from ..comm.base import CommStats
from ..core.registry import scheme_class
from .network import Network


@dataclass(frozen=True)
class Wire:
    """The α–β inputs of one sync on its slowest rank: messages, seconds of bytes at the link rate, and
    rounds (``network.Network.wire_s`` prices them)."""

    msgs: float
    bytes_s: float
    rounds: float = 0.0

    @classmethod
    def of(cls, stats: Sequence[CommStats], net: Network) -> "Wire":
        msgs = max((max(s.msgs_sent, s.msgs_recv) for s in stats), default=0)
        nbytes = max((max(s.bytes_sent, s.bytes_recv) for s in stats), default=0)
        rounds = max((s.rounds for s in stats), default=0)
        return cls(float(msgs), nbytes / net.bytes_per_s, float(rounds))


SHARED = "*"  # the Refinement's fits shared by every scheme


@dataclass
class Refinement:
    """What real syncs taught the model: per scheme and phase, ``measured ≈ slope · predicted + offset``.

    The fit is a least-squares line through the (predicted, measured) pairs of the syncs seen
    (exponentially decayed by ``decay`` per observation, so the model follows a drifting machine). The
    offset catches what scales with nothing the model counts (Python and allocator work per phase,
    per-message costs of the transport above the probe's latency), which dominates small syncs; the
    slope catches rates that differ from the micro-benchmark's. The wire phases of a scheme are fitted
    together (``"wire"``: the α–β time plus the computation inside them). Observations of one input
    size give an offset (an excess) or a ratio below 1 (a shortfall), never a ratio above 1 that
    larger syncs would inherit.

    Every observation also feeds two shared fits (scheme ``"*"``): ``"wire"`` and ``"compute"`` (all
    computing phases). A scheme's phase that was never measured uses them, so a planner that runs one
    scheme corrects the others by the same measured network and machine instead of comparing a
    corrected prediction with uncorrected ones (which would favor whatever it did not run).
    """

    decay: float = 0.9
    fits: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def apply(self, scheme: str, phase: str, predicted_s: float) -> float:
        """The refined prediction of one phase (or ``"wire"``) of ``scheme``.

        Never below the prediction scaled by the fit's ratio at its mean input (capped at 1): a line
        fitted on syncs of similar size can be nearly flat (a slope near 0 and the mean as offset), and
        extrapolated to a much larger sync it predicted the size of the small ones (the shared wire fit
        of 25–30 ms ZEN/AGsparse syncs put a 1.1 s dense all-reduce at 40 ms, and ``auto`` ran dense).
        """
        st = self.fits.get(scheme, {}).get(phase)
        if st is None:
            st = self.fits.get(SHARED, {}).get("wire" if phase == "wire" else "compute")
        if st is None:
            return predicted_s
        slope, offset = _line(st)
        mx = st[1] / st[0] if st[0] > 0 else 0.0
        floor = predicted_s * min(1.0, (slope * mx + offset) / mx) if mx > 0 else 0.0
        return max(slope * predicted_s + offset, floor)

    def observe(self, scheme: str, predicted: dict[str, float], measured: dict) -> None:
        """Fold one sync's ``timings`` (phase → seconds) into the fits of ``scheme``.

        ``predicted`` is ``predict_phases_s`` without refinement (its wire phases, the scheme's
        ``wire_phases``, include the α–β time); non-numeric or missing phases are skipped.
        """
        wire_phases = scheme_class(scheme).wire_phases
        wire = [k for k in predicted if k in wire_phases]
        pairs = [(k, predicted[k], measured.get(k)) for k in predicted if k not in wire_phases]
        if wire and all(isinstance(measured.get(k), (int, float)) for k in wire):
            pairs.append(("wire", sum(predicted[k] for k in wire), sum(float(measured[k]) for k in wire)))
        for k, x, y in pairs:
            if not isinstance(y, (int, float)) or not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
                continue
            for owner, key in ((scheme, k), (SHARED, "wire" if k == "wire" else "compute")):
                st = self.fits.setdefault(owner, {}).setdefault(key, [0.0] * 5)  # weight, Σx, Σy, Σxx, Σxy
                for i in range(5):
                    st[i] *= self.decay
                st[0] += 1.0
                st[1] += x
                st[2] += y
                st[3] += x * x
                st[4] += x * y

    def state(self) -> dict:
        return {"fits": {s: {k: list(v) for k, v in ph.items()} for s, ph in self.fits.items()}}

    def load(self, st: dict) -> None:
        self.fits = {s: {k: [float(x) for x in v] for k, v in ph.items()} for s, ph in st.get("fits", {}).items()}

    def merge_max(self, states: Sequence[dict]) -> None:
        """Agree across ranks (``states``: every rank's ``state()``, in rank order): per scheme, every
        phase fit of the rank whose fits predict the most in total at their mean inputs (the slowest
        rank sets the pace of a sync; ties go to the lower rank); a phase that rank never measured
        comes from the rank predicting the most for it.

        Whole ranks, not phase by phase: a sync's waiting moves between phases from rank to rank (a
        fast rank waits in the exchange that a slow rank reaches late), so the per-phase maxima of
        different ranks add up to more than any rank's sync (on the 4-host lab the per-phase merge
        predicted zen, of five phases, at 2.6x its measured sync and AGsparse, of two, at 0.9x, and
        the planner chose AGsparse)."""
        merged: dict[str, dict[str, list[float]]] = {}
        schemes = dict.fromkeys(s for st in states for s in st.get("fits", {}))
        for s in schemes:
            per_rank = [st.get("fits", {}).get(s, {}) for st in states]
            totals = [sum(_line_at_mean(v) for v in ph.values()) for ph in per_rank]
            win = max(range(len(per_rank)), key=lambda r: (totals[r], -r))
            out = {k: [float(x) for x in v] for k, v in per_rank[win].items()}
            for ph in per_rank:
                for k, v in ph.items():
                    if k not in per_rank[win] and (k not in out or _line_at_mean(v) > _line_at_mean(out[k])):
                        out[k] = [float(x) for x in v]
            merged[s] = out
        self.fits = merged


def _line(st: Sequence[float]) -> tuple[float, float]:
    """``(slope, offset)`` of the decayed least-squares fit, both >= 0."""
    w, sx, sy, sxx, sxy = st
    if w <= 0:
        return 1.0, 0.0
    det = w * sxx - sx * sx
    if det > 1e-12 * max(1e-30, w * sxx):
        slope = (w * sxy - sx * sy) / det
        offset = (sy - slope * sx) / w
        if slope >= 0 and offset >= 0:
            return slope, offset
        if slope < 0:
            return 0.0, sy / w
    # One distinct input (or a negative offset). A measured excess is taken as an offset, not a ratio:
    # the first syncs are often small and dominated by fixed per-call costs, and a ratio learned there
    # would multiply every larger sync's prediction (a 4 KB all-reduce taking 10x its α–β time made a
    # 4 MB one predict 50x too long). A measured shortfall scales down (a slower-than-real model).
    mx, my = sx / w, sy / w
    if my >= mx:
        return 1.0, my - mx
    return (my / mx if mx > 0 else 1.0), 0.0


def _line_at_mean(st: Sequence[float]) -> float:
    slope, offset = _line(st)
    return slope * (st[1] / st[0] if st[0] > 0 else 0.0) + offset
