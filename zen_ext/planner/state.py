"""What ``auto`` (``auto.py``) keeps per slice and per rank, in a form its ``state_dict`` saves: a
slice's planning state (``SliceState``: profiling syncs seen, predictions, the choice and why); a rank's
calibration is ``calibration.Calibration``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..core.cost import WorkCounts
from .refinement import Wire


@dataclass
class SliceState:
    """One slice's planning state on one rank."""

    profiled: int = 0
    predictions: list[dict[str, float]] = field(default_factory=list)
    since_decision: int = 0
    choice: str | None = None
    reason: str = ""
    # The latest profile's model inputs of the chosen scheme (refinement compares real syncs with them).
    work: WorkCounts | None = None
    wire: Wire | None = None
    # The last profiling sync measured a candidate: its predictions predate that measurement.
    stale: bool = False
    # Per candidate, the fastest of its measured syncs of this slice on this rank (seconds, its
    # phases summed; a scheme's first run on the rank is cold and not counted).
    measured: dict[str, float] = field(default_factory=dict)

    def state(self) -> dict:
        return {"profiled": self.profiled, "predictions": [dict(p) for p in self.predictions],
                "since_decision": self.since_decision, "choice": self.choice, "reason": self.reason,
                "stale": self.stale, "measured": dict(self.measured),
                "work": dataclasses.asdict(self.work) if self.work is not None else None,
                "wire": dataclasses.asdict(self.wire) if self.wire is not None else None}

    @classmethod
    def from_state(cls, st: dict) -> "SliceState":
        return cls(profiled=int(st["profiled"]), predictions=[dict(p) for p in st["predictions"]],
                   since_decision=int(st["since_decision"]), choice=st["choice"], reason=st["reason"],
                   work=WorkCounts(**st["work"]) if st.get("work") else None,
                   wire=Wire(**st["wire"]) if st.get("wire") else None, stale=bool(st.get("stale", False)),
                   measured={k: float(v) for k, v in st.get("measured", {}).items()})
