"""``auto``: pick the fastest lossless scheme per gradient slice from profiled sparsity (ZEN paper §2.3).

ZEN "collects the lightweight sparsity profiling results of the first few iterations and determines
the optimal scheme by comparing Equations (1) and (2)". This planner does the same with the full
predictions of ``cost_model`` — each scheme's wire format under the α–β model *plus its computation*
(entries hashed, sorted, scattered, dense buffers written), on rates measured on the running device —
and with dense all-reduce among the candidates, so a dense gradient is never made slower.

Calibration (once per rank, at its first profiling sync; all ranks take part, in the same order):

* link: unless ``bandwidth_gbps`` and ``latency_us`` are both given, a probe times all-reduces of 8 B
  and 1 MiB over the data-parallel group (best of 3 each) and solves the ring all-reduce's α–β time
  for latency and bandwidth;
* compute: ``compute_model.calibrate_compute`` on the gradient's device (``model="compute"`` only);
* agreement: one all-reduce MAX of those few numbers — every rank plans with the slowest rank's;
* refinement: the phase times of every real sync (the ``timings`` the schemes fill) fit a line per
  scheme and phase (``refinement.Refinement``); the ranks merge their fits on profiling syncs, inside
  the profile's all-gather.

Per slice ``key``:

* the first ``profile_steps`` syncs (and again every ``reprofile_every`` syncs) profile: every rank
  all-gathers a small summary of its gradient (3·n counts and an h0-sampled index set of at most
  ``sample_budget`` entries, from which density and γ at 2, 4, …, n are estimated), every candidate's
  time is predicted, and the candidate with the lowest mean prediction over the profiled syncs wins;
* measured, not only predicted: before the choice is final, every candidate that the calibrated
  model (before refinement) puts within ``EXPLORE_MARGIN`` (1.5×) of its best runs
  ``1 + MEASURED_RUNS`` times (fastest first; profiling goes on meanwhile): its first run on a rank is
  cold (caches, first-touch buffers) and is not learnt from, the others refine its own predictions
  — the model's error differs between schemes, and a choice from predictions alone could be 2–4×
  slower than the best (4-rank lab on 2 cores). The measured candidates are then ranked by the
  fastest of their measured syncs (each rank's, the slowest rank's counts), not by one sync: on a
  shared machine one sync of 16 ranks varies by ±30 %, and ranked on one sample each the near-equal
  ``zen`` and ``zen_coo`` (and at times AGsparse, 1.4× slower) won at random from run to run
  (16-rank SimWorld, 16-host lab). This costs at most ``1 + MEASURED_RUNS`` syncs per close
  candidate in a run (run counts are per scheme, so later slices rarely need any);
* every sync runs the current winner — all candidates are lossless, so profiling syncs also return the
  exact aggregate;
* the choice is computed from all-gathered data, hence the same everywhere, and then checked: the
  ranks all-gather (key, choice, options) and raise ``RuntimeError`` naming the rank and both values on
  any difference instead of running mismatched collectives.

The profile travels through ``Communicator.all_gather_object``, which the byte counters leave out; it is
``O(n + sample_budget)`` per rank and runs on profiling syncs only. Each change of a slice's choice is
logged once (rank 0, logger ``zen_ext.planner``) with its reason and every candidate's predicted time;
``last_choice(key)`` returns it, ``explain()`` summarizes calibration and choices for a run summary.

Checkpoints: ``state_dict()`` holds every slice's profiling state and choice (keyed by slice key),
the calibration (link and compute rates) and the refinement, so a resumed run neither re-profiles nor
re-calibrates and keeps choosing what the uninterrupted run would have (the Synchronizer saves it).

Tuning: ``bandwidth_gbps``/``latency_us`` describe the data-parallel links (the inter-node NIC; leave
them null to measure);
``profile_steps`` 3 is enough for gradients whose sparsity drifts slowly; lower ``reprofile_every`` if
it drifts fast (e.g. curriculum changes).
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

from ..comm.base import Communicator
from ..core.cost import BLOCK_SIZE, PRIMITIVES, WorkCounts
from ..core.registry import build_scheme, register_scheme
from ..core.scheme import SyncScheme
from ..core.types import SparseGrad, as_sparse
from . import cost_model as cm
from .calibration import Calibration, calibrate
from .candidates import candidate_schemes, candidates_text, candidates_text_of, mean_predictions, priority
from .low_bits import low_bit_options, narrow_to_low_bits, replan_for_value_bits
from .network import Network, modeled_time_s
from .profile import SparsityProfile, local_profile, nonzero_blocks, sample_parts_for
from .refinement import Refinement, Wire
from .state import SliceState

logger = logging.getLogger("zen_ext.planner")

_STATE_VERSION = 1
# Candidates predicted within this factor of the best are run (on profiling syncs, all lossless)
# before the choice is final, so that it rests on measured times rather than on the model alone.
EXPLORE_MARGIN = 1.5
MEASURED_RUNS = 2
"""Syncs of each close candidate measured after its cold first run; the fastest of them ranks it."""


class AutoScheme(SyncScheme):
    """Per-slice choice among lossless schemes by predicted time (see the module docstring).

    Args:
        bandwidth_gbps: link bandwidth per direction, Gbit/s; None: measured at start (with the latency).
        latency_us: per-message latency, µs; None: measured at start.
        profile_steps: syncs of a slice that are profiled before its choice is final (>= 1).
        reprofile_every: syncs of a slice between re-profilings (0: never re-profile).
        candidates: scheme names to choose from (default: every registered lossless scheme the cost
            model knows, ``dense`` included).
        seed: hash seed passed to the candidates that take one (``zen``, ``zen_coo``).
        sample_budget: indices per rank in the profile's sample (more: better estimates of γ).
        model: ``"compute"`` (wire + calibrated computation, refined from real syncs) or
            ``"alpha_beta"`` (the wire only, as the paper's Eq. 1/2).
    """

    name = "auto"
    reduce_scatter_form = "auto"
    MODELS = ("compute", "alpha_beta")

    def __init__(
        self,
        bandwidth_gbps: float | None = None,
        latency_us: float | None = None,
        profile_steps: int = 3,
        reprofile_every: int = 1000,
        candidates: list[str] | tuple[str, ...] | None = None,
        seed: int = 0,
        sample_budget: int = 2048,
        model: str = "compute",
    ) -> None:
        # A fixed link is validated now (Network raises the zen.* errors); a partly fixed one is
        # completed by the probe.
        self._fixed = (None if bandwidth_gbps is None else float(bandwidth_gbps),
                       None if latency_us is None else float(latency_us))
        Network(self._fixed[0] if self._fixed[0] is not None else 1.0,
                   self._fixed[1] if self._fixed[1] is not None else 0.0)
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"zen.profile_steps ({profile_steps!r}) must be an int >= 1")
        if not isinstance(reprofile_every, int) or reprofile_every < 0:
            raise ValueError(f"zen.reprofile_every ({reprofile_every!r}) must be an int >= 0 (0: never)")
        if not isinstance(sample_budget, int) or sample_budget < 1:
            raise ValueError(f"zen.sample_budget ({sample_budget!r}) must be an int >= 1")
        if model not in self.MODELS:
            raise ValueError(f"zen.planner model ({model!r}) must be one of {list(self.MODELS)}")
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
        self.model = model
        self.candidates = tuple(sorted(dict.fromkeys(candidates), key=priority))
        self._schemes = {c: self._build(c) for c in self.candidates}
        self._states: dict[tuple[str, int], SliceState] = {}
        # Per rank (one instance may serve every simulated rank of a SimWorld).
        self._calib: dict[int, Calibration] = {}
        self._refine: dict[int, Refinement] = {}
        # Syncs each candidate has run, per rank (the same on every rank: all run the same choices).
        self._runs: dict[int, dict[str, int]] = {}
        self._low_bits: dict = {}  # {"value_bits": b} once require_low_bits narrowed the candidates

    def require_low_bits(self, bits: int, carriers: list[str] | None = None) -> None:
        """``zen.dgc.value_bits``: only the candidates that carry it, their bytes in its bits (``low_bits.py``)."""
        narrow_to_low_bits(self, bits, carriers)

    @staticmethod
    def valid_candidates() -> list[str]:
        """What ``auto`` chooses among (``candidate_schemes``)."""
        return candidate_schemes()

    def options(self) -> dict:
        return dict(bandwidth_gbps=self._fixed[0], latency_us=self._fixed[1],
                    profile_steps=self.profile_steps, reprofile_every=self.reprofile_every,
                    candidates=list(self.candidates), seed=self.seed, sample_budget=self.sample_budget,
                    model=self.model)

    @property
    def network(self) -> Network | None:
        """The link the predictions use (the lowest rank's calibration here), None before calibration."""
        if self._calib:
            return self._calib[min(self._calib)].network
        if None not in self._fixed:
            return Network(*self._fixed)
        return None

    def last_choice(self, key: str) -> tuple[str, str] | None:
        """``(scheme name, reason)`` of the latest choice for slice ``key``, or None before its first sync."""
        for (k, _), st in self._states.items():
            if k == key and st.choice is not None:
                return st.choice, st.reason
        return None

    def settled(self, key: str) -> bool:
        """Whether slice ``key``'s choice is final: profiled, and every close candidate measured (the
        same answer on every rank, since the states it reads were agreed)."""
        return any(k == key and st.choice is not None and st.profiled >= self.profile_steps
                   for (k, _), st in self._states.items())

    def decisions(self) -> dict[str, str]:
        """``{key: scheme name}`` for every slice seen so far."""
        return {k: st.choice for (k, _), st in sorted(self._states.items()) if st.choice is not None}

    def explain(self) -> str:
        """Why each slice runs the scheme it runs: the calibration and every candidate's predicted time
        (mean over the slice's profiled syncs), the chosen one marked ``*`` (lowest rank's view)."""
        lines = []
        if self._calib:
            cal = self._calib[min(self._calib)]
            how = "measured by the probe" if cal.measured_link else "configured"
            flow = "=" if cal.network.flow_us is None else f"{cal.network.flow_us:.3g}"
            lines.append(f"auto: link {cal.network.bandwidth_gbps:.3g} Gbit/s, {cal.network.latency_us:.3g} us per "
                         f"round, {flow} us per extra flow ({how}); model {self.model}")
            if self.model == "compute":
                lines.append("auto: compute rates (slowest rank) " + ", ".join(
                    f"{k} {v:.3g}" for k, v in zip(PRIMITIVES, cal.rates.as_list())))
        ranks = sorted({r for _, r in self._states})
        for (key, rank), st in sorted(self._states.items()):
            if rank != (ranks[0] if ranks else 0) or st.choice is None:
                continue
            measuring = " (measuring it; the choice is not final yet)" if st.stale else ""
            lines.append(f"auto[{key}] -> {st.choice}{measuring}: " + candidates_text(st, self.candidates))
        return "\n".join(lines) if lines else "auto: no slice synchronized yet"

    # --- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every slice's planning state (keyed by slice key, then rank), the calibration and the
        refinement; plain Python values (JSON-able)."""
        slices: dict[str, dict[int, dict]] = {}
        for (key, rank), st in self._states.items():
            slices.setdefault(key, {})[rank] = st.state()
        return {"version": _STATE_VERSION, "options": self.options(), "slices": slices,
                "calibration": {r: c.state() for r, c in self._calib.items()},
                "refinement": {r: ref.state() for r, ref in self._refine.items()},
                "runs": {r: dict(v) for r, v in self._runs.items()}, "low_bits": dict(self._low_bits)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()``: the next syncs continue where the saved run was.

        Raises:
            ValueError: a state of another version, or saved with other planner options (a different
                candidate set or model would make the saved choices meaningless); one that differs only
                by ``zen.dgc.value_bits`` keeps its calibration and re-plans (``replan_for_value_bits``).
        """
        if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION:
            raise ValueError(f"auto state_dict version ({sd.get('version') if isinstance(sd, dict) else sd!r}) "
                             f"must be {_STATE_VERSION}")
        if replan_for_value_bits(self, sd):  # zen.dgc.value_bits changed: the calibration only
            return
        if sd.get("options") != self.options():
            raise ValueError(f"auto state_dict options ({sd.get('options')}) must equal this planner's "
                             f"({self.options()}); resume with the same zen.planner settings")
        self._states = {(key, int(rank)): SliceState.from_state(st)
                        for key, per_rank in sd["slices"].items() for rank, st in per_rank.items()}
        self._calib = {int(r): Calibration.from_state(c) for r, c in sd["calibration"].items()}
        # Absent in states saved before 2026-11-25: the close candidates are measured again.
        self._runs = {int(r): {k: int(v) for k, v in runs.items()} for r, runs in sd.get("runs", {}).items()}
        self._refine = {}
        for r, st in sd["refinement"].items():
            self._refine[int(r)] = Refinement()
            self._refine[int(r)].load(st)

    # --- the sync --------------------------------------------------------------------------------------
    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` with this slice's chosen scheme.

        1. Choose (``_choose``): calibrate, profile and decide on profiling syncs; else the choice.
        2. Run the chosen scheme (lossless, so also exact while profiling).
        3. Learn from its phase times (``_learn``).
        """
        sg_numel = grad.numel if isinstance(grad, SparseGrad) else grad.numel()
        if sg_numel == 0:  # nothing to plan (the public sync returns earlier; _sync is called directly too)
            values = grad.values if isinstance(grad, SparseGrad) else grad
            return torch.empty(0, dtype=values.dtype, device=values.device)
        # Step 1: choose.
        st, profiling_s = self._choose(comm, grad, key)
        # Step 2: run.
        phases: dict = {}
        out = self._schemes[st.choice].sync_validated(comm, grad, op, phases, key, out)
        # Step 3: learn.
        self._learn(comm, st, phases, timings, profiling_s)
        return out

    def _sync_group(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], op: str, timings: list[dict | None],
        keys: list[str | None], outs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """A bucket's gradients: every member's choice first (profiling syncs profile, as ``_sync``
        does, each under its own signature), then the members that chose one scheme run as one group
        of it, so a scheme that reads the host (``zen``) reads once per group, as it does without
        ``auto``. Groups run in the order of their first member (the same on every rank: choices are
        agreed)."""
        chosen = []
        for g, k in zip(grads, keys):
            sg_numel = g.dense_numel if isinstance(g, SparseGrad) else g.numel()
            dtype = g.values.dtype if isinstance(g, SparseGrad) else g.dtype
            with comm.signed(sg_numel, dtype, op, where=f"scheme {self.name!r}.sync"):
                chosen.append(self._choose(comm, g, k))
        by_choice: dict[str, list[int]] = {}
        for i, (st, _) in enumerate(chosen):
            by_choice.setdefault(st.choice, []).append(i)
        results: list[torch.Tensor | None] = [None] * len(grads)
        for choice, members in by_choice.items():
            phases = [{} for _ in members]
            got = self._schemes[choice].sync_group_validated(comm, [grads[i] for i in members], op, phases,
                                                             [keys[i] for i in members], [outs[i] for i in members])
            for i, res, ph in zip(members, got, phases):
                results[i] = res
                self._learn(comm, chosen[i][0], ph, timings[i], chosen[i][1])
        return results

    def _choose(self, comm: Communicator, grad: SparseGrad | torch.Tensor, key: str | None):
        """This slice's scheme for this sync: ``(slice state, seconds spent profiling)``.

        1. Calibrate (first profiling sync of this rank): link probe, compute micro-benchmark, MAX.
        2. Profile (profiling syncs only): all-gather every rank's summary and refinement, predict
           every candidate.
        3. Decide: the lowest mean prediction; check that every rank decided the same; log a change.
        """
        sg_numel = grad.numel if isinstance(grad, SparseGrad) else grad.numel()
        if key is None:
            key = f"numel={sg_numel}"
        st = self._states.setdefault((key, comm.rank), SliceState())
        profiling_s = 0.0
        if st.profiled < self.profile_steps:
            t0 = time.perf_counter()
            sg = as_sparse(grad)
            # Step 1: calibrate.
            cal = self._calibrate(comm, sg.values.device)
            refine = self._refine.setdefault(comm.rank, Refinement())
            # Step 2: profile.
            profile, states, measured = self._gather_profile(comm, sg, refine.state(), st.measured)
            if self.model == "compute":
                refine.merge_max(states)
            work = WorkCounts.from_profile(profile)
            preds, wires, raw = {}, {}, {}
            for c in self.candidates:
                opts = low_bit_options(self, c, grad)
                # In a slot (a Synchronizer's bucket) the steady steps carry their counts in the payload.
                stats = cm.predict_stats(c, profile, opts, first_call=not comm.in_slot)
                wires[c] = Wire.of(stats, cal.network)
                preds[c] = (modeled_time_s(stats, cal.network) if self.model == "alpha_beta" else
                            cm.predict_total_s(c, work, wires[c], cal.network.alpha_s, cal.rates, opts, refine,
                                                   cal.network.flow_s))
                if self.model == "compute":
                    raw[c] = cm.predict_total_s(c, work, wires[c], cal.network.alpha_s, cal.rates, opts,
                                                flow_s=cal.network.flow_s)
            # After a measuring sync only predictions refined by it count (the log shows the latest).
            st.predictions = [preds] if st.stale else [*st.predictions, preds]
            st.stale = False
            st.profiled += 1
            # Step 3: decide (or measure a close candidate first) and agree.
            # Measured on every rank: the slowest rank's fastest sync (the same on every rank).
            measured_s = {c: max(m[c] for m in measured) for c in self.candidates if all(c in m for m in measured)}
            choice, reason = self._decide(st, profile, cal, measured_s)
            probe_c = (self._unmeasured_close(raw, self._runs.get(comm.rank, {}))
                       if self.model == "compute" else None)
            if probe_c is not None:
                reason = (f"measuring {probe_c} before the choice is final: the calibrated model puts it at "
                          f"{raw[probe_c] * 1e3:.3f} ms, within {EXPLORE_MARGIN:g}x of its best "
                          f"({min(raw.values()) * 1e3:.3f} ms); every such candidate runs "
                          f"{1 + MEASURED_RUNS} times")
                choice = probe_c
                # Keep profiling, and decide on predictions refined by this measurement only.
                st.profiled = min(st.profiled, self.profile_steps - 1)
                st.stale = True
            self._agree(comm, key, choice)
            if comm.rank == 0 and (choice != st.choice or st.profiled == self.profile_steps):
                logger.info("auto[%s] -> %s: %s | %s", key, choice, reason, candidates_text_of(
                    mean_predictions(st, self.candidates), choice, self.candidates))
            st.choice, st.reason = choice, reason
            st.work, st.wire = work, wires[choice]
            st.since_decision = 0
            profiling_s = time.perf_counter() - t0
        else:
            st.since_decision += 1
            if self.reprofile_every and st.since_decision >= self.reprofile_every:
                st.profiled, st.predictions, st.measured = 0, [], {}  # the next sync profiles again
        return st, profiling_s

    def _learn(self, comm: Communicator, st: "SliceState", phases: dict, timings: dict | None,
               profiling_s: float) -> None:
        """After the chosen scheme ran: refine the model from its phase times (not from a scheme's first
        run on this rank: cold caches, first-touch workspaces and new connection sizes made it 2x slower
        in the lab), and report the phases, the choice and the profiling time in ``timings``."""
        runs = self._runs.setdefault(comm.rank, {})
        runs[st.choice] = runs.get(st.choice, 0) + 1
        if (self.model == "compute" and runs[st.choice] > 1
                and (st.stale or st.profiled < self.profile_steps)):  # still deciding: keep its fastest sync
            took = sum(v for k, v in phases.items() if k.endswith("_s") and isinstance(v, float))
            if took > 0:
                st.measured[st.choice] = min(st.measured.get(st.choice, took), took)
        if self.model == "compute" and st.work is not None and comm.rank in self._calib and runs[st.choice] > 1:
            cal = self._calib[comm.rank]
            c = st.choice
            predicted = cm.predict_phases_s(c, st.work, st.wire, cal.network.alpha_s, cal.rates,
                                            self._schemes[c].options(), flow_s=cal.network.flow_s)
            self._refine.setdefault(comm.rank, Refinement()).observe(c, predicted, phases)
        if timings is not None:
            timings.update(phases)
            timings["scheme"] = st.choice
            timings["profile_s"] = profiling_s

    # --- internals -------------------------------------------------------------------------------
    def _build(self, name: str) -> SyncScheme:
        scheme = build_scheme(name)
        if "seed" in inspect.signature(type(scheme).__init__).parameters:
            scheme = build_scheme(name, seed=self.seed)
        return scheme

    def _calibrate(self, comm: Communicator, device: torch.device) -> Calibration:
        """This rank's calibration, measured once (``calibration.calibrate``); every rank calls it at its
        first profiling sync, so the collectives line up."""
        cal = self._calib.get(comm.rank)
        if cal is None:
            cal = self._calib[comm.rank] = calibrate(comm, device, self._fixed, self.model)
        return cal

    def _gather_profile(self, comm: Communicator, sg: SparseGrad, refine_state: dict | None = None,
                        measured: dict | None = None) -> tuple[SparsityProfile, list[dict], list[dict]]:
        """Two small all-gathers: sizes (to agree on the sample rate), then every rank's local profile
        with its refinement state and its measured syncs of this slice. Returns the profile, the states
        and the measured times in rank order."""
        n = comm.size
        indices = sg.indices.cpu()  # the profile is small bookkeeping: CPU, whatever the gradient's device
        uniq = torch.unique(indices)
        num_blocks = nonzero_blocks(uniq, sg.row_width, BLOCK_SIZE).numel()
        shape = (sg.numel, sg.row_width, str(sg.dtype))
        sizes = comm.all_gather_object((shape, uniq.numel(), num_blocks))
        for r, (other, _, _) in enumerate(sizes):
            if other != shape:
                raise RuntimeError(f"auto: rank {r} synchronizes a slice of (numel, row_width, dtype) {other} "
                                   f"but rank {comm.rank} one of {shape}")
        s = sample_parts_for(max(x[1] for x in sizes), self.sample_budget)
        sb = sample_parts_for(max(x[2] for x in sizes), self.sample_budget)
        mine = local_profile(indices, sg.numel, sg.row_width, n, self.seed, s, sb)
        gathered = comm.all_gather_object((mine, refine_state or {}, measured or {}))
        profile = SparsityProfile(
            numel=sg.numel, row_width=sg.row_width, value_bytes=sg.values.element_size(), seed=self.seed,
            locals=[g[0] for g in gathered], sample_parts=s, block_sample_parts=sb,
        )
        return profile, [g[1] for g in gathered], [g[2] for g in gathered]

    def _unmeasured_close(self, raw: dict[str, float], runs: dict[str, int]) -> str | None:
        """The candidate to measure before deciding, or None: the fastest of the candidates that the
        calibrated model (``raw``: not refined) puts within ``EXPLORE_MARGIN`` of its best and that
        have not run ``1 + MEASURED_RUNS`` times yet (a first run is not learnt from; the others
        refine the scheme's own predictions and the fastest of them ranks it). The model's error differs between schemes: a 4-rank lab on 2 cores measured
        SparCML at 2.7x its prediction and ZEN at 0.85x, so predictions alone picked a scheme 2-4x
        slower than the best. Closeness is judged on the unrefined model because the refinement
        carries one measured scheme's error over to the unmeasured ones (the shared fits), which pushed
        ZEN out of the margin after AGsparse ran first. Derived from agreed predictions and run counts
        (every rank runs the same choices): the same on every rank."""
        best = min(raw.values())
        close = sorted((c for c in self.candidates if raw[c] <= EXPLORE_MARGIN * best),
                       key=lambda c: (raw[c], priority(c)))
        if len(close) < 2:  # nothing to compare with: the prediction stands
            return None
        return next((c for c in close if runs.get(c, 0) < 1 + MEASURED_RUNS), None)

    def _decide(self, st: SliceState, profile: SparsityProfile, cal: Calibration,
                measured_s: dict[str, float] | None = None) -> tuple[str, str]:
        """The candidate to run: the lowest of its measured time (``measured_s``: agreed, the fastest
        measured sync) where it was measured on this slice, else of its mean prediction."""
        measured_s = measured_s or {}
        mean = {**mean_predictions(st, self.candidates), **measured_s}
        ranked = sorted(self.candidates, key=lambda c: (mean[c], priority(c)))
        best = ranked[0]
        n, d = profile.n, profile.density()
        gammas = profile.gammas() if n > 1 else {1: 1.0}
        if n == 1:
            rule = "nothing (n=1)"
        else:
            rule = "Balanced Parallelism" if cm.prefers_balanced_parallelism(n, gammas) else \
                "Hierarchical Centralization"
        parts = [f"{'measured' if best in measured_s else 'predicted'} {mean[best] * 1e3:.3f} ms"]
        if "dense" in mean and best != "dense":
            parts.append(f"dense {mean['dense'] * 1e3:.3f} ms")
        if len(ranked) > 1:
            parts.append(f"next {ranked[1]} {mean[ranked[1]] * 1e3:.3f} ms")
        parts.append(f"n={n}, density={d:.4%}, gamma_n={gammas.get(n, 1.0):.2f}, Eq.1/2 prefer {rule}")
        parts.append(f"{cal.network.bandwidth_gbps:.3g} Gbit/s, {cal.network.latency_us:.3g} us"
                     f"{' (measured)' if cal.measured_link else ''}, model {self.model}, "
                     f"mean of {len(st.predictions)} profiled sync(s)")
        return best, "; ".join(parts)

    def _agree(self, comm: Communicator, key: str, choice: str) -> None:
        mine = (key, choice, self.options())
        for r, other in enumerate(comm.all_gather_object(mine)):
            if other != mine:
                raise RuntimeError(f"auto: rank {r} decided {other} but rank {comm.rank} decided {mine}; "
                                   "every rank must use the same options and slice order")


register_scheme(AutoScheme)
