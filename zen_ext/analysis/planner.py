"""``auto``: pick the fastest lossless scheme per gradient slice from profiled sparsity (ZEN paper §2.3).

ZEN "collects the lightweight sparsity profiling results of the first few iterations and determines
the optimal scheme by comparing Equations (1) and (2)". This planner does the same with the full α–β
predictions of ``cost_model`` (which know each scheme's wire format and the configured bandwidth and
latency) and with dense all-reduce among the candidates, so a dense gradient is never made slower.

Per slice ``key``:

* the first ``profile_steps`` syncs (and again every ``reprofile_every`` syncs) profile: every rank
  all-gathers a small summary of its gradient (3·n counts and an h0-sampled index set of at most
  ``sample_budget`` entries, from which density and γ at 2, 4, …, n are estimated), every candidate's
  time is predicted, and the candidate with the lowest mean prediction over the profiled syncs wins;
* every sync runs the current winner — all candidates are lossless, so profiling syncs also return the
  exact aggregate;
* the choice is computed from all-gathered data, hence the same everywhere, and then checked: the
  ranks all-gather (key, choice, options) and raise ``RuntimeError`` naming the rank and both values on
  any difference instead of running mismatched collectives.

The profile travels through ``Communicator.all_gather_object``, which the byte counters leave out; it is
``O(n + sample_budget)`` per rank and runs on profiling syncs only. Each change of a slice's choice is
logged once (rank 0, logger ``zen_ext.planner``) with its reason; ``last_choice(key)`` returns it.

Tuning: ``bandwidth_gbps``/``latency_us`` describe the data-parallel links (the inter-node NIC);
``profile_steps`` 3 is enough for gradients whose sparsity drifts slowly; lower ``reprofile_every`` if
it drifts fast (e.g. curriculum changes).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field

import torch

from ..comm.base import Communicator
from ..core.scheme import SyncScheme, available_schemes, build_scheme, register_scheme
from ..core.types import SparseGrad, as_sparse
from . import cost_model as cm

logger = logging.getLogger("zen_ext.planner")

# Ties go to the simpler scheme: dense first (no profile can make it slower than itself).
_PRIORITY = ("dense", "zen", "sparcml", "zen_coo", "agsparse", "omnireduce", "sparse_ps")


@dataclass
class _SliceState:
    """One slice's planning state on one rank."""

    profiled: int = 0
    predictions: list[dict[str, float]] = field(default_factory=list)
    since_decision: int = 0
    choice: str | None = None
    reason: str = ""


@register_scheme
class AutoScheme(SyncScheme):
    """Per-slice choice among lossless schemes by predicted α–β time (see the module docstring).

    Args:
        bandwidth_gbps: link bandwidth per direction, Gbit/s.
        latency_us: per-message latency, µs.
        profile_steps: syncs of a slice that are profiled before its choice is final (>= 1).
        reprofile_every: syncs of a slice between re-profilings (0: never re-profile).
        candidates: scheme names to choose from (default: every registered lossless scheme the cost
            model knows, ``dense`` included).
        seed: hash seed passed to the candidates that take one (``zen``, ``zen_coo``).
        sample_budget: indices per rank in the profile's sample (more: better estimates of γ).
    """

    name = "auto"

    def __init__(
        self,
        bandwidth_gbps: float = 10.0,
        latency_us: float = 50.0,
        profile_steps: int = 3,
        reprofile_every: int = 1000,
        candidates: list[str] | tuple[str, ...] | None = None,
        seed: int = 0,
        sample_budget: int = 2048,
    ) -> None:
        self.network = cm.Network(float(bandwidth_gbps), float(latency_us))
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"zen.profile_steps ({profile_steps!r}) must be an int >= 1")
        if not isinstance(reprofile_every, int) or reprofile_every < 0:
            raise ValueError(f"zen.reprofile_every ({reprofile_every!r}) must be an int >= 0 (0: never)")
        if not isinstance(sample_budget, int) or sample_budget < 1:
            raise ValueError(f"zen.sample_budget ({sample_budget!r}) must be an int >= 1")
        valid = self.valid_candidates()
        if candidates is None:
            candidates = valid
        if isinstance(candidates, str) or not candidates:
            raise ValueError(f"zen.candidates ({candidates!r}) must be a non-empty list of {valid}")
        unknown = [c for c in candidates if c not in valid]
        if unknown:
            raise ValueError(f"zen.candidates ({list(candidates)!r}) must be a subset of {valid}; "
                             f"unknown or unsupported: {unknown}")
        self.profile_steps = profile_steps
        self.reprofile_every = reprofile_every
        self.seed = int(seed)
        self.sample_budget = sample_budget
        self.candidates = tuple(sorted(dict.fromkeys(candidates), key=_priority))
        self._schemes = {c: self._build(c) for c in self.candidates}
        self._states: dict[tuple[str, int], _SliceState] = {}

    @staticmethod
    def valid_candidates() -> list[str]:
        """Registered lossless schemes with a cost-model predictor (``auto`` itself excluded)."""
        names = [s for s in available_schemes() if s in cm.PREDICTORS]
        return sorted((s for s in names if build_scheme(s).lossless), key=_priority)

    def options(self) -> dict:
        return dict(bandwidth_gbps=self.network.bandwidth_gbps, latency_us=self.network.latency_us,
                    profile_steps=self.profile_steps, reprofile_every=self.reprofile_every,
                    candidates=list(self.candidates), seed=self.seed, sample_budget=self.sample_budget)

    def last_choice(self, key: str) -> tuple[str, str] | None:
        """``(scheme name, reason)`` of the latest choice for slice ``key``, or None before its first sync."""
        for (k, _), st in self._states.items():
            if k == key and st.choice is not None:
                return st.choice, st.reason
        return None

    def decisions(self) -> dict[str, str]:
        """``{key: scheme name}`` for every slice seen so far."""
        return {k: st.choice for (k, _), st in sorted(self._states.items()) if st.choice is not None}

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` with this slice's chosen scheme.

        1. Profile (profiling syncs only): all-gather every rank's summary, predict every candidate.
        2. Decide: the lowest mean prediction; check that every rank decided the same; log a change.
        3. Run the chosen scheme (lossless, so also exact while profiling).
        """
        if key is None:
            numel = grad.numel if isinstance(grad, SparseGrad) else grad.numel()
            key = f"numel={numel}"
        st = self._states.setdefault((key, comm.rank), _SliceState())
        profiling_s = 0.0
        if st.profiled < self.profile_steps:
            # Step 1: profile.
            t0 = time.perf_counter()
            profile = self._gather_profile(comm, as_sparse(grad))
            st.predictions.append({c: cm.predict_time_s(c, profile, self.network, self._schemes[c].options())
                                   for c in self.candidates})
            st.profiled += 1
            # Step 2: decide and agree.
            choice, reason = self._decide(st, profile)
            self._agree(comm, key, choice)
            if choice != st.choice and comm.rank == 0:
                logger.info("auto[%s] -> %s: %s", key, choice, reason)
            st.choice, st.reason = choice, reason
            st.since_decision = 0
            profiling_s = time.perf_counter() - t0
        else:
            st.since_decision += 1
            if self.reprofile_every and st.since_decision >= self.reprofile_every:
                st.profiled, st.predictions = 0, []  # the next sync of this slice profiles again
        # Step 3: run the choice.
        out = self._schemes[st.choice]._sync(comm, grad, op, timings, key, out)
        if timings is not None:
            timings["scheme"] = st.choice
            timings["profile_s"] = profiling_s
        return out

    # --- internals -------------------------------------------------------------------------------
    def _build(self, name: str) -> SyncScheme:
        scheme = build_scheme(name)
        if "seed" in inspect.signature(type(scheme).__init__).parameters:
            scheme = build_scheme(name, seed=self.seed)
        return scheme

    def _gather_profile(self, comm: Communicator, sg: SparseGrad) -> cm.SparsityProfile:
        """Two small all-gathers: sizes (to agree on the sample rate), then every rank's local profile."""
        n = comm.size
        indices = sg.indices.cpu()  # the profile is small bookkeeping: CPU, whatever the gradient's device
        uniq = torch.unique(indices)
        num_blocks = cm._block_ids(uniq, sg.row_width, cm.BLOCK_SIZE).numel()
        shape = (sg.numel, sg.row_width, str(sg.dtype))
        sizes = comm.all_gather_object((shape, uniq.numel(), num_blocks))
        for r, (other, _, _) in enumerate(sizes):
            if other != shape:
                raise RuntimeError(f"auto: rank {r} synchronizes a slice of (numel, row_width, dtype) {other} "
                                   f"but rank {comm.rank} one of {shape}")
        s = cm.sample_parts_for(max(x[1] for x in sizes), self.sample_budget)
        sb = cm.sample_parts_for(max(x[2] for x in sizes), self.sample_budget)
        mine = cm.local_profile(indices, sg.numel, sg.row_width, n, self.seed, s, sb)
        return cm.SparsityProfile(
            numel=sg.numel, row_width=sg.row_width, value_bytes=sg.values.element_size(), seed=self.seed,
            locals=comm.all_gather_object(mine), sample_parts=s, block_sample_parts=sb,
        )

    def _decide(self, st: _SliceState, profile: cm.SparsityProfile) -> tuple[str, str]:
        mean = {c: sum(p[c] for p in st.predictions) / len(st.predictions) for c in self.candidates}
        ranked = sorted(self.candidates, key=lambda c: (mean[c], _priority(c)))
        best = ranked[0]
        n, d = profile.n, profile.density()
        gammas = profile.gammas() if n > 1 else {1: 1.0}
        if n == 1:
            rule = "nothing (n=1)"
        else:
            rule = "Balanced Parallelism" if cm.prefers_balanced_parallelism(n, gammas) else \
                "Hierarchical Centralization"
        parts = [f"predicted {mean[best] * 1e3:.3f} ms"]
        if "dense" in mean and best != "dense":
            parts.append(f"dense {mean['dense'] * 1e3:.3f} ms")
        if len(ranked) > 1:
            parts.append(f"next {ranked[1]} {mean[ranked[1]] * 1e3:.3f} ms")
        parts.append(f"n={n}, density={d:.4%}, gamma_n={gammas.get(n, 1.0):.2f}, Eq.1/2 prefer {rule}")
        parts.append(f"{self.network.bandwidth_gbps:g} Gbit/s, {self.network.latency_us:g} us, "
                     f"mean of {len(st.predictions)} profiled sync(s)")
        return best, "; ".join(parts)

    def _agree(self, comm: Communicator, key: str, choice: str) -> None:
        mine = (key, choice, self.options())
        for r, other in enumerate(comm.all_gather_object(mine)):
            if other != mine:
                raise RuntimeError(f"auto: rank {r} decided {other} but rank {comm.rank} decided {mine}; "
                                   "every rank must use the same options and slice order")


def _priority(name: str) -> int:
    return _PRIORITY.index(name) if name in _PRIORITY else len(_PRIORITY)
