"""α–β communication cost model: measured per-rank traffic → time, the paper's Eq. 1 and 2, and
per-scheme predictions from a sparsity profile (for the ``auto`` planner).

Time of one rank with full-duplex links: ``α·max(msgs_sent, msgs_recv) + max(bytes_sent, bytes_recv)/B``
(every message pays the latency ``α`` once; a rank sends and receives at the same time). A sync takes
as long as its slowest rank, so schemes are compared on the maximum over ranks — which is where an
imbalanced partition (Sparse PS, OmniReduce) pays.

The paper's closed forms (ZEN §2.3, COO with one word per index and per value, bandwidth ``b``):

* Eq. 1, Balanced Parallelism: ``T_bp = (n−1)/n · (γⁿ + 1) · 2·M·d / b``;
* Eq. 2, Hierarchical Centralization: ``T_hc = Σ_{i=1}^{log2 n} γ^{2^(i−1)} · 2·M·d / b``.

Each scheme's own predictors (``predict_traffic`` / ``predict_work``, next to its sync in
``core/<scheme>.py``) instead mirror its wire format and the Communicator's byte model (counts,
headers, index widths, the COO/bitmap/dense pull choice, SparCML's dense switch and folding) and
return predicted ``CommStats`` per rank, so a prediction and a SimWorld measurement go through the
same time formula and can be compared one to one (``tests/unit/test_planner.py``). This module finds
them through the scheme registry and turns them into times.

A ``SparsityProfile`` holds what they need, gathered from all ranks: exact per-rank entry counts per
server for each partition pattern, and hash-sampled index sets from which unions of any group of ranks
are estimated (sampling by h0 keeps the overlap structure: an index is in every rank's sample or in
none).

The parts of the model live one per module: ``network`` (α–β time of traffic), ``profile`` (sparsity
profiles), this module (closed forms, predictions), ``compute_model`` (calibrated rates),
``refinement`` (fits from measured syncs); ``core/cost.py`` defines the terms schemes predict in.

Legend: ``_P`` per server/rank, ``M`` dense elements, ``W`` row width, ``e`` bytes of one COO entry.
"""

from __future__ import annotations

import math

from ..comm.base import CommStats
from ..core.cost import WorkCounts
from ..core.registry import registered_schemes, scheme_class
from ..core.scheme import SyncScheme
from .compute_model import ComputeRates
from .network import Network, modeled_time_s
from .profile import SparsityProfile
from .refinement import Refinement, Wire


# --- the paper's closed forms --------------------------------------------------------------------
def eq1_balanced_parallelism_s(n: int, numel: int, density: float, gamma_n: float, bandwidth_gbps: float,
                               word_bytes: int = 4) -> float:
    """Paper Eq. 1: ``(n−1)/n · (γⁿ + 1) · 2·M·d / b`` (COO: one word per index and per value)."""
    return (n - 1) / n * (gamma_n + 1) * 2 * numel * density * word_bytes / (bandwidth_gbps * 1e9 / 8)


def eq2_hierarchical_centralization_s(n: int, numel: int, density: float, gammas: dict[int, float],
                                      bandwidth_gbps: float, word_bytes: int = 4) -> float:
    """Paper Eq. 2: ``Σ_{i=1}^{log2 n} γ^{2^(i−1)} · 2·M·d / b``; ``gammas[k]`` is ``γ^k`` (``γ¹ = 1``)."""
    rounds = int(math.log2(n)) if n > 1 else 0
    total = sum(gammas.get(1 << i, 1.0 if i == 0 else float("nan")) for i in range(rounds))
    return total * 2 * numel * density * word_bytes / (bandwidth_gbps * 1e9 / 8)


def prefers_balanced_parallelism(n: int, gammas: dict[int, float]) -> bool:
    """The paper's selection rule: Balanced Parallelism iff ``Σ γ^{2^(i−1)} > (n−1)/n·(γⁿ + 1)``."""
    rounds = int(math.log2(n)) if n > 1 else 0
    lhs = sum(gammas.get(1 << i, 1.0) for i in range(rounds))
    return lhs > (n - 1) / n * (gammas.get(n, 1.0) + 1)


# --- predictions ------------------------------------------------------------------------------------
def predict_stats(scheme: str, profile: SparsityProfile, options: dict | None = None,
                  first_call: bool = False) -> list[CommStats]:
    """Predicted per-rank ``CommStats`` of ``scheme`` (built with ``options``) on ``profile``: of a
    Synchronizer's steady step (counts carried in the payload), or with ``first_call`` of a call
    outside a Communicator slot (counts in a round of their own; ``core/cost.py``'s ``Traffic``).

    Raises:
        ValueError: no predictor for ``scheme`` (lists the ones there are).
    """
    traffic = cost_model_of(scheme).predict_traffic(profile, options or {})
    return traffic.first_stats if first_call else traffic.stats


def predict_time_s(scheme: str, profile: SparsityProfile, net: Network, options: dict | None = None) -> float:
    """``modeled_time_s`` of the predicted traffic."""
    return modeled_time_s(predict_stats(scheme, profile, options), net)


# --- the schemes' cost models ---------------------------------------------------------------------
def modeled_schemes() -> list[str]:
    """Registered schemes that declare a cost model, in registration order (built-ins first)."""
    return [s for s in registered_schemes() if scheme_class(s).has_cost_model()]


def cost_model_of(scheme: str) -> type[SyncScheme]:
    """The class of ``scheme``, whose ``wire_phases``, ``predict_traffic`` and ``predict_work`` are its
    cost model (declared next to its sync, ``core/scheme.py``).

    Raises:
        ValueError: ``scheme`` is unknown or declares no cost model (lists the ones that do).
    """
    if scheme not in registered_schemes() or not scheme_class(scheme).has_cost_model():
        raise ValueError(f"cost model scheme ({scheme!r}) must be one of {sorted(modeled_schemes())}")
    return scheme_class(scheme)


def compute_work(scheme: str, w: WorkCounts, options: dict | None = None) -> dict[str, dict[str, float]]:
    """Units of each primitive per phase of ``scheme`` on the slowest rank: ``{phase: {primitive: units}}``.

    Each model mirrors what its scheme's ``_sync`` does (``predict_work`` in core/<scheme>.py).

    Raises:
        ValueError: ``scheme`` declares no cost model.
    """
    if scheme not in registered_schemes() or not scheme_class(scheme).has_cost_model():
        raise ValueError(f"compute model scheme ({scheme!r}) must be one of {sorted(modeled_schemes())}")
    return scheme_class(scheme).predict_work(w, options or {})


def predict_phases_s(scheme: str, w: WorkCounts, wire: Wire, latency_s: float, rates: ComputeRates,
                     options: dict | None = None, refine: Refinement | None = None,
                     flow_s: float | None = None) -> dict[str, float]:
    """Predicted seconds per phase of ``scheme``: computation from ``compute_work`` × ``rates``, plus
    the α–β time ``latency_s · wire.rounds + flow_s · (wire.msgs − wire.rounds) + wire.bytes_s``
    (``network.Network.wire_s``; ``flow_s`` None: the latency) spread over the wire phases; with
    ``refine``, each computing phase and the wire phases together go through their fitted line."""
    net = Network(latency_us=latency_s * 1e6, flow_us=None if flow_s is None else flow_s * 1e6)
    wire_s = net.wire_s(wire.rounds, wire.msgs, wire.bytes_s)
    work = compute_work(scheme, w, options)
    wire_phases = cost_model_of(scheme).wire_phases
    out = {}
    for phase in dict.fromkeys([*work, *wire_phases]):
        units = work.get(phase, {})
        t = sum(getattr(rates, prim) * u for prim, u in units.items())
        if phase in wire_phases:
            t += wire_s / len(wire_phases)
        elif refine is not None:
            t = refine.apply(scheme, phase, t)
        out[phase] = t
    if refine is not None:
        raw = sum(out[k] for k in wire_phases)
        if raw > 0:
            scale = refine.apply(scheme, "wire", raw) / raw
            for k in wire_phases:
                out[k] *= scale
        else:
            for k in wire_phases:
                out[k] = refine.apply(scheme, "wire", 0.0) / len(wire_phases)
    return out


def predict_total_s(scheme: str, w: WorkCounts, wire: Wire, latency_s: float, rates: ComputeRates,
                    options: dict | None = None, refine: Refinement | None = None,
                    flow_s: float | None = None) -> float:
    """The sync's predicted wall time: the sum of ``predict_phases_s`` (phases run one after another)."""
    return sum(predict_phases_s(scheme, w, wire, latency_s, rates, options, refine, flow_s).values())
