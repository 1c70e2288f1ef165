"""α–β communication cost model: measured per-rank traffic → time, the paper's Eq. 1 and 2, and
per-scheme predictions from a sparsity profile (for the ``auto`` planner).

Time of one rank with full-duplex links: ``α·max(msgs_sent, msgs_recv) + max(bytes_sent, bytes_recv)/B``
(every message pays the latency ``α`` once; a rank sends and receives at the same time). A sync takes
as long as its slowest rank, so schemes are compared on the maximum over ranks — which is where an
imbalanced partition (Sparse PS, OmniReduce) pays.

The paper's closed forms (ZEN §2.3, COO with one word per index and per value, bandwidth ``b``):

* Eq. 1, Balanced Parallelism: ``T_bp = (n−1)/n · (γⁿ + 1) · 2·M·d / b``;
* Eq. 2, Hierarchical Centralization: ``T_hc = Σ_{i=1}^{log2 n} γ^{2^(i−1)} · 2·M·d / b``.

The predictors below instead mirror each scheme's wire format and the Communicator's byte model
(counts, headers, index widths, the COO/bitmap/dense pull choice, SparCML's dense switch and folding),
and return predicted ``CommStats`` per rank, so a prediction and a SimWorld measurement go through the
same time formula and can be compared one to one (``tests/unit/test_planner.py``).

A ``SparsityProfile`` holds what they need, gathered from all ranks: exact per-rank entry counts per
server for each partition pattern, and hash-sampled index sets from which unions of any group of ranks
are estimated (sampling by h0 keeps the overlap structure: an index is in every rank's sample or in
none).

The parts of the model live one per module: ``network`` (α–β time of traffic), ``profile`` (sparsity
profiles), this module (closed forms, traffic predictors, the per-scheme registry, predictions),
``compute_model`` (work counts and calibrated rates), ``refinement`` (fits from measured syncs).

Legend: ``_P`` per server/rank, ``M`` dense elements, ``W`` row width, ``e`` bytes of one COO entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..comm import gather
from ..comm.base import CommStats
from ..core.hashing import HashPartitioner
from ..core.types import index_dtype
from ..core.zen import _HEADER_BYTES, _FMT_BITMAP, _FMT_COO, _FMT_DENSE, pull_costs
# Profiles, the computation model and refinement live in their own modules; the names stay reachable
# as cost_model.<name>, where every caller looks them up.
from .compute_model import (PRIMITIVES, WIRE_PHASES, ComputeRates, WorkCounts, _time_best_s,  # noqa: F401
                            _work_agsparse, _work_dense, _work_omnireduce, _work_sparcml, _work_sparse_ps,
                            _work_zen, _work_zen_coo, calibrate_compute)
from .network import Network, modeled_time_s, rank_time_s  # noqa: F401
from .profile import (BLOCK_SIZE, LocalProfile, SparsityProfile, _block_ids, _counts_PP, _sample,  # noqa: F401
                      local_profile, profile_from_grads, sample_parts_for)
from .refinement import SHARED, Refinement, Wire  # noqa: F401

_COUNT_BYTES = 8  # the Communicator's int64 size/count per peer (comm/base.py)


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


# --- predicted traffic per scheme ----------------------------------------------------------------
class _Traffic:
    """Predicted ``CommStats`` of every rank, built with the Communicator's byte model (comm/base.py)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.stats = [CommStats() for _ in range(n)]

    def exchange_v(self, bytes_PP: torch.Tensor) -> None:
        """``bytes_PP[src, dst]``: payload bytes from ``src`` to ``dst``; counts go to every peer."""
        n = self.n
        bytes_PP = bytes_PP.to(torch.float64).clone()
        bytes_PP.fill_diagonal_(0)
        nonempty = bytes_PP > 0
        sent, recv = bytes_PP.sum(1).tolist(), bytes_PP.sum(0).tolist()
        msent, mrecv = nonempty.sum(1).tolist(), nonempty.sum(0).tolist()
        for r, s in enumerate(self.stats):
            s.bytes_sent += (n - 1) * _COUNT_BYTES + sent[r]
            s.bytes_recv += (n - 1) * _COUNT_BYTES + recv[r]
            s.msgs_sent += n - 1 + msent[r]
            s.msgs_recv += n - 1 + mrecv[r]
            s.rounds += 2 if n > 1 else 0

    def all_gather_v(self, sizes: Sequence[float], impl: str = "auto") -> None:
        """``sizes[r]``: rank ``r``'s payload bytes; the rounds ``comm/gather.py`` runs for them (the
        algorithm its ``choose`` picks with the default costs, as the communicators do)."""
        plan = gather.GatherPlan(gather.choose(impl, sizes, gather.GatherCosts()), list(sizes), 1)
        for r, s in enumerate(self.stats):
            sent, recv, ms, mr, rounds = gather.traffic(plan, r)
            s.bytes_sent += sent
            s.bytes_recv += recv
            s.msgs_sent += ms
            s.msgs_recv += mr
            s.rounds += rounds

    def all_reduce(self, nbytes: int) -> None:
        n = self.n
        if n > 1:
            ring = 2 * (n - 1) * nbytes // n
            for s in self.stats:
                s.bytes_sent += ring
                s.bytes_recv += ring
                s.msgs_sent += 2 * (n - 1)
                s.msgs_recv += 2 * (n - 1)
                s.rounds += 2 * (n - 1)


def _predict_dense(p: SparsityProfile, opts: dict) -> _Traffic:
    tr = _Traffic(p.n)
    tr.all_reduce(p.numel * p.row_width * p.value_bytes)
    return tr


def _predict_agsparse(p: SparsityProfile, opts: dict) -> _Traffic:
    tr = _Traffic(p.n)
    tr.all_gather_v([q.raw_nnz * p.entry_bytes for q in p.locals])
    return tr


def _predict_zen(p: SparsityProfile, opts: dict) -> _Traffic:
    n, tr = p.n, _Traffic(p.n)
    vsz = p.row_width * p.value_bytes
    # Push: COO per server, or the server's whole partition dense once that is not larger (zen.py).
    part_P = torch.tensor([max(0, (p.numel - j + n - 1) // n) for j in range(n)], dtype=torch.float64)
    coo_PP = _counts_PP(p, "hash_counts") * p.entry_bytes
    dense_PP = (part_P * vsz).expand(n, n)
    tr.exchange_v(torch.where((coo_PP > 0) & (coo_PP >= dense_PP), dense_PP, coo_PP))
    # Pull: h0 balances the union, so each server holds ~|U|/n (exact per server when unsampled).
    if p.sample_parts == 1:
        union = p._union_set(tuple(range(n)), False)
        per_server = torch.bincount(HashPartitioner(p.numel, n, p.seed).partition_of(union), minlength=n).tolist()
    else:
        per_server = [p.union(range(n)) / n] * n
    fmt = opts.get("pull_format", "auto")

    def body(i: int) -> float:
        part = max(0, (p.numel - i + n - 1) // n)
        costs = pull_costs(int(round(per_server[i])), part, p.index_bytes, vsz)
        if fmt == "auto":
            return min(costs.values())
        return costs[{"coo": _FMT_COO, "bitmap": _FMT_BITMAP, "dense": _FMT_DENSE}[fmt]]

    tr.all_gather_v([_HEADER_BYTES + body(i) for i in range(n)])
    return tr


def _predict_zen_coo(p: SparsityProfile, opts: dict) -> _Traffic:
    return _predict_zen(p, {**opts, "pull_format": "coo"})


def _predict_range_ps(p: SparsityProfile, counts_PP: torch.Tensor, union_per_range: list[float],
                      entry_bytes: float) -> _Traffic:
    tr = _Traffic(p.n)
    tr.exchange_v(counts_PP * entry_bytes)
    tr.all_gather_v([u * entry_bytes for u in union_per_range])
    return tr


def _predict_sparse_ps(p: SparsityProfile, opts: dict) -> _Traffic:
    return _predict_range_ps(p, _counts_PP(p, "range_counts"), p.union_per_range(), p.entry_bytes)


def _predict_omnireduce(p: SparsityProfile, opts: dict) -> _Traffic:
    block_size = opts.get("block_size", p.block_size)
    if block_size != p.block_size:
        raise ValueError(f"omnireduce block_size ({block_size}) must equal the profile's ({p.block_size})")
    idx_bytes = torch.empty(0, dtype=index_dtype(p.num_blocks)).element_size()
    return _predict_range_ps(p, _counts_PP(p, "block_counts"), p.union_per_range(blocks=True),
                             idx_bytes + block_size * p.value_bytes)


def _predict_sparcml(p: SparsityProfile, opts: dict) -> _Traffic:
    n, tr = p.n, _Traffic(p.n)
    dense_bytes = p.numel * p.row_width * p.value_bytes

    def stream_bytes(group: Sequence[int]) -> float:
        coo = p.union(group) * p.entry_bytes
        return dense_bytes if coo >= dense_bytes else coo

    def step(pairs: dict[int, tuple[int, Sequence[int]]]) -> None:
        # pairs[src] = (dst, group whose aggregate src sends)
        bytes_PP = torch.zeros(n, n, dtype=torch.float64)
        for src, (dst, group) in pairs.items():
            bytes_PP[src, dst] = stream_bytes(group)
        tr.exchange_v(bytes_PP)

    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    groups = {r: (r,) for r in range(n)}
    if rem:
        step({r: (r + 1, groups[r]) for r in range(0, 2 * rem, 2)})
        for r in range(1, 2 * rem, 2):
            groups[r] = (r - 1, r)
    real = [2 * v + 1 if v < rem else v + rem for v in range(p2)]
    mask = 1
    while mask < p2:
        step({real[v]: (real[v ^ mask], groups[real[v]]) for v in range(p2)})
        groups = {**groups, **{real[v]: tuple(sorted(groups[real[v]] + groups[real[v ^ mask]])) for v in range(p2)}}
        mask <<= 1
    if rem:
        step({r: (r - 1, tuple(range(n))) for r in range(1, 2 * rem, 2)})
    return tr


def predict_stats(scheme: str, profile: SparsityProfile, options: dict | None = None) -> list[CommStats]:
    """Predicted per-rank ``CommStats`` of ``scheme`` (built with ``options``) on ``profile``.

    Raises:
        ValueError: no predictor for ``scheme`` (lists the ones there are).
    """
    return cost_model_of(scheme).traffic(profile, options or {}).stats


def predict_time_s(scheme: str, profile: SparsityProfile, net: Network, options: dict | None = None) -> float:
    """``modeled_time_s`` of the predicted traffic."""
    return modeled_time_s(predict_stats(scheme, profile, options), net)


# --- the registry: one cost model per scheme ------------------------------------------------------
@dataclass(frozen=True)
class SchemeCostModel:
    """What ``auto`` needs to know about a scheme to predict its sync time.

    Attributes:
        traffic: ``(profile, options) → _Traffic``: the bytes and messages each rank sends and receives
            (record them with ``_Traffic.exchange_v`` / ``all_gather_v`` / ``all_reduce``).
        work: ``(WorkCounts, options) → {phase: {primitive: units}}``: the computation per phase on the
            slowest rank, in ``ComputeRates`` primitives (``fill_s_per_byte``, ``scatter_s_per_elem``, ...).
        wire_phases: the phases (keys of the scheme's timings) whose time is the wire's.
    """

    traffic: Callable[["SparsityProfile", dict], _Traffic]
    work: Callable[[WorkCounts, dict], dict]
    wire_phases: tuple[str, ...]


COST_MODELS: dict[str, SchemeCostModel] = {}
"""Scheme name → its cost model; ``auto`` considers the registered lossless schemes found here."""
PREDICTORS = COST_MODELS  # the older name: ``name in PREDICTORS`` asks whether the model knows a scheme


def register_cost_model(name: str, *, traffic, work, wire_phases: Sequence[str]) -> None:
    """Declare how the cost model predicts scheme ``name`` (see ``SchemeCostModel``); the scheme itself
    registers with ``@register_scheme``. Re-registering a name replaces its model.

    Raises:
        ValueError: ``wire_phases`` is empty, or ``traffic`` / ``work`` is not callable.
    """
    if not wire_phases:
        raise ValueError(f"cost model of {name!r}: wire_phases must name at least one phase")
    if not (callable(traffic) and callable(work)):
        raise ValueError(f"cost model of {name!r}: traffic and work must be callables")
    COST_MODELS[name] = SchemeCostModel(traffic, work, tuple(wire_phases))


def cost_model_of(scheme: str) -> SchemeCostModel:
    """The registered cost model of ``scheme``.

    Raises:
        ValueError: none is registered (lists the ones there are).
    """
    if scheme not in COST_MODELS:
        raise ValueError(f"cost model scheme ({scheme!r}) must be one of {sorted(COST_MODELS)}")
    return COST_MODELS[scheme]


for _name, _traffic, _work, _wire in (
        ("dense", _predict_dense, _work_dense, ("comm_s",)),
        ("zen", _predict_zen, _work_zen, ("push_s", "pull_s")),
        ("zen_coo", _predict_zen_coo, _work_zen_coo, ("push_s", "pull_s")),
        ("agsparse", _predict_agsparse, _work_agsparse, ("allgather_s",)),
        ("sparse_ps", _predict_sparse_ps, _work_sparse_ps, ("push_s", "pull_s")),
        ("omnireduce", _predict_omnireduce, _work_omnireduce, ("push_s", "pull_s")),
        ("sparcml", _predict_sparcml, _work_sparcml, ("rounds_s",))):
    register_cost_model(_name, traffic=_traffic, work=_work, wire_phases=_wire)


def compute_work(scheme: str, w: WorkCounts, options: dict | None = None) -> dict[str, dict[str, float]]:
    """Units of each primitive per phase of ``scheme`` on the slowest rank: ``{phase: {primitive: units}}``.

    Each model mirrors what its scheme's ``_sync`` does (core/*.py).

    Raises:
        ValueError: no cost model is registered for ``scheme``.
    """
    if scheme not in COST_MODELS:
        raise ValueError(f"compute model scheme ({scheme!r}) must be one of {sorted(COST_MODELS)}")
    return COST_MODELS[scheme].work(w, options or {})


def predict_phases_s(scheme: str, w: WorkCounts, wire: Wire, latency_s: float, rates: ComputeRates,
                     options: dict | None = None, refine: Refinement | None = None) -> dict[str, float]:
    """Predicted seconds per phase of ``scheme``: computation from ``compute_work`` × ``rates``, plus
    the α–β time ``wire.msgs · latency_s + wire.bytes_s`` spread over the wire phases; with
    ``refine``, each computing phase and the wire phases together go through their fitted line."""
    work = compute_work(scheme, w, options)
    wire_phases = cost_model_of(scheme).wire_phases
    out = {}
    for phase in dict.fromkeys([*work, *wire_phases]):
        units = work.get(phase, {})
        t = sum(getattr(rates, prim) * u for prim, u in units.items())
        if phase in wire_phases:
            t += (wire.msgs * latency_s + wire.bytes_s) / len(wire_phases)
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
                    options: dict | None = None, refine: Refinement | None = None) -> float:
    """The sync's predicted wall time: the sum of ``predict_phases_s`` (phases run one after another)."""
    return sum(predict_phases_s(scheme, w, wire, latency_s, rates, options, refine).values())
