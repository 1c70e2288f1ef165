"""``dgc``: Deep Gradient Compression top-k with error feedback, adapted to tensor parallelism (ZEN §4).

Per optimizer step each parameter accumulates its (locally clipped) gradient into a velocity ``v``
(with momentum correction: ``u ← m·u + g; v ← v + u``), sends the entries of ``v`` whose magnitude
reaches a threshold chosen to keep a ``density`` fraction, and keeps the rest as the residual:
``residual = v − sent`` exactly, so nothing is lost, only delayed. Sent positions of ``u`` are zeroed
(momentum factor masking). Semantics follow the DGC paper (ICLR'18) and its public code
(research/seeds.md §3.2, research/reference_code.md §5–6).

Choices and why:

* **per tensor by default** (``selection="per_tensor"``): selecting over a fused 128 MB bucket drops
  whole low-magnitude tensors (SAFusion §2: up to 81 % of BERT's tensors never sent);
  ``"per_bucket"`` (one threshold for all DGC tensors of a bucket) is the option.
* **a bucket in a constant number of operations**: the residual and momentum of a bucket are one
  flat buffer each (per-name views, so state stays keyed by name), gradients are added with one
  ``_foreach`` op, and every per-unit quantity (samples, thresholds, counts) is a tensor over units,
  never a Python loop of tensor ops. A per-unit threshold is compared in blocks of
  ``gcd(numels)`` elements (``[nblk, 1]`` broadcast), so no per-element threshold is built.
* **threshold by sampling** (``threshold="sampled"``): ``sample_fraction`` of ``|v|`` by an odd stride
  (no aliasing with row layouts), sorted per unit; one pass over the bucket keeps the *candidates*
  ``|v| ≥ t_low`` (the sample's ``CANDIDATE_FACTOR·k`` quantile, about twice the target), and
  ``REFINE_PASSES`` search passes then run on the candidates only (exact counts for any threshold
  ``≥ t_low``): from the sample's ``density`` quantile, move the sample rank by ``k / count`` while
  the count is outside ``REFINE_BAND·k``. Without TP every pass of every unit runs in one op
  (``dgc_threshold_search``, logic in csrc/dgc_search.h, one kernel on a GPU); under TP the torch
  loop all-reduces each pass's counts. Sample positions are a per-layout grid kept on the device plus
  a per-step offset (no host-to-device copy). Counts and thresholds stay on the device, so a bucket
  costs one host synchronization on a GPU (on the one-pass path: the finiteness flag, the candidates'
  and the selection's counts, read together; the candidates go into a buffer of a capacity known
  before the pass), whatever its number of tensors. ``"exact"`` takes the ``k``-th largest ``|v|`` per
  unit (one segmented sort of the bucket); ties at the threshold are kept in both modes.
* **tensor parallelism**: with ``tp_comm`` every TP rank samples its shard, the samples (with each
  shard's numel) are all-gathered over the TP group in one message per bucket, and the counts of each
  pass are all-reduced, so every TP rank derives the same threshold per layer (ZEN §4: "sampling
  data locally ..., gathering these samples across all devices, computing a global top-k threshold").
* **local gradient clipping** (``clip_norm``): each parameter's local gradient is scaled to an L2 norm
  of at most ``clip_norm / sqrt(dp_size)`` before accumulation (DGC §3.2's ``N^{-1/2}`` rule, applied
  per tensor because a bucket hook never sees the whole model's gradient at once).
* **warm-up**: density ramps from ``warmup_start_density`` to ``density`` over ``warmup_steps``.
* **memory in fp32** for fp16/bf16 gradients (``residual_dtype="bfloat16"`` halves it); values
  travel in the gradient's dtype, **clamped to its finite range** (an accumulated fp16 value past
  65504 would be sent as inf and turn the residual into −inf, then NaN, freezing the tensor), and the
  excess and the cast's rounding error stay in the residual, so conservation is still exact.
* **non-finite gradients** (an fp16 loss-scale overflow): the memory is left untouched and the
  non-finite entries are sent as they are, so the engine sees the overflow and skips the step.
* **loss scaling** (``set_loss_scale``): the memory holds scaled gradient and is rescaled when the
  scale changes; a step marked ``discard_step`` (some rank overflowed in some bucket) is undone at
  ``end_step`` from a snapshot taken at the step's first touch.

Bytes: DGC itself sends nothing over the data-parallel group; it hands ``≈ density·numel`` element
COO pairs to the scheme. Over the TP group a rank sends ``(8·(1 + 2U) + 4·S)`` bytes per bucket to
each peer (``U`` selection units, ``S`` samples) plus ``REFINE_PASSES`` all-reduces of ``U`` int64.

Momentum correction moves the momentum into the sparsifier: use an optimizer without momentum for
DGC parameters (DGC's ``DGCSGD``), or set ``momentum_correction=False`` to keep plain error feedback.

``zen.dgc`` is ``dgc_config.DGCConfig``; units, sampling grid and search state are in ``dgc_units``.

Legend: ``_N`` elements of one gradient, ``_K`` selected, ``_S`` samples, ``_U`` selection units.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from .. import ops
from ..core.types import SparseGrad
from . import dgc_ef21
from .base import NamedGrad, Sparsifier
# The config and the units live in their own modules; their names stay importable from here.
from .dgc_config import FEEDBACKS, RESIDUAL_DTYPES, SELECTIONS, THRESHOLDS, DGCConfig  # noqa: F401
from .dgc_units import (CANDIDATE_FACTOR, CAPACITY_FACTOR, MIN_KEPT_SAMPLES, REFINE_BAND,  # noqa: F401
                        _at_rank, _gather_units, exact_thresholds, memory_dtype, _Layout, _SearchConstants, _sort_per_unit, _ThresholdSearch,
                        chunk_topk, normalized_residual, sample_shift)
from .registry import register_sparsifier
from .state import SparsifierState

logger = logging.getLogger(__name__)

REFINE_PASSES = 4
"""Threshold refinement passes after the sampled estimate (each one count over the candidates)."""
FREE_HOST_READ_DEVICES = ("cpu",)
"""Device types where a host read costs nothing: the search may read its done flags to stop early,
and the candidates are sized exactly (elsewhere they go into a buffer of a capacity known before)."""
_ONE_PASS_WIRE = (torch.float32, torch.bfloat16, torch.float16)
"""Gradient dtypes the one-pass op widens into fp32 memory (exactly, as torch's mixed add does)."""


@register_sparsifier(config=DGCConfig, priority=200)
class DGCSparsifier(Sparsifier):
    """DGC top-k with momentum correction, masking, clipping, warm-up and exact error feedback.

    A bucket is compressed with a constant number of tensor operations, whatever its number of
    parameters: the memory of a bucket is one flat buffer per kind (``SparsifierState.flat``), the
    per-tensor thresholds are found together (segmented sampling, sorting and counting over selection
    units), and per-unit thresholds are compared in blocks of ``gcd(numels)`` elements
    (``_Layout``), so no per-element threshold tensor is ever built.

    Args:
        config: the ``zen.dgc`` section.
        state: where residuals, momenta and thresholds live (keyed by parameter name); its ``step``
            drives warm-up and sampling offsets, and the state's owner advances it once per step.
        dp_size: data-parallel world size (local clipping scales ``clip_norm`` by its ``-1/2`` power).
    """

    kind = "dgc"
    lossless = False
    bucket_mode = "fused"  # every DGC slice of a bucket in one SparseGrad: constant ops per bucket
    uses_tp_group = True  # per-layer thresholds agreed over the TP group

    @classmethod
    def from_config(cls, config, *, state, dp_size: int) -> "DGCSparsifier":
        return cls(config, state, dp_size=dp_size)

    @classmethod
    def claims(cls, param, config: DGCConfig) -> bool:
        """Matrices of at least ``min_numel`` elements (the largest TP shard's), unless ``dense_params``
        keeps them dense; 1-D parameters (biases, norms) always stay dense."""
        return param.dim > 1 and param.numel >= config.min_numel and not config.keeps_dense(param.name)

    def __init__(self, config: DGCConfig | dict | None = None, state: SparsifierState | None = None,
                 dp_size: int = 1) -> None:
        self.config = DGCConfig.from_dict(config)
        self.state = state if state is not None else SparsifierState()
        self.dp_size = int(dp_size)
        if self.config.feedback == "ef21":  # only EF21 reads the synchronized result
            self.after_sync = self._ef21_after_sync
        self._layouts: dict[tuple, _Layout] = {}
        self.loss_scale: float | None = None
        """The loss scale the memory is accumulated at (``set_loss_scale``); ``None``: never set."""
        self._journal: dict[int, tuple] = {}
        """id(flat residual) → (residual, momentum, their copies at the step's first touch)."""
        self._discard = False
        self._overflowed = False
        """Whether the last ``_compress_ef`` found a non-finite gradient (and touched no memory)."""

    # --- loss scaling and skipped steps -------------------------------------------------------------
    def set_loss_scale(self, scale: float) -> None:
        """Declare the loss scale of the gradients that follow; rescale the memory if it changed.

        The residual and momentum hold *scaled* gradient (they accumulate what the engine hands over),
        so when the scale moves from ``s`` to ``s'`` both are multiplied by ``s'/s`` (exact for the
        power-of-two steps of dynamic loss scaling): no residual stays at an old scale. Declaring a
        scale also makes steps transactional: the memory a step changes is snapshotted on first touch
        and restored by ``end_step`` if ``discard_step`` was called (an overflowed step).

        Raises:
            ValueError: ``scale`` is not a finite number > 0.
        """
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"zen: loss scale ({scale!r}) must be a finite number > 0")
        if self.config.feedback == "ef21":
            raise ValueError('zen.dgc.feedback ("ef21") must be "ef" with fp16 loss scaling: a skipped step '
                             "would have to undo every rank's estimate and the aggregate")
        if self.loss_scale is not None and scale != self.loss_scale:
            self.state.rescale(scale / self.loss_scale)
            self.state.rescale((scale / self.loss_scale) ** 2, ("sq_mean",))  # normalize_beta's squares
            for _, _, old_r, old_u in self._journal.values():
                old_r.mul_(scale / self.loss_scale)
                if old_u is not None:
                    old_u.mul_(scale / self.loss_scale)
        self.loss_scale = scale

    def discard_step(self) -> None:
        """This optimizer step is skipped (some rank overflowed): ``end_step`` restores the memory."""
        self._discard = True

    def end_step(self) -> None:
        """Commit this step's memory, or restore its snapshot if the step was discarded."""
        if self._discard:
            for r, u, old_r, old_u in self._journal.values():
                r.copy_(old_r)
                if u is not None:
                    u.copy_(old_u)
        self._journal, self._discard = {}, False

    # --- compression --------------------------------------------------------------------------------
    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """Select what ``grads`` send this step (``_compress_ef``, or ``_compress_ef21`` when
        ``feedback`` is ``"ef21"``)."""
        if self.config.feedback == "ef21":
            return dgc_ef21.compress(self, grads, tp_comm)
        return self._compress_ef(grads, tp_comm)

    def _ef21_after_sync(self, names: Sequence[str], outs: Sequence[torch.Tensor]) -> None:
        """EF21: the synchronized result is the aggregate's change (``dgc_ef21.add_aggregate_``)."""
        dgc_ef21.add_aggregate_(self, names, outs)

    def _compress_ef(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """Select what ``grads`` send this step and keep the rest in the residuals.

        1. Guard: if any gradient is non-finite, send its non-finite entries and leave the memory alone.
        2. Clip each local gradient (``clip_norm``) and accumulate it into its velocity ``v``.
        3. Choose one threshold per selection unit (sampled + refined, or exact), common to the TP group.
        4. Select ``|v| ≥ threshold`` (non-zeros only): one pass and one ``nonzero`` over the bucket's
           flat memory (the sampled search's candidates), the rest on the candidates only.
        5. Error feedback: send ``v`` clamped to the gradient dtype's finite range, keep ``v − sent``
           (exact), zero the momentum at sent positions.

        Args:
            grads: the DGC gradients of one bucket, in bucket order, of one dtype and device.
            tp_comm: the tensor-parallel group (``None``: no TP); every TP rank must pass the same names.

        Returns:
            An element-form SparseGrad over the concatenation of ``grads``, values in their dtype.
        """
        if not grads:
            raise ValueError("DGCSparsifier.compress needs at least one gradient")
        cfg = self.config
        # Flat views as the Synchronizer passes them cost nothing; a shaped one costs a view op.
        flats = [g.grad if g.grad.dim() == 1 else g.grad.reshape(-1) for g in grads]
        wire, device = flats[0].dtype, flats[0].device
        mdt = memory_dtype(wire, cfg.residual_dtype)
        lay = self._layout(tuple(g.name for g in grads), tuple(f.numel() for f in flats), device)
        total = lay.numel

        density = cfg.density_at(self.state.step)
        flush = cfg.flush_stride(density)  # the rotating flush takes its share of the budget
        if flush:
            density *= 1.0 - cfg.flush_fraction
        # The one-pass path (the op): the velocity update is deferred into the candidate selection, and
        # the thresholds are sampled from R + the pending update at the sample positions. There the
        # flag stays on the device (the op skips the update where it is false) and is read with the
        # selection's counts: one host read for the bucket.
        one_pass = (density < 1.0 and cfg.threshold != "exact" and cfg.clip_norm is None and not cfg.normalize_beta
                    and (mdt == wire if mdt == torch.float64 else mdt == torch.float32 and wire in _ONE_PASS_WIRE)
                    and ops.has_dgc_select_op(flats[0]) and all(f.is_contiguous() for f in flats))

        # Step 1: an overflowed (fp16) gradient must reach the engine as such and never the memory.
        # The one-pass path needs only the flag: one op (two launches on a GPU). Elsewhere a 2-norm (one
        # vectorized read, reused by clipping) is non-finite if any entry is; only then look
        # element-wise, since huge finite values may overflow the norm too. (fp32 norms; fp64
        # gradients keep fp64, which torch will not narrow.) Norms are >= 0, so their sum is below inf
        # exactly when every one is finite (or, harmlessly, when finite norms overflow the sum).
        if one_pass:
            norm_T, finite = None, ops.dgc_all_finite(flats)
        else:
            norm_T = torch.stack(torch._foreach_norm(flats, 2, dtype=torch.float64 if wire == torch.float64
                                                     else torch.float32))
            finite = norm_T.sum() < math.inf
        if not one_pass and not bool(finite):
            bad = self._non_finite(flats, total)
            if bad is not None:
                return bad

        # Step 2: local clipping, then accumulate the velocity (momentum correction) or the gradient.
        R, R_T = self.state.flat(lay.names, lay.numels, "residual", mdt, device)
        U, U_T = (self.state.flat(lay.names, lay.numels, "momentum", mdt, device) if cfg.momentum_correction
                  else (None, None))
        if self.loss_scale is not None and id(R) not in self._journal:
            self._journal[id(R)] = (R, U, R.clone(), U.clone() if U is not None else None)
        gs = flats
        if one_pass:
            got = self._sampled_thresholds(R, lay, density, tp_comm,
                                           torch.finfo(mdt).smallest_normal * torch.finfo(mdt).eps,
                                           pending=(U, list(flats), finite))
            if got is not None:
                thr_U, pos_K, v_K = got
                return self._finish(R, U, lay, thr_U, pos_K, wire, mdt, total, v_K, flush)
            # The flag was false: the op wrote nothing. Step 1 as on the other path; a norm that
            # overflowed on finite values goes on below.
            bad = self._non_finite(flats, total)
            if bad is not None:
                return bad
        if cfg.clip_norm is not None:
            limit = cfg.clip_norm / math.sqrt(self.dp_size)
            scale_T = (limit / (norm_T + 1e-6)).clamp(max=1.0)
            g = torch.cat(flats).to(mdt)
            g.view(lay.nblk, lay.blk).mul_(scale_T.to(mdt).repeat_interleave(lay.bpt_T, output_size=lay.nblk)[:, None])
            gs = [g]
        if cfg.momentum_correction:
            U.mul_(cfg.momentum)
            if len(gs) == 1 and gs[0].numel() == total:
                U.add_(gs[0])
            else:
                torch._foreach_add_(U_T, gs)
            R.add_(U)
        elif len(gs) == 1 and gs[0].numel() == total:
            R.add_(gs[0])
        else:
            torch._foreach_add_(R_T, gs)
        S = normalized_residual(self.state, lay, R, gs, cfg.normalize_beta, mdt) if cfg.normalize_beta else R
        del gs

        # Step 3 + 4: thresholds, one per selection unit, and the selection mask they give.
        tiny = torch.finfo(mdt).smallest_normal * torch.finfo(mdt).eps  # zeros never travel
        if density >= 1.0:  # dense_steps (or density 1): every non-zero entry travels
            thr_U = torch.full((lay.units,), tiny, dtype=mdt, device=R.device)
            pos_K = lay.select(R, thr_U).view(-1).nonzero().flatten()
            v_K = R.index_select(0, pos_K)
        elif cfg.selection_chunk:
            thr_U, pos_K = chunk_topk(S, lay, density, cfg.selection_chunk, tiny, tp_comm)
            v_K = R.index_select(0, pos_K)
        elif cfg.threshold == "exact":
            thr_U = exact_thresholds(S, lay, density, tp_comm).clamp(min=tiny)
            pos_K = lay.select(S, thr_U).view(-1).nonzero().flatten()  # one host synchronization
            v_K = R.index_select(0, pos_K)
        else:
            thr_U, pos_K, v_K = self._sampled_thresholds(S, lay, density, tp_comm, tiny)
            v_K = v_K if S is R else R.index_select(0, pos_K)
        return self._finish(R, U, lay, thr_U, pos_K, wire, mdt, total, v_K, flush)

    def _non_finite(self, flats: list[torch.Tensor], total: int) -> SparseGrad | None:
        """Step 1's element-wise look: the non-finite entries (the memory untouched), or None when
        there are none (huge finite values overflowed the norm)."""
        cat = torch.cat(flats)
        bad = (~torch.isfinite(cat)).nonzero().flatten()
        if not bad.numel():
            return None
        self._overflowed = True
        return SparseGrad(bad, cat[bad], total)

    def _finish(self, R, U, lay: "_Layout", thr_U, pos_K, wire, mdt, total: int, v_K, flush: int = 0) -> SparseGrad:
        """Step 5 of ``compress``: record the thresholds, send, keep the error, mask the momentum.
        ``v_K`` is ``R[pos_K]`` (the selection has it already); ``flush`` > 0 also sends every
        ``flush``-th residual from this step's start (``flush_fraction``), after the top-k's."""
        self.state.set_per_unit(list(lay.names), "threshold", thr_U, lay.unit_of_T)
        sent = self._send(R, U, pos_K, v_K, wire, mdt)
        if not flush:
            return SparseGrad(pos_K, sent, total)
        # The rotating flush: the same positions on every rank (a function of the step and of each
        # tensor's own indices, not of the bucket), disjoint from one step to the next until they wrap. A position the top-k sent this step sends 0 and
        # keeps its residual (a half-precision cast's rounding error), so the duplicate adds exactly
        # nothing in any dtype; the mark is one byte per element, on the device, no host read.
        pos_F = lay.flush_positions(self.state.step, flush, R.device)
        taken = torch.zeros(total, dtype=torch.bool, device=R.device).index_fill_(0, pos_K, True)
        in_K = taken.index_select(0, pos_F)
        r_F = R.index_select(0, pos_F)
        v_F = r_F.masked_fill(in_K, 0)
        sent_F = self._send(R, U, pos_F, v_F, wire, mdt)
        R.index_copy_(0, pos_F, torch.where(in_K, r_F, R.index_select(0, pos_F)))
        return SparseGrad(torch.cat([pos_K, pos_F]), torch.cat([sent, sent_F]), total)

    def _send(self, R, U, pos_K, v_K, wire, mdt) -> torch.Tensor:
        """Send ``v_K = R[pos_K]``: the values in the wire dtype, the error kept in ``R``, the momentum
        masked."""
        cfg = self.config

        # Step 5: send v clamped to the wire dtype's finite range (an fp16 value past 65504 would turn
        # into inf, and the residual v − inf into −inf, then NaN); the excess and the cast's rounding
        # error stay in the residual, so sent + residual == v (exact while |v| ≤ 2·max, Sterbenz).
        top = torch.finfo(wire).max
        if top < torch.finfo(mdt).max or wire != mdt:
            sent_K = (v_K.clamp(-top, top) if top < torch.finfo(mdt).max else v_K).to(wire)
            R.index_put_((pos_K,), v_K - sent_K.to(mdt))
        else:  # sent exactly: the error v − v is +0 (v finite, step 1)
            sent_K = v_K
            R.index_fill_(0, pos_K, 0)
        if cfg.momentum_correction and cfg.momentum_masking:
            U.index_fill_(0, pos_K, 0)
        return sent_K

    def _layout(self, names: tuple[str, ...], numels: tuple[int, ...], device: torch.device) -> "_Layout":
        key = (names, numels, device)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > 4096:  # layouts change only on bucket rebuilds; bound the cache
                self._layouts.clear()
            lay = self._layouts[key] = _Layout(names, numels, self.config.selection == "per_tensor", device)
        return lay

    # --- thresholds ---------------------------------------------------------------------------------
    def _sampled_thresholds(self, R: torch.Tensor, lay: "_Layout", density: float, tp_comm,
                            tiny: float, pending: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Per-unit thresholds keeping about ``density`` of each unit, the positions they select and
        the values of ``R`` there.

        1. Sample: strided positions per unit (offset moves with the step), gathered in one indexing.
        2. Pool over TP (one ``all_gather_v``) and sort the samples per unit (descending).
        3. Candidates: one pass over the bucket selects ``|v| ≥ t_low``, the sample value at
           ``CANDIDATE_FACTOR·k`` of each unit (about twice the target): one ``nonzero``.
        4. Search among the candidates only: counts at any threshold ``≥ t_low`` are exact there, so
           the passes of the search cost ``O(candidates)``, not ``O(bucket)``. A unit whose candidates
           are fewer than the band keeps ``t_low`` (all its candidates).

        5. With ``pending``: the kept candidates compacted in order by ``dgc_gather_kept``, which also
           writes the finiteness flag and both counts; one host read of those three.

        With ``pending = (U, g, finite)`` the velocity update has not run yet: the samples are taken
        from ``R + update`` (the same roundings as the update), and step 3 is
        ``dgc_accumulate_select_``, which applies the update (where the device flag ``finite`` is true)
        and selects the candidates in one pass. Returns None when ``finite`` was false (nothing written).
        """
        tp = tp_comm is not None and tp_comm.size > 1
        if pending is not None and not tp and R.dtype == torch.float32 and ops.has_dgc_sample_op(R):
            sorted_S, t_low, consts, k_U = self._fused_samples(R, lay, density, pending, tiny)
        else:
            sorted_S, t_low, consts, k_U = self._samples(R, lay, density, pending, tp_comm if tp else None, tiny)
        # Step 3: candidates at t_low, one pass over the bucket.
        if pending is None:
            pos_C, v_C, unit_C = self._candidates(R, lay, t_low)
        else:  # the op returns the candidates' values and units too: no gather from the bucket
            # Where a host read costs a stall, the candidates go into a buffer of a capacity known
            # before the pass, and their count stays on the device until the read below.
            cap = -1 if R.device.type in FREE_HOST_READ_DEVICES else lay.candidate_capacity(sum(k_U))
            pos_C, v_C, unit_C, count_C = ops.dgc_accumulate_select_(
                R, pending[0], pending[1], self.config.momentum, t_low.to(R.dtype), lay.unit_ends_N, pending[2], cap)
        # Step 4: search among the candidates.
        thr_U, keep_C = self._search(sorted_S, consts, v_C, unit_C, t_low, tp_comm if tp else None, lay, R)
        # (index_select: 2.5x faster than advanced indexing for 1-D gathers on the CPU)
        if pending is None:
            keep = keep_C.nonzero().flatten()
            return thr_U, pos_C.index_select(0, keep), v_C.index_select(0, keep)
        # Step 5: the bucket's one host read: the finiteness flag, the candidates' and the selection's
        # counts; the op that writes them has compacted the kept candidates already.
        pos_K, v_K, stats = ops.dgc_gather_kept(keep_C, pos_C, v_C, pending[2], count_C)
        ok, n_cand, n_keep = stats.tolist()
        if not ok:
            return None
        if n_cand > pos_C.numel():  # more candidates than the capacity: select them again, exactly
            lay.grow_capacity(n_cand)
            pos_C, v_C, unit_C = self._candidates(R, lay, t_low)
            thr_U, keep_C = self._search(sorted_S, consts, v_C, unit_C, t_low, tp_comm if tp else None, lay, R)
            keep = keep_C.nonzero().flatten()
            return thr_U, pos_C.index_select(0, keep), v_C.index_select(0, keep)
        return thr_U, pos_K[:n_keep], v_K[:n_keep]

    def _samples(self, R: torch.Tensor, lay: "_Layout", density: float, pending, tp_comm, tiny: float):
        """Steps 1-2 of ``_sampled_thresholds`` with torch ops, and step 3's lower threshold:
        ``(sorted_S, t_low, consts, k_U)``. ``tp_comm`` pools the samples over a TP group (None: none)."""
        # Step 1: samples, one gather for the whole bucket.
        pos_S, ns_U = lay.sample_positions(density, self.config.sample_fraction, self.state.step, R.device)
        if pending is None:
            samples = torch.nan_to_num(R.index_select(0, pos_S).abs(), nan=0.0)
        else:
            U, g_T = pending[0], pending[1]
            g_S = ops.gather_list(g_T, pos_S)
            delta = g_S if U is None else U.index_select(0, pos_S) * self.config.momentum + g_S
            samples = torch.nan_to_num((R.index_select(0, pos_S) + delta).abs(), nan=0.0)
        numel_U = list(lay.unit_numels)
        # Step 2: pool and sort per unit.
        if tp_comm is not None:
            samples, unit_S, ns_U, numel_U = _gather_units(samples, ns_U, numel_U, tp_comm)
        k_U = [max(1, math.ceil(density * n)) for n in numel_U]
        consts = lay.search_constants(ns_U, k_U, numel_U, R.device)
        sorted_S = _sort_per_unit(samples, unit_S if tp_comm is not None else consts.unit_S)
        t_low = _at_rank(sorted_S, consts, consts.first_U * CANDIDATE_FACTOR).clamp(min=tiny)
        return sorted_S, t_low, consts, k_U

    def _fused_samples(self, R: torch.Tensor, lay: "_Layout", density: float, pending, tiny: float):
        """``_samples`` for fp32 memory with the velocity update pending, without TP, in two ops:
        ``dgc_sample_keys`` (positions, gathers, the update's value, the sort key: about fifteen torch
        ops) and ``dgc_sort_unkey`` (the sort over the keys' used bits, the sorted values and the lower
        threshold: about twelve ops and torch's full 64-bit sort), where on a GPU every torch op is a
        launch. Bit-equal to ``_samples``."""
        grid_S, ns_U, stride_U, unit_S, hash_U = lay.sample_grid(density, self.config.sample_fraction, R.device)
        keys = ops.dgc_sample_keys(R, pending[0], pending[1], self.config.momentum, grid_S, unit_S, hash_U,
                                   stride_U, sample_shift(self.state.step))
        numel_U = list(lay.unit_numels)
        k_U = [max(1, math.ceil(density * n)) for n in numel_U]
        consts = lay.search_constants(ns_U, k_U, numel_U, R.device)
        sorted_S, t_low = ops.dgc_sort_unkey(keys, consts.low_S, tiny, lay.key_bits)
        return sorted_S, t_low, consts, k_U

    @staticmethod
    def _candidates(R: torch.Tensor, lay: "_Layout", t_low: torch.Tensor):
        """``|R| ≥ t_low`` of each unit: positions (one ``nonzero``), values and units."""
        pos_C = lay.select(R, t_low).view(-1).nonzero().flatten()
        return pos_C, R.index_select(0, pos_C), torch.searchsorted(lay.unit_ends_N, pos_C, right=True)

    def _search(self, sorted_S, consts, v_C, unit_C, t_low, tp_comm, lay: "_Layout", R: torch.Tensor):
        """Step 4 of ``_sampled_thresholds``: ``(thr_U, keep_C)``. Without TP, one op runs every pass of
        every unit (one kernel on a GPU, where the loop issues about fifty small ones per pass)."""
        if tp_comm is None and ops.has_dgc_search_op(R):
            return ops.dgc_threshold_search(sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U,
                                            v_C, unit_C, t_low.to(R.dtype), REFINE_PASSES)
        return self._search_loop(sorted_S, consts, v_C, unit_C, t_low, tp_comm, lay)

    @staticmethod
    def _search_loop(sorted_S, consts: "_SearchConstants", v_C, unit_C, t_low, tp_comm, lay: "_Layout"):
        """Step 4 with torch ops (``dgc_threshold_search``'s oracle, and the path under TP, where every
        pass's counts are all-reduced so that every TP rank moves alike): ``(thr_U, keep_C)``."""
        search = _ThresholdSearch(sorted_S, consts)
        abs_C = v_C.abs()
        # Padding of a capacity-sized candidate buffer has unit U (past every unit, value 0): the
        # running-sum counts end before it, and it reads the last unit's threshold (never kept).
        unit_clamped = unit_C.clamp(max=lay.units - 1)
        # The candidates are in position order, so each unit's are one run: a count per unit is the
        # difference of a running sum at the runs' ends (no atomics; an index_add into U counters
        # serialized on the GPU: 54 % of a bucket's GPU time on an H200).
        cut_U1 = torch.searchsorted(unit_C, lay.unit_range_U1)
        for _ in range(REFINE_PASSES):
            thr_U = torch.maximum(search.thr, t_low)
            run_C1 = torch.nn.functional.pad((abs_C >= thr_U.index_select(0, unit_clamped)).cumsum(0), (1, 0))
            counts_U = run_C1.index_select(0, cut_U1[1:]) - run_C1.index_select(0, cut_U1[:-1])
            if tp_comm is not None:
                tp_comm.all_reduce(counts_U)
            search.update(counts_U)
            # On the CPU reading a flag costs nothing: stop once every unit is in the band. On a GPU
            # the passes run blind (a read would synchronize).
            if counts_U.device.type in FREE_HOST_READ_DEVICES and bool(search.done.all()):
                break
        thr_U = torch.maximum(search.thr, t_low)
        return thr_U, abs_C >= thr_U.index_select(0, unit_clamped)
