"""Synchronizer: reduce one flat gradient bucket, each parameter by its own path (ZEN paper §4).

Engine adapters (DeepSpeed's bucket reduction, a DDP comm hook) hand over a flat bucket and the
``GradSlice`` of every parameter in it; the Synchronizer routes each slice by its kind, looping over
the registered sparsifiers (``compress/registry.py``) in their order:

* a ``per_slice`` sparsifier gets each of its slices alone and returns one SparseGrad per slice
  (natural sparsity: an untied embedding's non-zero rows, row form, lossless);
* a ``fused`` sparsifier gets every slice of its kind in the bucket and returns **one** SparseGrad
  over their concatenation (DGC: top-k with error feedback per parameter name; lossy, the result is
  the reduction of what each rank sent);
* the dense kind (1-D, small, tied) and every element no slice covers: one dense all-reduce per bucket.

Every SparseGrad of the bucket goes to the scheme in one ``sync_group`` call.

Bytes each rank sends per bucket: the dense part's ring all-reduce ``2·(n−1)/n·D·itemsize`` plus what
the scheme sends for each SparseGrad (``zen``: Eq. 1 of the paper, ``≈ 2·(n−1)/n·nnz`` COO entries
for balanced partitions), plus what a sparsifier that ``uses_tp_group`` sends over the TP group (DGC's
threshold agreement, compress/dgc/sparsifier.py).
``pop_step_stats`` reports them next to what a dense all-reduce of every bucket would have sent.

Every decision that shapes a collective is agreed explicitly: the first time a rank sees a bucket
layout, the data-parallel ranks compare layouts, kinds, op, scheme, sparsifier configs and communicator
options (transport, backend, device type; a rank that cannot plan the layout sends its error
instead), then, whenever a TP group exists, the TP ranks compare the parameter names of every kind
that ``uses_tp_group`` and communicator options and forward the DP outcome; every rank raises (RuntimeError naming both ranks'
values) instead of hanging.
All sparsifier memory lives in one ``SparsifierState`` keyed by parameter name; ``state_dict`` leaves
process groups out.

Legend: ``_N`` elements of the bucket, ``_K`` selected entries.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..comm.base import Communicator
from ..compress.base import NamedGrad, Sparsifier
from ..compress.none import NoneSparsifier
from ..compress.registry import DENSE, all_kinds, registered
from ..compress.state import SparsifierState
from ..core.reduce_scatter import build_reduce_scatter, low_bit_reduce_scatters, reduce_scatter_of
from ..core.registry import build_scheme, registered_schemes, scheme_class
from ..core.rs_base import ReduceScatterScheme
from ..core.scheme import SyncScheme, check_op
from ..core.types import AccumulatedGrad, SparseGrad
from .plan import GradSlice, Plan, agree, build_plan
from .prepared import PreparedBucket, PreparedPart

log = logging.getLogger(__name__)

SYNC_STATE_FORMAT = "zen_ext.synchronizer"
SYNC_STATE_VERSION = 1

__all__ = ["Synchronizer"]


class Synchronizer:
    """Reduce flat gradient buckets over ``dp_comm`` with the registered sparsifiers and a sync scheme.

    Args:
        dp_comm: the data-parallel group the gradients are reduced over.
        scheme: the SyncScheme for sparse gradients (or its registered name, built with defaults).
        param_kinds: parameter name → a registered kind or ``"dense"`` (``classify_parameters``).
        sections: the ``zen.<kind>`` section of each sparsifier to use, by kind, as a dict or its
            config class (``ZenConfig.sections()``); a kind without one is disabled.
        tp_comm: the tensor-parallel group (DGC agrees on one threshold per layer across it).
        **by_kind: sections given one by one as keywords, e.g. ``dgc={"enabled": True}``, ``natural={}``
            (merged with ``sections``; a value None = disabled).
        reduce_scatter: the ReduceScatterScheme (or its name) of the reduce-scatter route
            (``reduction/scatter.py``); None: the reduce-scatter form of ``scheme``
            (``core/reduce_scatter.py`` ``reduce_scatter_of``). Built on first use, kept in ``rs_scheme``.

    Raises:
        ValueError: a kind that is not registered, or a kind whose sparsifier is disabled.

    Example::

        >>> kinds = classify_parameters(model, natural={}, dgc={"enabled": True})  # doctest: +SKIP
        >>> sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=kinds,
        ...                     dgc={"enabled": True}, natural={})  # doctest: +SKIP
        >>> bucket.copy_(sync.sync_flat(bucket, slices, op="mean"))  # doctest: +SKIP
        >>> sync.end_step()  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        dp_comm: Communicator,
        scheme: SyncScheme | str,
        param_kinds: dict[str, str],
        sections: "dict | None" = None,
        tp_comm: Communicator | None = None,
        reduce_scatter=None,
        **by_kind,
    ) -> None:
        self.dp_comm = dp_comm
        self._rs_scheme = reduce_scatter  # rs_scheme builds it on first read
        self.tp_comm = tp_comm
        self.scheme = build_scheme(scheme) if isinstance(scheme, str) else scheme
        # Every registered kind's config (without a section: disabled), compared across ranks, and a
        # sparsifier for each enabled one, in the registry's order.
        given = {**by_kind, **(sections or {})}
        specs = {s.kind: s for s in registered()}
        unknown = sorted(set(given) - set(specs))
        if unknown:
            raise ValueError(f"Synchronizer sections ({unknown}) must be registered sparsifier kinds: {sorted(specs)}")
        self.configs = {k: spec.parse(given[k]) if given.get(k) is not None else spec.disabled()
                        for k, spec in specs.items()}
        kinds = all_kinds()
        for name, kind in param_kinds.items():
            if kind not in kinds:
                raise ValueError(f"param_kinds[{name!r}] ({kind!r}) must be one of {list(kinds)}")
            if kind != DENSE and not (kind in self.configs and self.configs[kind].enabled):
                raise ValueError(f"param_kinds[{name!r}] ({kind!r}) must name an enabled sparsifier, but "
                                 f"zen.{kind}.enabled is false; classify with the same sections")
        self.param_kinds = dict(param_kinds)
        self.state = SparsifierState()
        self._dense = NoneSparsifier()
        self.sparsifiers: dict[str, Sparsifier] = {
            k: specs[k].cls.from_config(cfg, state=self.state, dp_size=dp_comm.size)
            for k, cfg in self.configs.items() if cfg.enabled}
        self._handing = [sp for sp in self.sparsifiers.values() if hasattr(sp, "hand_over")]
        self.hand_over_to(self.scheme)  # a sparsifier that cannot hand over to it refuses here, at attach
        self._value_bits = next((sp.value_bits for sp in self.sparsifiers.values() if sp.value_bits), None)
        if self._value_bits:  # refused before the first step, not at it
            self.scheme.require_low_bits(self._value_bits, [n for n in registered_schemes()
                                                            if scheme_class(n).carries_low_bits])
        self._tp_kinds = tuple(k for k in self.configs if specs[k].cls.uses_tp_group)
        self.row_kinds = frozenset(k for k in self.sparsifiers if specs[k].cls.row_sparse)
        """The enabled kinds whose gradients are sparse by rows (``Sparsifier.row_sparse``)."""
        self._after_sync = {k for k, sp in self.sparsifiers.items()
                            if getattr(sp.after_sync, "__func__", None) is not Sparsifier.after_sync}
        self._plans: dict[tuple, Plan] = {}
        self._stats = self._empty_stats()
        if dp_comm.rank == 0 and (tp_comm is None or tp_comm.rank == 0):
            log.info("zen: Synchronizer scheme=%r dp_size=%d tp_size=%d %s", self.scheme, dp_comm.size,
                     tp_comm.size if tp_comm else 1,
                     " ".join(f"{k}={dataclasses.asdict(c)}" for k, c in self.configs.items()))

    # --- the hot path -------------------------------------------------------------------------------
    def sync_flat(
        self, flat: torch.Tensor, slices: list[GradSlice], op: str = "mean", out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reduce the flat bucket ``flat`` over the data-parallel group.

        1. Plan: route each slice by its kind (cached per layout; agreed across ranks the first time).
        2. Dense: the dense slices and uncovered elements, gathered into one buffer, one all-reduce.
        3. Sparsifiers, in the registry's order: a per-slice kind compresses each slice (natural: an
           embedding's non-zero rows), a fused kind every slice of its kind into one SparseGrad (DGC,
           memory keyed by name). Every SparseGrad goes to the scheme in one ``sync_group`` call.
           When a fused kind's slices tile one range of the bucket (the usual layout) its SparseGrad
           spans that range and the scheme writes into ``out``'s view of it; otherwise it spans the
           concatenated slices and each slice is copied out of a group-sized result. No bucket-sized
           intermediate either way. Then each sparsifier sees its synchronized slices (``after_sync``).

        Args:
            flat: this rank's bucket (contiguous; any shape, read as flat). Not modified unless it is
                also ``out``.
            slices: the parameters in the bucket; they must not overlap.
            op: ``"sum"`` or ``"mean"`` over the data-parallel ranks.
            out: where the reduced bucket goes (contiguous, ``flat``'s numel, dtype and device); may be
                ``flat`` itself, since every range of ``flat`` is read before its range of ``out`` is
                written. Default: a new tensor.

        Returns:
            The reduced bucket of ``flat``'s shape and dtype: ``out`` (viewed so) when given.

        Raises:
            ValueError: bad slices (overlap, out of range, unknown name, shape ≠ numel) or op.
            RuntimeError: ranks disagree on the bucket layout or configuration.
        """
        return self.finish_flat(self.prepare_flat(flat, slices, op, out))

    @property
    def rs_scheme(self) -> ReduceScatterScheme:
        """The ReduceScatterScheme of the reduce-scatter route, built here on first read (and only here): the
        constructor's ``reduce_scatter`` (a name is built with defaults) or the reduce-scatter form of
        ``scheme``, NotImplementedError for a scheme without one (a sharded engine reads it when it
        attaches, so that error comes before training)."""
        if not isinstance(self._rs_scheme, ReduceScatterScheme):
            given = self._rs_scheme
            built = build_reduce_scatter(given) if isinstance(given, str) else reduce_scatter_of(self.scheme)
            self.hand_over_to(built)  # refused here as for ``scheme``: the engines read this at attach
            self.hand_over_to(self.scheme)
            if self._value_bits:  # refused (or auto narrowed) when read at attach
                built.require_low_bits(self._value_bits, low_bit_reduce_scatters())
            self._rs_scheme = built
        return self._rs_scheme

    @rs_scheme.setter
    def rs_scheme(self, scheme: "ReduceScatterScheme | str | None") -> None:
        """Another reduce-scatter scheme (as the constructor's ``reduce_scatter``), e.g. ``direct`` in a test."""
        self._rs_scheme = scheme

    def hand_over_to(self, scheme: "SyncScheme | ReduceScatterScheme") -> None:
        """Make the sparsifiers that can hand their accumulated memory over (DGC) do so exactly when
        ``scheme``, the one that will consume what they prepare, selects its own entries
        (``takes_accumulated``: spardl, all-reduce or reduce-scatter); ValueError from a sparsifier that
        cannot (DGC's 4-bit residual)."""
        for sp in self._handing:
            sp.hand_over = scheme.takes_accumulated

    def prepare_flat(
        self, flat: torch.Tensor, slices: list[GradSlice], op: str = "mean", out: torch.Tensor | None = None,
        scheme: "SyncScheme | ReduceScatterScheme | None" = None,
    ) -> PreparedBucket:
        """The local half of ``sync_flat``: plan, and every read of ``flat`` (dense gather, compression,
        sparsifier memory updates). No data-parallel collective unless the layout is new (its
        agreement); DGC's thresholds use the TP group. ``finish_flat`` does the rest.

        ``scheme`` is the scheme that will consume the prepared parts (default: the all-reduce
        ``scheme``; the reduce-scatter route passes ``rs_scheme``): DGC hands its memory over exactly
        when that one selects its own entries (``hand_over_to``).

        A caller may run ``finish_flat`` of one bucket on another thread while it prepares the next
        (``BucketReducer`` with a communication worker), once every bucket's layout is planned
        (``plan_flat``): then only ``finish_flat`` talks to the data-parallel group.
        """
        t_start = time.perf_counter()
        check_op(op)
        if not flat.is_contiguous():
            raise ValueError("sync_flat needs a contiguous bucket")
        flat_N = flat.reshape(-1)
        st = self._stats
        tp_before = self.tp_comm.stats.snapshot() if self.tp_comm is not None else None

        # Step 1: plan.
        plan = self._plan_for(flat_N, slices, op)
        self.hand_over_to(scheme if scheme is not None else self.scheme)
        if out is not None:
            if not out.is_contiguous() or out.numel() != flat_N.numel() or out.dtype != flat_N.dtype \
                    or out.device != flat_N.device:
                raise ValueError(f"sync_flat: out ({tuple(out.shape)} {out.dtype} on {out.device}) must be contiguous "
                                 f"with {flat_N.numel()} {flat_N.dtype} elements on {flat_N.device}")
            out_N = out.reshape(-1)
        else:
            out_N = torch.empty_like(flat_N)
        prep = PreparedBucket(flat=flat, flat_N=flat_N, out_N=out_N, plan=plan, op=op)

        # Step 2 (local part): the dense ranges gathered into one buffer.
        if plan.dense_ranges:
            prep.dense_buf = self._dense.compress([NamedGrad("", flat_N[s:e]) for s, e in plan.dense_ranges])

        # Step 3 (local part): each kind's SparseGrads.
        for group in plan.groups:
            t0 = time.perf_counter()
            sp = self.sparsifiers[group.kind]
            if not group.fused:  # one SparseGrad per slice, shaped like its parameter
                found = sp.compress_each(
                    [NamedGrad(s.state_key, flat_N[s.offset : s.offset + s.numel].view(s.shape)) for s in group.slices])
                prep.parts.extend(PreparedPart(group, sg, s.numel, s) for s, sg in zip(group.slices, found))
            else:  # one SparseGrad over the concatenation, mapped onto the group's span when tiled
                sg = sp.compress([NamedGrad(s.state_key, flat_N[s.offset : s.offset + s.numel]) for s in group.slices],
                                 tp_comm=self.tp_comm)
                if isinstance(sg, AccumulatedGrad):  # dense memory over the concatenation (spardl)
                    grad = sg
                elif group.tiled:
                    idx_K = sg.indices if group.in_order else group.to_bucket(sg.indices) - group.lo
                    grad = SparseGrad(idx_K, sg.values, group.hi - group.lo, in_range=True, lowbit=sg.lowbit)
                else:
                    grad = SparseGrad(sg.indices, sg.values, sg.numel, in_range=True, lowbit=sg.lowbit)
                prep.parts.append(PreparedPart(group, grad, sg.numel))
            st["compress_s"] += time.perf_counter() - t0
        if tp_before is not None:
            t = self.tp_comm.stats - tp_before
            st["tp_bytes_sent"] += t.bytes_sent
            st["tp_bytes_recv"] += t.bytes_recv
        prep.local_s = time.perf_counter() - t_start
        return prep

    def plan_flat(self, flat: torch.Tensor, slices: list[GradSlice], op: str = "mean") -> None:
        """Plan (and on a new layout, agree) ``flat``'s layout now, as ``sync_flat`` would first."""
        check_op(op)
        self._plan_for(flat.reshape(-1), slices, op)

    def finish_flat(self, prep: PreparedBucket) -> torch.Tensor:
        """The communicating half of ``sync_flat``: the dense all-reduce and the one scheme call over every
        kind's SparseGrads, written into the prepared output; returns it in ``flat``'s shape."""
        t_start = time.perf_counter()
        dp, n = self.dp_comm, self.dp_comm.size
        st = self._stats
        dp_before = dp.stats.snapshot()
        plan, op, out_N = prep.plan, prep.op, prep.out_N

        # Step 2: one dense all-reduce for everything routed dense.
        if prep.dense_buf is not None:
            buf = prep.dense_buf
            dp.all_reduce(buf)
            if op == "mean":
                buf.div_(n)
            at = 0
            for s, e in plan.dense_ranges:
                out_N[s:e] = buf[at : at + e - s]
                at += e - s
            self.note_dense(buf.numel())

        # Step 3: every SparseGrad in one scheme call, so a scheme that reads on the host (zen:
        # partition and aggregated counts) reads once per bucket, not once per slice.
        if prep.parts:
            outs = []
            for p in prep.parts:  # a part over its group's span writes there (a concatenation does not)
                g = p.group
                lo, hi = (p.slice.offset, p.slice.offset + p.slice.numel) if p.slice is not None else (g.lo, g.hi)
                outs.append(out_N[lo:hi] if p.slice is not None or (g.tiled and p.grad.numel == hi - lo) else None)
            timings: list[dict] = [{} for _ in prep.parts]
            with dp.slot(("sync", plan.slot)):
                results = self.scheme.sync_group(dp, [p.grad for p in prep.parts], op, timings=timings,
                                                 keys=[p.key for p in prep.parts], outs=outs)
            for p, res, t, o in zip(prep.parts, results, timings, outs):
                if o is None:
                    at = 0
                    for s in p.group.slices:  # concatenation order
                        out_N[s.offset : s.offset + s.numel] = res[at : at + s.numel]
                        at += s.numel
                self.note_part(p.group.kind, p.numel, p.grad.nnz * p.grad.row_width, t, p.key)
            for group in plan.groups:
                if group.kind in self._after_sync:  # only where a sparsifier uses it: views cost per slice
                    self.sparsifiers[group.kind].after_sync(
                        [s.state_key for s in group.slices], [out_N[s.offset : s.offset + s.numel] for s in group.slices])

        # Stats of this call.
        dense = 2 * (n - 1) * prep.flat_N.numel() * prep.flat_N.element_size() // n if n > 1 else 0
        self.note_bucket(dp.stats - dp_before, dense, prep.local_s + time.perf_counter() - t_start)
        return out_N.view_as(prep.flat)

    def set_grad_scale(self, scale: float) -> None:
        """The loss scale the next gradients carry (fp16): a sparsifier with memory (DGC) rescales it when
        it changes and makes steps discardable (``discard_step``). Call before the step's first bucket."""
        for sp in self.sparsifiers.values():
            sp.set_loss_scale(scale)

    def discard_step(self) -> None:
        """This step overflowed on some rank and will be skipped: ``end_step`` restores the sparsifiers'
        memory."""
        for sp in self.sparsifiers.values():
            sp.discard_step()

    def end_step(self) -> None:
        """Advance the step counter (warm-up, sampling offsets) once per optimizer step."""
        self.state.step += 1
        for sp in (self._dense, *self.sparsifiers.values()):
            sp.end_step()

    # --- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Residuals, momenta, thresholds (keyed by parameter name), the step counter and every
        sparsifier's config (to warn when a run resumes with another); CPU tensors."""
        sd = {
            "format": SYNC_STATE_FORMAT,
            "version": SYNC_STATE_VERSION,
            "sparsifiers": self.state.state_dict(),
            "configs": {k: dataclasses.asdict(c) for k, c in self.configs.items()},
        }
        if hasattr(self.scheme, "state_dict"):
            sd["scheme"] = self.scheme.state_dict()
        return sd

    def load_state_dict(self, sd: dict, per_rank: bool = True) -> None:
        """Restore from ``state_dict()``; tensors move to their gradient's device on first use.

        Args:
            sd: a ``state_dict()``.
            per_rank: restore this rank's own memory too (DGC residuals, momenta, thresholds). False
                when ``sd`` is another rank's or another data-parallel size's (a resize): then only
                what every rank shares is restored (the step counter, which drives DGC's warm-up and
                sampling, and the scheme's state, e.g. the ``auto`` planner's choices), and the
                per-rank memory restarts from zero.

        Raises:
            ValueError: ``sd`` is not a Synchronizer state of a supported version.
        """
        if not isinstance(sd, dict) or sd.get("format") != SYNC_STATE_FORMAT:
            raise ValueError(f"Synchronizer state_dict must have format {SYNC_STATE_FORMAT!r}, got "
                             f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r}")
        if sd.get("version") != SYNC_STATE_VERSION:
            raise ValueError(f"Synchronizer state_dict version ({sd.get('version')!r}) must be {SYNC_STATE_VERSION}")
        for kind, cfg in sd.get("configs", {}).items():
            now = dataclasses.asdict(self.configs[kind]) if kind in self.configs else None
            if cfg != now:
                log.warning("zen: resuming with a different %s config: saved %s, now %s", kind, cfg, now)
        sparsifiers = sd["sparsifiers"] if per_rank else {**sd["sparsifiers"], "params": {}}
        self.state.load_state_dict(sparsifiers)
        for kind, sp in self.sparsifiers.items():  # e.g. DGC's owner residuals under other value_bits
            sp.resumed(sd.get("configs", {}).get(kind), per_rank)
        if "scheme" in sd and hasattr(self.scheme, "load_state_dict"):
            self.scheme.load_state_dict(sd["scheme"])

    # --- stats --------------------------------------------------------------------------------------
    def pop_step_stats(self) -> dict:
        """This step's statistics (since the last call), then reset them.

        Returns:
            ``buckets``; ``bytes_sent``/``bytes_recv`` over the DP group and ``tp_bytes_sent``/
            ``tp_bytes_recv`` over the TP group (per this rank); ``dense_bytes_sent``: what a ring
            all-reduce of the same buckets would send; ``numel``, ``nnz`` and ``density`` per kind
            (elements sent / elements); ``schemes``: sorted names used; ``slice_schemes``: the scheme
            each part ran (natural slice, the DGC slices, the dense slices); ``sync_s``, ``compress_s``,
            ``hash_s``: seconds.
        """
        st = self._stats
        self._stats = self._empty_stats()
        st["density"] = {k: (st["nnz"][k] / st["numel"][k] if st["numel"][k] else 0.0) for k in st["numel"]}
        st["schemes"] = sorted(st["schemes"])
        st["step"] = self.state.step
        return st

    @staticmethod
    def _empty_stats() -> dict:
        return {"buckets": 0, "bytes_sent": 0, "bytes_recv": 0, "tp_bytes_sent": 0, "tp_bytes_recv": 0,
                "dense_bytes_sent": 0, "numel": {}, "nnz": {}, "schemes": set(), "slice_schemes": {}, "sync_s": 0.0,
                "compress_s": 0.0, "hash_s": 0.0}

    # --- what a reduction of a prepared bucket reports (finish_flat, reduction/scatter.py) ----------------
    @property
    def after_sync_kinds(self) -> list[str]:
        """The enabled kinds whose sparsifier reads the synchronized gradient back (``after_sync``):
        a rank that holds only its range of the result (a reduce-scatter) cannot serve them."""
        return sorted(self._after_sync)

    def note_dense(self, numel: int) -> None:
        """``numel`` elements went through the dense reduction."""
        self.note_part("dense", numel, numel, {"scheme": "dense"}, "dense slices")

    def note_part(self, kind: str, numel: int, nnz: int, timings: dict, key: str) -> None:
        """One part of a bucket (``numel`` elements, ``nnz`` sent) reduced by the scheme ``timings`` name."""
        st = self._stats
        st["numel"][kind] = st["numel"].get(kind, 0) + numel
        st["nnz"][kind] = st["nnz"].get(kind, 0) + nnz
        # A planner scheme reports what it chose under "scheme"; the others are their own name.
        chosen = str(timings.get("scheme", self.scheme.name))
        st["schemes"].add(chosen)
        st["slice_schemes"][key] = chosen
        st["hash_s"] += timings.get("hash_s", 0.0)

    def note_bucket(self, dp_delta, dense_bytes: int, seconds: float) -> None:
        """One bucket done: its data-parallel traffic (a ``CommStats`` difference), what the dense
        collective would have sent, its seconds."""
        st = self._stats
        st["buckets"] += 1
        st["bytes_sent"] += dp_delta.bytes_sent
        st["bytes_recv"] += dp_delta.bytes_recv
        st["dense_bytes_sent"] += dense_bytes
        st["sync_s"] += seconds

    # --- planning -----------------------------------------------------------------------------------
    def _plan_for(self, flat_N: torch.Tensor, slices: list[GradSlice], op: str) -> Plan:
        key = (flat_N.numel(), str(flat_N.dtype), op,
               tuple((s.name, s.offset, s.numel, tuple(s.shape), s.start) for s in slices))
        plan = self._plans.get(key)
        if plan is None:
            # A layout this rank cannot plan is agreed on too (not raised at once): its peers would
            # otherwise wait in the agreement for the process-group timeout.
            try:
                plan, error = build_plan(flat_N.numel(), slices, self.param_kinds), None
            except ValueError as exc:
                plan, error = None, exc
            agree(plan, key, error, dp_comm=self.dp_comm, tp_comm=self.tp_comm, scheme=self.scheme,
                  configs=self.configs, tp_kinds=self._tp_kinds, param_kinds=self.param_kinds)
            plan.slot = len(self._plans)
            self._plans[key] = plan
        for group in plan.groups:
            if group.fused and group.tiled and not group.in_order:
                group.index_tensors(flat_N.device)  # to_bucket's per-slice shifts, once per layout and device
        return plan

