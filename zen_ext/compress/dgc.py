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
* **warm-up**: density ramps exponentially from ``warmup_start_density`` to ``density`` over the first
  ``warmup_steps`` steps.
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

Legend: ``_N`` elements of one gradient, ``_K`` selected, ``_S`` samples, ``_U`` selection units.
"""

from __future__ import annotations

import logging
import math
import re
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .. import ops
from ..core.types import SparseGrad
from ..core.wire import pack, view_as
from .base import (
    NamedGrad,
    Sparsifier,
    acc_dtype,
    check_bool,
    check_choice,
    check_int,
    check_number,
    config_from_dict,
)
from .state import SparsifierState

logger = logging.getLogger(__name__)

SELECTIONS = ("per_tensor", "per_bucket")
THRESHOLDS = ("sampled", "exact")
RESIDUAL_DTYPES = ("float32", "bfloat16")
FEEDBACKS = ("ef", "ef21")
REFINE_PASSES = 4
"""Threshold refinement passes after the sampled estimate (each one count over the candidates)."""
CANDIDATE_FACTOR = 2.0
"""Candidates are the values above the sample's ``CANDIDATE_FACTOR·k`` quantile (about twice the
target): the search then moves among them, and only misses the band where the sample
overestimated the unit's quantile by more than that factor."""
REFINE_BAND = (0.8, 1.25)
"""A count within ``[0.8·k, 1.25·k]`` is accepted; outside it the threshold moves (``_ThresholdSearch``)."""
FREE_HOST_READ_DEVICES = ("cpu",)
"""Device types where a host read costs nothing: the search may read its done flags to stop early,
and the candidates are sized exactly (elsewhere they go into a buffer of a capacity known before)."""
CAPACITY_FACTOR = 2.0
"""The candidates' buffer holds ``CAPACITY_FACTOR`` times the ``CANDIDATE_FACTOR·k`` expected (where
the count is not read before the pass); it grows per layout when a pass finds more."""
_ONE_PASS_WIRE = (torch.float32, torch.bfloat16, torch.float16)
"""Gradient dtypes the one-pass op widens into fp32 memory (exactly, as torch's mixed add does)."""
MIN_KEPT_SAMPLES = 8
"""At least this many samples above the threshold (``8 / density`` samples), or small tensors get
a threshold from one or two values."""


@dataclass(frozen=True)
class DGCConfig:
    """The ``zen.dgc`` section. Tuning: start at the defaults; lower ``density`` only with warm-up."""

    enabled: bool = False
    """Sparsify dense gradients (lossy). Off by default: natural sparsity alone is lossless."""
    density: float = 0.05
    """Fraction of each tensor's elements sent per step, in (0, 1]. 0.05 as in ZEN's LLM runs."""
    selection: str = "per_tensor"
    """``"per_tensor"``: one threshold per parameter (SAFusion); ``"per_bucket"``: one per bucket."""
    threshold: str = "sampled"
    """``"sampled"``: estimate from ``sample_fraction`` of the values, then refine; ``"exact"``: top-k."""
    sample_fraction: float = 0.01
    """Fraction of values sampled to estimate the threshold, in (0, 1]; DGC uses 0.001–0.01."""
    momentum: float = 0.9
    """Momentum ``m`` of momentum correction, in [0, 1)."""
    momentum_correction: bool | None = None
    """Accumulate velocity (``u ← m·u + g; v ← v + u``) instead of raw gradients; the optimizer must
    then not apply momentum again. null (default): chosen from the optimizer when attached (true
    only for SGD with momentum 0, DGC's DGCSGD set-up; false for Adam-family, SGD with momentum and
    the rest) and logged; unresolved null acts as false."""
    momentum_masking: bool = True
    """Zero the momentum at sent positions (stops stale momentum); needs momentum correction."""
    clip_norm: float | None = None
    """Local gradient clipping: max L2 norm per tensor before accumulation, divided by
    ``sqrt(dp_size)``. ``None`` = off."""
    dense_steps: int = 0
    """Optimizer steps at the start that send every entry (density 1), before any warm-up ramp: what an
    optimizer that learns from dense gradients first needs (``FrozenVarianceAdamW``'s variance
    warm-up). 0 = off."""
    warmup_steps: int = 0
    """Steps over which density ramps exponentially from ``warmup_start_density`` down to
    ``density`` (after ``dense_steps``). 0 = off."""
    warmup_start_density: float = 0.25
    """Density at step 0 of the warm-up, in [density, 1] (DGC's schedule starts at 0.25)."""
    min_numel: int = 1024
    """Parameters with fewer elements (and all 1-D ones) go dense: their top-k saves nothing."""
    dense_params: tuple[str, ...] = ()
    """Regular expressions (``re.search`` on the parameter name): matching parameters stay dense,
    e.g. ``["lm_head"]`` for the output layer. Empty (default): routing by shape and size only."""
    feedback: str = "ef"
    """How what is not sent comes back. ``"ef"`` (default): error feedback, DGC's residual accumulates
    the unsent gradient and releases it once it is large. ``"ef21"`` (Richtárik et al., 2021): each
    rank keeps an estimate ``G_i`` of its gradient and sends the top-k of ``g − G_i``; the ranks add
    the synchronized difference to the previous step's aggregate, so the optimizer gets a dense, smooth
    estimate every step instead of bursts (one more bucket of memory per rank for the aggregate).
    ``"ef21"`` needs ``momentum_correction`` false, no ``clip_norm`` and no fp16 loss scaling. Measured
    under Adam (benchmarks/results/time_to_quality.md): far worse than ``"ef"`` at 5 %, since every
    stale estimate is applied again each step; kept as a measured alternative, not a recommendation."""
    residual_dtype: str = "float32"
    """dtype of the residual and momentum: ``"float32"`` (8 bytes per parameter with momentum
    correction) or ``"bfloat16"`` (4 bytes; the accumulation then rounds to 8 mantissa bits).
    fp64 gradients keep fp64 memory either way."""

    def __post_init__(self) -> None:
        s = "dgc"
        for name in ("enabled", "momentum_masking"):
            check_bool(s, name, getattr(self, name))
        if self.momentum_correction is not None:  # null: resolved from the optimizer when attached
            check_bool(s, "momentum_correction", self.momentum_correction)
        for name in ("density", "sample_fraction", "momentum", "warmup_start_density"):
            check_number(s, name, getattr(self, name))
        check_int(s, "warmup_steps", self.warmup_steps)
        check_int(s, "dense_steps", self.dense_steps)
        check_int(s, "min_numel", self.min_numel)
        check_choice(s, "selection", self.selection, SELECTIONS)
        check_choice(s, "threshold", self.threshold, THRESHOLDS)
        check_choice(s, "residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        check_choice(s, "feedback", self.feedback, FEEDBACKS)
        if self.feedback == "ef21" and self.momentum_correction:
            raise ValueError('zen.dgc.feedback ("ef21") must be "ef" when zen.dgc.momentum_correction is true: '
                             "EF21 estimates the gradient itself, momentum correction accumulates velocity")
        if self.feedback == "ef21" and self.clip_norm is not None:
            raise ValueError(f'zen.dgc.feedback ("ef21") must be "ef" when zen.dgc.clip_norm ({self.clip_norm!r}) '
                             "is set: the estimate tracks the unclipped gradient")
        if not 0 < self.density <= 1:
            raise ValueError(f"zen.dgc.density ({self.density!r}) must be in (0, 1]")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"zen.dgc.sample_fraction ({self.sample_fraction!r}) must be in (0, 1]")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"zen.dgc.momentum ({self.momentum!r}) must be in [0, 1)")
        if self.clip_norm is not None:
            check_number(s, "clip_norm", self.clip_norm)
            if not math.isfinite(self.clip_norm):
                raise ValueError(f"zen.dgc.clip_norm ({self.clip_norm!r}) must be a finite number or null (off)")
            if not self.clip_norm > 0:
                raise ValueError(f"zen.dgc.clip_norm ({self.clip_norm!r}) must be > 0 or null (off)")
        if self.warmup_steps < 0:
            raise ValueError(f"zen.dgc.warmup_steps ({self.warmup_steps!r}) must be >= 0")
        if self.dense_steps < 0:
            raise ValueError(f"zen.dgc.dense_steps ({self.dense_steps!r}) must be >= 0")
        if not 0 < self.warmup_start_density <= 1:
            raise ValueError(f"zen.dgc.warmup_start_density ({self.warmup_start_density!r}) must be in (0, 1]")
        if self.warmup_steps > 0 and self.warmup_start_density < self.density:
            raise ValueError(f"zen.dgc.warmup_start_density ({self.warmup_start_density!r}) must be >= "
                             f"zen.dgc.density ({self.density!r}), because warm-up sends more, not less")
        if self.min_numel < 0:
            raise ValueError(f"zen.dgc.min_numel ({self.min_numel!r}) must be >= 0")
        if isinstance(self.dense_params, str) or not isinstance(self.dense_params, (list, tuple)):
            raise TypeError(f"zen.dgc.dense_params ({self.dense_params!r}) must be a list of regular expressions")
        for pattern in self.dense_params:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"zen.dgc.dense_params ({pattern!r}) must be a valid regular expression: {e}") from None
        object.__setattr__(self, "dense_params", tuple(self.dense_params))  # JSON gives a list; keep it hashable

    def keeps_dense(self, name: str) -> bool:
        """Whether ``dense_params`` routes the parameter ``name`` to the dense path."""
        return any(re.search(p, name) for p in self.dense_params)

    @classmethod
    def from_dict(cls, values: "dict | DGCConfig | None") -> "DGCConfig":
        return config_from_dict(cls, values, "dgc")

    def density_at(self, step: int) -> float:
        """The density of optimizer step ``step`` (0-based): 1 for ``dense_steps``, then the warm-up ramp."""
        if step < self.dense_steps:
            return 1.0
        step -= self.dense_steps
        if step >= self.warmup_steps:
            return self.density
        start = self.warmup_start_density
        return start * (self.density / start) ** (step / self.warmup_steps)


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

    def __init__(self, config: DGCConfig | dict | None = None, state: SparsifierState | None = None,
                 dp_size: int = 1) -> None:
        self.config = DGCConfig.from_dict(config)
        self.state = state if state is not None else SparsifierState()
        self.dp_size = int(dp_size)
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
            return self._compress_ef21(grads, tp_comm)
        return self._compress_ef(grads, tp_comm)

    def _compress_ef21(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """EF21: send the top-k of ``g − G_i`` and move the estimate ``G_i`` by what was sent.

        1. The residual becomes ``−G_i``, so error feedback's accumulation (``R += g``) makes it
           ``g − G_i``; the residual is scratch under EF21 (rebuilt every step from ``G_i``).
        2. Error feedback's selection sends the top-k of it and leaves ``g − G_i − sent`` in ``R``.
        3. ``G_i ← g − R``: the old estimate plus exactly what was sent (cast rounding included).
           An overflowed gradient (error feedback sent its non-finite entries and touched nothing)
           leaves ``G_i`` as it was.
        The Synchronizer adds the synchronized result to the previous aggregate (``add_aggregate_``).
        """
        if not grads:
            raise ValueError("DGCSparsifier.compress needs at least one gradient")
        flats = [g.grad if g.grad.dim() == 1 else g.grad.reshape(-1) for g in grads]
        mdt = memory_dtype(flats[0].dtype, self.config.residual_dtype)
        names, numels = tuple(g.name for g in grads), tuple(f.numel() for f in flats)
        device = flats[0].device
        # Step 1: residual = −G_i.
        G, G_T = self.state.flat(names, numels, "ef21_estimate", mdt, device)
        R, _ = self.state.flat(names, numels, "residual", mdt, device)
        torch.neg(G, out=R)
        # Step 2: error feedback's selection on g − G_i.
        self._overflowed = False
        sent = self._compress_ef(grads, tp_comm)
        # Step 3: the estimate moves by what was sent.
        if not self._overflowed:
            _, R_T = self.state.flat(names, numels, "residual", mdt, device)
            torch._foreach_copy_(G_T, flats)
            torch._foreach_sub_(G_T, R_T)
        return sent

    def add_aggregate_(self, names: Sequence[str], outs: Sequence[torch.Tensor]) -> None:
        """EF21's receiving side: ``out ← A + out`` (the synchronized difference added to the previous
        aggregate ``A``), then ``A ← out``. ``A`` is the same on every rank (every rank adds the same
        synchronized values), kept in the memory dtype; ``outs`` are the DGC slices of the result."""
        mdt = memory_dtype(outs[0].dtype, self.config.residual_dtype)
        A, A_T = self.state.flat(tuple(names), tuple(o.numel() for o in outs), "ef21_aggregate", mdt, outs[0].device)
        if mdt == outs[0].dtype:
            torch._foreach_add_(A_T, list(outs))
        else:
            torch._foreach_add_(A_T, [o.to(mdt) for o in outs])
        for o, a in zip(outs, A_T):
            o.copy_(a)

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

        # Step 1: an overflowed (fp16) gradient must reach the engine as such and never the memory.
        # A 2-norm (one vectorized read, reused by clipping) is non-finite if any entry is; only then
        # look element-wise, since huge finite values may overflow the norm too.
        # (fp32 norms; fp64 gradients keep fp64, which torch will not narrow.)
        norm_T = torch.stack(torch._foreach_norm(flats, 2, dtype=torch.float64 if wire == torch.float64 else torch.float32))
        finite = torch.isfinite(norm_T).all()
        density = cfg.density_at(self.state.step)
        # The one-pass path (the op): the velocity update is deferred into the candidate selection, and
        # the thresholds are sampled from R + the pending update at the sample positions. There the
        # flag stays on the device (the op skips the update where it is false) and is read with the
        # selection's counts: one host read for the bucket.
        one_pass = (density < 1.0 and cfg.threshold != "exact" and cfg.clip_norm is None
                    and (mdt == wire if mdt == torch.float64 else mdt == torch.float32 and wire in _ONE_PASS_WIRE)
                    and ops.has_dgc_select_op(flats[0]) and all(f.is_contiguous() for f in flats))
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
                return self._finish(R, U, lay, thr_U, pos_K, wire, mdt, total, v_K)
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
        del gs

        # Step 3 + 4: thresholds, one per selection unit, and the selection mask they give.
        tiny = torch.finfo(mdt).smallest_normal * torch.finfo(mdt).eps  # zeros never travel
        if density >= 1.0:  # dense_steps (or density 1): every non-zero entry travels
            thr_U = torch.full((lay.units,), tiny, dtype=mdt, device=R.device)
            pos_K = lay.select(R, thr_U).view(-1).nonzero().flatten()
            v_K = R.index_select(0, pos_K)
        elif cfg.threshold == "exact":
            thr_U = self._exact_thresholds(R, lay, density, tp_comm).clamp(min=tiny)
            pos_K = lay.select(R, thr_U).view(-1).nonzero().flatten()  # one host synchronization
            v_K = R.index_select(0, pos_K)
        else:
            thr_U, pos_K, v_K = self._sampled_thresholds(R, lay, density, tp_comm, tiny)
        return self._finish(R, U, lay, thr_U, pos_K, wire, mdt, total, v_K)

    def _non_finite(self, flats: list[torch.Tensor], total: int) -> SparseGrad | None:
        """Step 1's element-wise look: the non-finite entries (the memory untouched), or None when
        there are none (huge finite values overflowed the norm)."""
        cat = torch.cat(flats)
        bad = (~torch.isfinite(cat)).nonzero().flatten()
        if not bad.numel():
            return None
        self._overflowed = True
        return SparseGrad(bad, cat[bad], total)

    def _finish(self, R, U, lay: "_Layout", thr_U, pos_K, wire, mdt, total: int, v_K) -> SparseGrad:
        """Step 5 of ``compress``: record the thresholds, send, keep the error, mask the momentum.
        ``v_K`` is ``R[pos_K]`` (the selection has it already)."""
        cfg = self.config
        self.state.set_per_unit(list(lay.names), "threshold", thr_U, lay.unit_of_T)

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
        return SparseGrad(pos_K, sent_K, total)

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

        5. With ``pending``: one host read of the finiteness flag and both counts; then the kept
           candidates by ``nonzero_static`` of the read count.

        With ``pending = (U, g, finite)`` the velocity update has not run yet: the samples are taken
        from ``R + update`` (the same roundings as the update), and step 3 is
        ``dgc_accumulate_select_``, which applies the update (where the device flag ``finite`` is true)
        and selects the candidates in one pass. Returns None when ``finite`` was false (nothing written).
        """
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
        tp = tp_comm is not None and tp_comm.size > 1
        if tp:
            samples, unit_S, ns_U, numel_U = _gather_units(samples, ns_U, numel_U, tp_comm)
        k_U = [max(1, math.ceil(density * n)) for n in numel_U]
        consts = lay.search_constants(ns_U, k_U, numel_U, R.device)
        if not tp:
            unit_S = consts.unit_S
        sorted_S = _sort_per_unit(samples, unit_S)
        # Step 3: candidates at t_low, one pass over the bucket.
        t_low = _at_rank(sorted_S, consts, consts.first_U * CANDIDATE_FACTOR).clamp(min=tiny)
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
        # counts.
        ok, n_cand, n_keep = torch.stack([pending[2].to(torch.int64), count_C[0], keep_C.sum()]).tolist()
        if not ok:
            return None
        if n_cand > pos_C.numel():  # more candidates than the capacity: select them again, exactly
            lay.grow_capacity(n_cand)
            pos_C, v_C, unit_C = self._candidates(R, lay, t_low)
            thr_U, keep_C = self._search(sorted_S, consts, v_C, unit_C, t_low, tp_comm if tp else None, lay, R)
            keep = keep_C.nonzero().flatten()
        else:
            keep = torch.nonzero_static(keep_C, size=n_keep).flatten()
        return thr_U, pos_C.index_select(0, keep), v_C.index_select(0, keep)

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
        # The candidates are in position order, so each unit's are one run: a count per unit is the
        # difference of a running sum at the runs' ends (no atomics; an index_add into U counters
        # serialized on the GPU: 54 % of a bucket's GPU time on an H200).
        cut_U1 = torch.searchsorted(unit_C, lay.unit_range_U1)
        for _ in range(REFINE_PASSES):
            thr_U = torch.maximum(search.thr, t_low)
            run_C1 = torch.nn.functional.pad((abs_C >= thr_U.index_select(0, unit_C)).cumsum(0), (1, 0))
            counts_U = run_C1.index_select(0, cut_U1[1:]) - run_C1.index_select(0, cut_U1[:-1])
            if tp_comm is not None:
                tp_comm.all_reduce(counts_U)
            search.update(counts_U)
            # On the CPU reading a flag costs nothing: stop once every unit is in the band. On a GPU
            # the passes run blind (a read would synchronize).
            if counts_U.device.type in FREE_HOST_READ_DEVICES and bool(search.done.all()):
                break
        thr_U = torch.maximum(search.thr, t_low)
        return thr_U, abs_C >= thr_U.index_select(0, unit_C)

    def _exact_thresholds(self, R: torch.Tensor, lay: "_Layout", density: float, tp_comm) -> torch.Tensor:
        """The ``k``-th largest ``|v|`` of each unit (pooled over the TP group): one segmented sort."""
        vals = R.abs()
        numel_U = list(lay.unit_numels)
        if tp_comm is not None and tp_comm.size > 1:
            vals, unit_N, _, numel_U = _gather_units(vals, numel_U, numel_U, tp_comm)
        else:
            unit_N = lay.unit_ids(R.device)
        sorted_N = _sort_per_unit(vals, unit_N)
        k_U = [max(1, math.ceil(density * n)) for n in numel_U]
        at = np.cumsum([0] + numel_U[:-1]) + np.array(k_U) - 1
        return sorted_N[torch.from_numpy(at).to(R.device, non_blocking=True)]


def memory_dtype(wire: torch.dtype, residual_dtype: str) -> torch.dtype:
    """The dtype of DGC's residual and momentum for gradients of dtype ``wire``."""
    if residual_dtype == "bfloat16" and wire in (torch.float32, torch.float16, torch.bfloat16):
        return torch.bfloat16
    return acc_dtype(wire)


class _Layout:
    """What is fixed for one bucket layout: units, blocks, and the index tensors of counting.

    Each unit (a tensor, or the whole bucket with ``per_bucket``) is a contiguous range of the flat
    memory. Viewing the memory as ``[nblk, blk]`` with ``blk = gcd(numels)`` puts every block inside
    one unit, so a per-unit threshold broadcasts over a block row (``[nblk, 1]``, expanded from
    ``[U]`` by ``repeat_interleave``): no per-element threshold tensor. LLM shapes give blocks of
    thousands of elements; a layout with ``gcd == 1`` degrades to one threshold per element.
    """

    def __init__(self, names: tuple[str, ...], numels: tuple[int, ...], per_tensor: bool, device) -> None:
        self.names, self.numels = names, numels
        self.numel = sum(numels)
        self.blk = max(1, math.gcd(*numels)) if self.numel else 1
        self.nblk = self.numel // self.blk
        self.unit_numels = list(numels) if per_tensor else [self.numel]
        self.units = len(self.unit_numels)
        self.unit_of_T = list(range(len(numels))) if per_tensor else [0] * len(numels)
        self.keys = list(names) if per_tensor else [names[0]]  # sampling offsets hash the unit's first name
        bpu = [n // self.blk for n in self.unit_numels]
        self.bpt_T = torch.tensor([n // self.blk for n in numels], dtype=torch.int64, device=device)
        self.bpu_U = torch.tensor(bpu, dtype=torch.int64, device=device)
        ends = np.cumsum(bpu)
        self.ends_U = torch.tensor(ends, dtype=torch.int64, device=device)
        self.starts_U = torch.tensor(ends - np.array(bpu), dtype=torch.int64, device=device)
        self.unit_ends_N = torch.tensor(np.cumsum(self.unit_numels), dtype=torch.int64, device=device)
        self.unit_range_U1 = torch.arange(self.units + 1, dtype=torch.int64, device=device)
        self._sample_grids: dict[tuple, tuple] = {}
        self._search_constants: dict[tuple, _SearchConstants] = {}
        self.capacity_factor = CAPACITY_FACTOR
        self._capacity_k = 1

    def candidate_capacity(self, k: int) -> int:
        """Room for the candidates of a bucket keeping ``k`` elements, where their number is not read
        before the pass: ``capacity_factor`` times the ``CANDIDATE_FACTOR·k`` expected, plus a margin
        for small buckets, at most the bucket."""
        self._capacity_k = k
        return min(self.numel, math.ceil(self.capacity_factor * CANDIDATE_FACTOR * k) + 1024)

    def grow_capacity(self, needed: int) -> None:
        """A pass found ``needed`` candidates, more than the capacity: make room for them and more (a
        sample rarely misjudges a unit this much; a layout that keeps doing so pays one extra pass
        until the capacity has grown past it)."""
        k = max(1, self._capacity_k)
        self.capacity_factor = max(2 * self.capacity_factor, 1.5 * needed / (CANDIDATE_FACTOR * k))
        logger.debug("zen: DGC candidates (%d) exceeded the capacity; capacity factor now %.2f", needed,
                  self.capacity_factor)

    def search_constants(self, ns_U: list[int], k_U: list[int], numel_U: list[int], device) -> "_SearchConstants":
        """The threshold search's per-unit device tensors, cached by the unit sizes (the same every
        step at a fixed density): a tensor built from a host list on a GPU is a blocking copy, one host
        synchronization each, and a bucket needs five."""
        key = (tuple(ns_U), tuple(k_U), tuple(numel_U), str(device))
        c = self._search_constants.get(key)
        if c is None:
            if len(self._search_constants) >= 64:  # a density warm-up schedule moves k_U for a while
                self._search_constants.clear()
            f64 = dict(dtype=torch.float64, device=device)
            first = [min(max(1.0, k * ns / n), ns) for k, ns, n in zip(k_U, ns_U, numel_U)]
            c = self._search_constants[key] = _SearchConstants(
                start_U=torch.tensor(np.cumsum([0] + list(ns_U[:-1])), dtype=torch.int64, device=device),
                ns_U=torch.tensor(ns_U, **f64), k_U=torch.tensor(k_U, **f64), first_U=torch.tensor(first, **f64),
                unit_S=torch.from_numpy(np.repeat(np.arange(len(ns_U)), ns_U)).to(device))
        return c

    def select(self, R: torch.Tensor, thr_U: torch.Tensor) -> torch.Tensor:
        """``|R| ≥ thr`` of each element's unit, as a bool ``[nblk, blk]`` (two compares, no abs copy)."""
        t = thr_U.to(R.dtype).repeat_interleave(self.bpu_U, output_size=self.nblk)[:, None]
        Rb = R.view(self.nblk, self.blk)
        mask = Rb >= t
        mask |= Rb <= -t
        return mask

    def count(self, mask: torch.Tensor) -> torch.Tensor:
        """Selected elements per unit (int64 ``[U]``)."""
        cs = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))
        return cs[self.ends_U] - cs[self.starts_U]

    def unit_ids(self, device) -> torch.Tensor:
        """The unit of every element (int64 ``[numel]``; built per call, only ``"exact"`` needs it)."""
        return torch.arange(self.units, device=device).repeat_interleave(self.bpu_U * self.blk, output_size=self.numel)

    def sample_positions(self, density: float, fraction: float, step: int, device) -> tuple[torch.Tensor, list[int]]:
        """Strided sample positions of every unit on ``device``, and the count per unit.

        Per unit: ``num = max(fraction·n, MIN_KEPT_SAMPLES/density)`` samples (all when that reaches
        ``n``) at ``offset + j·stride``, the stride odd (no aliasing with power-of-two rows), the
        offset a hash of the unit's first name moved by the step (deterministic, moving). The grid
        ``base + j·stride`` is built once per (density, fraction) and kept on the device; a step only
        adds its offsets there (three small kernels, no host-to-device copy).
        """
        key = (density, fraction, str(device))
        grid = self._sample_grids.get(key)
        if grid is None:
            if len(self._sample_grids) >= 64:  # a density warm-up moves the grid for a while
                self._sample_grids.clear()
            parts, ns_U, strides, base = [], [], [], 0
            for n in self.unit_numels:
                num = min(n, max(math.ceil(fraction * n), math.ceil(MIN_KEPT_SAMPLES / density)))
                stride = 1 if num >= n else n // num
                if stride > 1 and stride % 2 == 0:
                    stride -= 1  # an odd stride walks through every column of a power-of-two-wide matrix
                parts.append(base + stride * np.arange(num, dtype=np.int64))
                ns_U.append(num)
                strides.append(stride)
                base += n
            i64 = dict(dtype=torch.int64, device=device)
            grid = self._sample_grids[key] = (
                torch.from_numpy(np.concatenate(parts)).to(device), ns_U,
                torch.tensor(strides, **i64), torch.from_numpy(np.repeat(np.arange(len(ns_U)), ns_U)).to(device),
                torch.tensor([zlib.crc32(k.encode()) for k in self.keys], **i64))
        grid_S, ns_U, stride_U, unit_S, hash_U = grid
        # (step · an odd constant) mod 2^31 walks every residue of an odd stride; the hash decorrelates units.
        offset_U = (hash_U + (step * 0x9E3779B1) % (1 << 31)).remainder_(stride_U)
        return grid_S + offset_U.index_select(0, unit_S), ns_U


def _sort_per_unit(vals: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """``vals`` (≥ 0) sorted by unit (ascending), descending within each unit.

    Up to fp32, one sort of int64 keys ``unit·2³² + (2³¹ − 1 − bits(v))`` (the bits of a
    non-negative float order like the float), about 20× faster than two stable sorts on this CPU;
    fp64 takes the two stable sorts.
    """
    if vals.dtype in (torch.float32, torch.float16, torch.bfloat16):
        bits = vals.float().view(torch.int32)
        key = (unit_ids.to(torch.int64) << 32) | (0x7FFFFFFF - bits).to(torch.int64)
        # stable=True takes torch's radix sort on the CPU: 1.6x faster than the default for int64 keys
        # (equal keys are equal values, so the order among them does not matter).
        desc = (0x7FFFFFFF - (key.sort(stable=True).values & 0xFFFFFFFF)).to(torch.int32)
        return desc.view(torch.float32).to(vals.dtype)
    v, order = vals.sort(descending=True, stable=True)
    _, by_unit = unit_ids[order].sort(stable=True)
    return v[by_unit]


@dataclass(frozen=True)
class _SearchConstants:
    """Per-unit device tensors of ``_ThresholdSearch`` (``_Layout.search_constants``): first sample of
    each unit, samples, elements to keep and first probe's rank per unit (float64), and the unit of
    every sample."""

    start_U: torch.Tensor
    ns_U: torch.Tensor
    k_U: torch.Tensor
    first_U: torch.Tensor
    unit_S: torch.Tensor


def _at_rank(sorted_S: torch.Tensor, units, rank_U: torch.Tensor) -> torch.Tensor:
    """The sample at 1-based (fractional) rank ``rank_U`` of each unit's descending sort (``units``
    has the units' ``start_U`` and ``ns_U``); csrc/dgc_search.h's ``at_rank`` mirrors it."""
    idx = (rank_U.ceil() - 1).clamp(min=0).minimum(units.ns_U - 1).long() + units.start_U
    return sorted_S[idx]


class _ThresholdSearch:
    """Find per-unit thresholds whose counts lie in ``REFINE_BAND·k``, on device tensors ``[U]`` only.

    The first probe is each unit's sample density quantile. While only one side of the target is
    known, the next probe moves the sample rank by ``k / count`` (exact if the sample were perfectly
    representative). Once one probe counted too many and another too few, the next one interpolates
    between the closest two in (threshold, log count), which a lumpy sample cannot make oscillate.
    A probe inside the band is kept. Every unit moves at once (no host branch, no loop over units).

    Args:
        sorted_S: the samples sorted by unit, descending within each unit.
        consts: the units' sample counts, elements to keep and first ranks, on ``sorted_S``'s device.
    """

    def __init__(self, sorted_S: torch.Tensor, consts: _SearchConstants) -> None:
        self.sorted_S = sorted_S
        self.start_U, self.ns_U, self.k_U = consts.start_U, consts.ns_U, consts.k_U
        self.rank = consts.first_U
        self.thr = self.at_rank(self.rank)
        self.done = torch.zeros(self.ns_U.shape[0], dtype=torch.bool, device=sorted_S.device)
        # Closest probe with too many selected (highest such threshold) and with too few (lowest).
        self.has_over, self.t_over, self.c_over = self.done.clone(), torch.zeros_like(self.rank), torch.zeros_like(self.rank)
        self.has_under, self.t_under, self.c_under = self.done.clone(), torch.zeros_like(self.rank), torch.zeros_like(self.rank)

    def at_rank(self, rank_U: torch.Tensor) -> torch.Tensor:
        """The sample at 1-based (fractional) rank ``rank_U`` of each unit's descending sort."""
        return _at_rank(self.sorted_S, self, rank_U)

    def update(self, count_U: torch.Tensor) -> None:
        """Record the counts at ``self.thr`` and move ``self.thr`` to the next probes."""
        lo, hi = REFINE_BAND
        k, c, t = self.k_U, count_U.to(torch.float64), self.thr.to(torch.float64)
        self.done = self.done | ((c >= lo * k) & (c <= hi * k))
        over = (c > hi * k) & (~self.has_over | (t > self.t_over))
        under = (c < lo * k) & (~self.has_under | (t < self.t_under))
        self.t_over, self.c_over = torch.where(over, t, self.t_over), torch.where(over, c, self.c_over)
        self.t_under, self.c_under = torch.where(under, t, self.t_under), torch.where(under, c, self.c_under)
        self.has_over, self.has_under = self.has_over | over, self.has_under | under
        # Next probe: rank step on the sample, or interpolation once the target is bracketed.
        rank = (self.rank * k / c.clamp(min=1)).clamp(min=1).minimum(self.ns_U)
        t_rank = self.at_rank(rank).to(torch.float64)
        log_over, log_under = self.c_over.clamp(min=0.5).log(), self.c_under.clamp(min=0.5).log()
        w = (log_over - k.log()) / (log_over - log_under).clamp(min=1e-12)
        t_interp = self.t_over + (self.t_under - self.t_over) * w
        t_next = torch.where(self.has_over & self.has_under, t_interp, t_rank)
        self.rank = torch.where(self.done, self.rank, rank)
        # A probe is a value of the memory's dtype and no finer than float32: in float64 it would carry
        # the last-bit differences of log() between devices (csrc/dgc_search.h rounds the same way).
        if self.thr.dtype == torch.float64:
            t_next = t_next.to(torch.float32)
        self.thr = torch.where(self.done, self.thr, t_next.to(self.thr.dtype))


def _gather_units(vals: torch.Tensor, n_U: list[int], numel_U: list[int],
                  tp_comm) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """All-gather every rank's per-unit values (samples, or all values) over the TP group in one message.

    Returns:
        ``(vals, unit ids, values per unit, numel per unit)`` pooled over the TP ranks (rank order).

    Raises:
        RuntimeError: TP ranks disagree on the number of selection units.
    """
    device, dtype = vals.device, vals.dtype
    u = len(n_U)
    header = torch.tensor([u, *numel_U, *n_U], dtype=torch.int64, device=device)
    parts = tp_comm.all_gather_v(pack(header, vals))
    pooled, unit_ids, totals, counts = [], [], [0] * u, [0] * u
    # Two host reads in all, whatever the TP size: every rank's unit count, then every rank's sizes.
    for r, u_r in enumerate(torch.cat([view_as(buf, 0, 1, torch.int64) for buf in parts]).tolist()):
        if u_r != u:
            raise RuntimeError(f"zen.dgc: TP rank {r} has {u_r} selection units but TP rank {tp_comm.rank} "
                               f"has {u}; every TP rank must compress the same parameters in the same buckets")
    metas = torch.cat([view_as(buf, 8, 2 * u, torch.int64) for buf in parts]).view(len(parts), 2 * u).tolist()
    for buf, meta in zip(parts, metas):
        pooled.append(view_as(buf, 8 * (1 + 2 * u), sum(meta[u:]), dtype))
        unit_ids.append(np.repeat(np.arange(u), meta[u:]))
        for j in range(u):
            totals[j] += meta[j]
            counts[j] += meta[u + j]
    ids = torch.from_numpy(np.concatenate(unit_ids)).to(device, non_blocking=True)
    return torch.cat(pooled), ids, counts, totals
