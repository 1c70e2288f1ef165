"""The candidates ``auto`` ranks, and how their predictions are averaged, tie-broken and shown.

One list (``candidate_schemes``) for the planner (``planner/auto.py``) and the at-scale prediction
(``analysis/at_scale.py``), so what a table predicts is what ``auto`` can run: lossless schemes with a
cost model only.
"""

from __future__ import annotations

import logging

from ..core.registry import registered_schemes, scheme_class
from .state import SliceState

logger = logging.getLogger("zen_ext.planner")
_SKIP_LOGGED: set[str] = set()
"""Lossless schemes ``candidate_schemes`` left out for want of a cost model (logged once each)."""


def candidate_schemes() -> list[str]:
    """The schemes ``auto`` ranks: registered lossless schemes with a cost model (``auto`` itself
    excluded), ties first. A lossy scheme (``spardl``) is never a candidate: ``auto`` promises the exact
    aggregate. A lossless scheme registered without a cost model is left out with a log line saying so,
    once. The one list of candidates: the planner's and the at-scale prediction's
    (``analysis/at_scale.py``)."""
    names = []
    for s in registered_schemes():
        if s == "auto" or not scheme_class(s).lossless:
            continue
        if scheme_class(s).has_cost_model():
            names.append(s)
        elif s not in _SKIP_LOGGED:
            _SKIP_LOGGED.add(s)
            logger.info("auto: scheme %r has no cost model, so auto never picks it (declare wire_phases, "
                        "predict_traffic and predict_work on its class; docs/extending.md)", s)
    return sorted(names, key=priority)


def mean_predictions(st: SliceState, candidates: tuple[str, ...]) -> dict[str, float]:
    return {c: sum(p[c] for p in st.predictions) / len(st.predictions) for c in candidates} if st.predictions \
        else {}


def candidates_text_of(mean: dict[str, float], choice: str, candidates: tuple[str, ...]) -> str:
    return ", ".join(f"{c}{'*' if c == choice else ''} {mean[c] * 1e3:.3f} ms" for c in candidates if c in mean)


def candidates_text(st: SliceState, candidates: tuple[str, ...]) -> str:
    return "candidates " + candidates_text_of(mean_predictions(st, candidates), st.choice, candidates)


def priority(name: str) -> int:
    """Ties go to the earlier registered scheme: dense first (no profile can make it slower than itself),
    then the built-ins in the registry's order (``core/registry.py``)."""
    order = registered_schemes()
    return order.index(name) if name in order else len(order)
