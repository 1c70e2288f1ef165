"""``dgc``: Deep Gradient Compression top-k with error feedback, adapted to tensor parallelism (ZEN §4).

Per optimizer step each parameter accumulates its (locally clipped) gradient into a velocity ``v``
(with momentum correction: ``u ← m·u + g; v ← v + u``), sends the entries of ``v`` whose magnitude
reaches a threshold chosen to keep a ``density`` fraction, and keeps the rest as the residual:
``residual = v − sent`` exactly, so nothing is lost, only delayed (error feedback). Sent positions of
``u`` are zeroed (momentum factor masking). Semantics follow the DGC paper (Lin et al., ICLR'18, §3)
and its public code (github.com/synxlin/deep-gradient-compression).

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

``zen.dgc`` is ``config.DGCConfig``; the sampled search is ``thresholds.py``; units, sampling grid and
search constants are in ``units.py``; the search's passes are ``zen_ext.ops.dgc_threshold_search``.

Legend: ``_N`` elements of one gradient, ``_K`` selected, ``_S`` samples, ``_U`` selection units.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from ... import ops
from ...core.lowbit import LowBitValues
from ...core.types import AccumulatedGrad, FlushPositions, SparseGrad
from ..base import NamedGrad, Sparsifier
from ..registry import register_sparsifier
from ..state import SparsifierState
from .config import DGCConfig
from .defaults import resolve_dgc_defaults
from .int4 import compress_int4, convert_residuals, int4_add_at, int4_applies
from .thresholds import sampled_thresholds
from .units import _Layout, exact_thresholds, memory_dtype

logger = logging.getLogger(__name__)

OWNER_KEY = "[zen owner residual]"
"""The state name prefix of an owner residual (``value_bits``): one entry per bucket, beside the parameters'."""

_ONE_PASS_WIRE = (torch.float32, torch.bfloat16, torch.float16)
"""Gradient dtypes the one-pass op widens into fp32 memory (exactly, as torch's mixed add does)."""


def _one_pass_applies(cfg: DGCConfig, density: float, mdt: torch.dtype, wire: torch.dtype, flats) -> bool:
    """Whether a bucket takes the one-pass path: the velocity update deferred into the candidate
    selection (``ops.dgc_accumulate_select_``). It needs the sampled search below density 1, no
    clipping (which scales by the norms first), memory and gradient dtypes the op accumulates
    (fp64 with fp64; fp32 with fp32/bf16/fp16: csrc/dgc_dtypes.h) and contiguous gradients. The
    multi-pass torch path it equals bit for bit takes every other bucket."""
    return (density < 1.0 and cfg.threshold != "exact" and cfg.clip_norm is None
            and (mdt == wire if mdt == torch.float64 else mdt == torch.float32 and wire in _ONE_PASS_WIRE)
            and all(f.is_contiguous() for f in flats))


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
    once_per_step = True  # momentum correction and the residual advance once per optimizer step

    @classmethod
    def from_config(cls, config, *, state, dp_size: int) -> "DGCSparsifier":
        return cls(config, state, dp_size=dp_size)

    @classmethod
    def label(cls, config: DGCConfig) -> str:
        """``dgc <density>``, e.g. ``dgc 0.05``."""
        return f"dgc {config.density:.4g}"

    @classmethod
    def resolve_defaults(cls, config: DGCConfig, optimizer, *, quiet: bool = False) -> tuple[DGCConfig, str]:
        """Momentum correction, the rotating flush and the density ramp where null (``defaults.py``)."""
        return resolve_dgc_defaults(config, optimizer, quiet=quiet)

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
        self._layouts: dict[tuple, _Layout] = {}
        self.loss_scale: float | None = None
        """The loss scale the memory is accumulated at (``set_loss_scale``); ``None``: never set."""
        self._journal: dict[int, list] = {}
        """id(flat residual) → [(memory, its copy at the step's first touch, whether a loss scale scales it)]."""
        self._discard = False
        self._hand_over = False
        self._non_finite_sent = False

    @property
    def value_bits(self) -> int | None:
        """``zen.dgc.value_bits`` (``Sparsifier.value_bits``)."""
        return self.config.value_bits

    @property
    def hand_over(self) -> bool:
        """Hand the accumulated memory to the scheme instead of selecting (an ``AccumulatedGrad``): set by
        the Synchronizer when its scheme selects its own entries (``spardl``, ``core/spardl.py``)."""
        return self._hand_over

    @hand_over.setter
    def hand_over(self, on: bool) -> None:
        # Such a scheme writes its residual back into the memory in place, which 4-bit codes cannot hold:
        # refused when the Synchronizer is built, before the first step.
        if on and self.config.residual_dtype == "int4":
            raise ValueError('zen.dgc.residual_dtype (\'int4\') must be "float32" or "bfloat16" with a scheme that '
                             "selects its own entries (spardl): it writes DGC's residual back in place")
        self._hand_over = bool(on)

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
        if self.loss_scale is not None and scale != self.loss_scale:
            self.state.rescale(scale / self.loss_scale)
            for items in self._journal.values():
                for _, old, scaled in items:
                    if scaled:  # 4-bit codes are relative to their block's scales: only those move
                        old.mul_(scale / self.loss_scale)
        self.loss_scale = scale

    def _snapshot(self, key: torch.Tensor, memories: list) -> None:
        """Copy a bucket's ``memories`` (``(tensor or None, scaled by a loss scale)``) at the step's first
        touch, while steps are transactional (a loss scale was declared), for ``end_step`` to restore."""
        if self.loss_scale is not None and id(key) not in self._journal:
            self._journal[id(key)] = [(t, t.clone(), scaled) for t, scaled in memories if t is not None]

    def discard_step(self) -> None:
        """This optimizer step is skipped (some rank overflowed): ``end_step`` restores the memory."""
        self._discard = True

    def end_step(self) -> None:
        """Commit this step's memory, or restore its snapshot if the step was discarded."""
        if self._discard:
            for items in self._journal.values():
                for t, old, _ in items:
                    t.copy_(old)
        self._journal, self._discard = {}, False

    def resumed(self, saved_config: dict | None, restored: bool) -> None:
        """Reconcile the owner residuals (``value_bits``) with a checkpoint saved under other settings:

        1. value_bits (or owner_error_feedback) now off: drop the saved owner residuals, with a log line
           (they hold sums not applied yet; no later step reads them, and they would be saved forever).
        2. Now on, saved off: the owner residuals start at zero (``state.tensor`` on first use), with a
           log line; the sender residuals restored are exact either way (DGC's residual is the same memory
           with or without value_bits).
        """
        owners = [k for k in self.state.params if k.startswith(OWNER_KEY)]
        on = self.config.value_bits is not None and self.config.owner_error_feedback
        # Step 1: off now.
        if owners and not on:
            numel = sum(int(t.numel()) for k in owners for t in self.state.params[k].values())
            for k in owners:
                del self.state.params[k]
            logger.info("zen: dropping the owner residuals of %d bucket(s) (%d elements) from the checkpoint: "
                        "zen.dgc.value_bits is %s and owner_error_feedback %s in this run",
                        len(owners), numel, self.config.value_bits, self.config.owner_error_feedback)
        # Step 2: on now, off when saved.
        was_on = bool(saved_config) and saved_config.get("value_bits") is not None and bool(
            saved_config.get("owner_error_feedback", True))
        if on and restored and not was_on:
            logger.info("zen: the owner residuals start at zero: the checkpoint was saved without zen.dgc.value_bits "
                        "(or without owner_error_feedback); this run quantizes in %d bits", self.config.value_bits)

    # --- compression --------------------------------------------------------------------------------
    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """Select what ``grads`` send this step and keep the rest in the residuals (``_compress``); with
        ``value_bits``, the result carries ``SparseGrad.lowbit``: the scheme quantizes the values and hands
        back what it sent (``_low_bit_values``)."""
        self._non_finite_sent = False
        sg = self._compress(grads, tp_comm)
        if self.config.value_bits is None or isinstance(sg, AccumulatedGrad):
            return sg
        sg.lowbit = self._low_bit_values(grads, sg)
        return sg

    def _low_bit_values(self, grads: Sequence[NamedGrad], sg: SparseGrad) -> LowBitValues:
        """``zen.dgc.value_bits``' two hooks (``core/lowbit.py``): the sender's error feedback, ``residual +=
        sent − dequantized`` at the sent positions (so ``residual == accumulated − dequantized``; on the
        4-bit residual through ``int4_add_at``), none when non-finite values were sent (the memory stays
        untouched); and the owner residual of this bucket, kept in the state under a name of its own
        (``OWNER_KEY``), journaled like the rest of the memory (a discarded step restores it)."""
        cfg = self.config
        names = tuple(g.name for g in grads)
        numels = tuple(g.grad.numel() for g in grads)
        wire, device = grads[0].grad.dtype, grads[0].grad.device
        owner = None
        if cfg.owner_error_feedback:
            key = f"{OWNER_KEY} {names[0]} .. {names[-1]} ({len(names)})"

            def owner(m: int, dev, key=key) -> torch.Tensor:
                t = self.state.tensor(key, "owner_residual", m, torch.float32, dev)
                self._snapshot(t, [(t, True)])
                return t

        if self._non_finite_sent:
            return LowBitValues(cfg.value_bits, sender_feedback=None, owner_residual=owner)
        pos_K, sent_K = sg.indices, sg.values

        int4 = int4_applies(cfg.residual_dtype, wire)
        mdt = memory_dtype(wire, cfg.residual_dtype)

        def feedback(order_K: torch.Tensor, deq_K: torch.Tensor) -> None:
            idx = pos_K.index_select(0, order_K)
            sent = sent_K.index_select(0, order_K)
            if int4:
                lay = self._layout(names, numels, device)
                int4_add_at(self.state, lay, idx, sent.to(torch.float32) - deq_K)
            else:
                R, _ = self.state.flat(names, numels, "residual", mdt, device)
                R.index_add_(0, idx, sent.to(mdt) - deq_K.to(mdt))

        def fused() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # the fp32 residual: one buffer
            return self.state.flat(names, numels, "residual", mdt, device)[0], pos_K, sent_K

        return LowBitValues(cfg.value_bits, sender_feedback=feedback, owner_residual=owner,
                            sender_residual=fused if not int4 and mdt == torch.float32 else None)

    def _compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
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
        one_pass = not self.hand_over and _one_pass_applies(cfg, density, mdt, wire, flats)
        if int4_applies(cfg.residual_dtype, wire):  # steps 2-5 on the 4-bit residual (int4.py)
            got = compress_int4(self, flats, lay, density, flush, tp_comm)
            return got if got is not None else self._non_finite(flats, total)

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
        convert_residuals(self.state, lay.names, lay.numels, to_int4=False)  # a 4-bit checkpoint's
        R, R_T = self.state.flat(lay.names, lay.numels, "residual", mdt, device)
        U, U_T = (self.state.flat(lay.names, lay.numels, "momentum", mdt, device) if cfg.momentum_correction
                  else (None, None))
        self._snapshot(R, [(R, True), (U, True)])
        gs = flats
        if one_pass:
            got = sampled_thresholds(R, lay, density, tp_comm, torch.finfo(mdt).smallest_normal * torch.finfo(mdt).eps,
                                     cfg, self.state.step, pending=(U, list(flats), finite))
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
        del gs
        if self.hand_over:  # the scheme selects from R and leaves its residual there (core/spardl.py)
            masked = U if cfg.momentum_correction and cfg.momentum_masking else None
            # The rotating flush goes with it: the scheme sends those positions inside its (full) density.
            pos_F = None if not flush else FlushPositions(lay.flush_positions(self.state.step, flush, R.device),
                                                          lay.numels, self.state.step % flush, flush)
            return AccumulatedGrad.of(R, cfg.density_at(self.state.step), wire, masked, pos_F)

        # Step 3 + 4: thresholds, one per selection unit, and the selection mask they give.
        tiny = torch.finfo(mdt).smallest_normal * torch.finfo(mdt).eps  # zeros never travel
        if density >= 1.0:  # dense_steps (or density 1): every non-zero entry travels
            thr_U = torch.full((lay.units,), tiny, dtype=mdt, device=R.device)
            pos_K = lay.select(R, thr_U).view(-1).nonzero().flatten()
            v_K = R.index_select(0, pos_K)
        elif cfg.threshold == "exact":
            thr_U = exact_thresholds(R, lay, density, tp_comm).clamp(min=tiny)
            pos_K = lay.select(R, thr_U).view(-1).nonzero().flatten()  # one host synchronization
            v_K = R.index_select(0, pos_K)
        else:
            thr_U, pos_K, v_K = sampled_thresholds(R, lay, density, tp_comm, tiny, cfg, self.state.step)
        return self._finish(R, U, lay, thr_U, pos_K, wire, mdt, total, v_K, flush)

    def _non_finite(self, flats: list[torch.Tensor], total: int) -> SparseGrad | None:
        """Step 1's element-wise look: the non-finite entries (the memory untouched), or None when
        there are none (huge finite values overflowed the norm)."""
        cat = torch.cat(flats)
        bad = (~torch.isfinite(cat)).nonzero().flatten()
        if not bad.numel():
            return None
        self._non_finite_sent = True
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
