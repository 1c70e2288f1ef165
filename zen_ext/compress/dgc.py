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
* **threshold by sampling** (``threshold="sampled"``): ``sample_fraction`` of ``|v|`` by an odd stride
  (no aliasing with row layouts), the threshold is the sample's ``density`` quantile, then
  ``REFINE_PASSES`` passes move the sample rank by ``k / count`` while the count is outside
  ``REFINE_BAND·k``. Counts and thresholds stay on the device (``torch.where``, no branch on a GPU
  scalar), so a bucket costs **one** host synchronization (the ``nonzero`` that sizes the message),
  not one per tensor. ``"exact"`` takes the ``k``-th largest ``|v|`` (``torch.topk``); ties at the
  threshold are kept in both modes.
* **tensor parallelism**: with ``tp_comm`` every TP rank samples its shard, the samples (with each
  shard's numel) are all-gathered over the TP group in one message per bucket, and the counts of each
  pass are all-reduced, so every TP rank derives the same threshold per layer (ZEN §4: "sampling
  data locally ..., gathering these samples across all devices, computing a global top-k threshold").
* **local gradient clipping** (``clip_norm``): each parameter's local gradient is scaled to an L2 norm
  of at most ``clip_norm / sqrt(dp_size)`` before accumulation (DGC §3.2's ``N^{-1/2}`` rule, applied
  per tensor because a bucket hook never sees the whole model's gradient at once).
* **warm-up**: density ramps exponentially from ``warmup_start_density`` to ``density`` over the first
  ``warmup_steps`` steps.
* **memory in fp32** for fp16/bf16 gradients; values travel in the gradient's dtype, and the rounding
  error of that cast stays in the residual, so conservation is still exact.
* **non-finite gradients** (an fp16 loss-scale overflow): the memory is left untouched and the
  non-finite entries are sent as they are, so the engine sees the overflow and skips the step.

Bytes: DGC itself sends nothing over the data-parallel group; it hands ``≈ density·numel`` element
COO pairs to the scheme. Over the TP group a rank sends ``(8·(1 + 2U) + 4·S)`` bytes per bucket to
each peer (``U`` selection units, ``S`` samples) plus ``REFINE_PASSES`` all-reduces of ``U`` int64.

Momentum correction moves the momentum into the sparsifier: use an optimizer without momentum for
DGC parameters (DGC's ``DGCSGD``), or set ``momentum_correction=False`` to keep plain error feedback.

Legend: ``_N`` elements of one gradient, ``_K`` selected, ``_S`` samples, ``_U`` selection units.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

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

SELECTIONS = ("per_tensor", "per_bucket")
THRESHOLDS = ("sampled", "exact")
REFINE_PASSES = 3
"""Threshold refinement passes after the sampled estimate (each one count over the tensor)."""
REFINE_BAND = (0.8, 1.25)
"""A count within ``[0.8·k, 1.25·k]`` is accepted; outside it the threshold moves (``_ThresholdSearch``)."""
FREE_HOST_READ_DEVICES = ("cpu",)
"""Device types where the search may read its done flags on the host to stop early (free on CPU)."""
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
    warmup_steps: int = 0
    """Steps over which density ramps exponentially from ``warmup_start_density`` down to
    ``density``. 0 = off."""
    warmup_start_density: float = 0.25
    """Density at step 0 of the warm-up, in [density, 1] (DGC's schedule starts at 0.25)."""
    min_numel: int = 1024
    """Parameters with fewer elements (and all 1-D ones) go dense: their top-k saves nothing."""

    def __post_init__(self) -> None:
        s = "dgc"
        for name in ("enabled", "momentum_masking"):
            check_bool(s, name, getattr(self, name))
        if self.momentum_correction is not None:  # null: resolved from the optimizer when attached
            check_bool(s, "momentum_correction", self.momentum_correction)
        for name in ("density", "sample_fraction", "momentum", "warmup_start_density"):
            check_number(s, name, getattr(self, name))
        check_int(s, "warmup_steps", self.warmup_steps)
        check_int(s, "min_numel", self.min_numel)
        check_choice(s, "selection", self.selection, SELECTIONS)
        check_choice(s, "threshold", self.threshold, THRESHOLDS)
        if not 0 < self.density <= 1:
            raise ValueError(f"zen.dgc.density ({self.density!r}) must be in (0, 1]")
        if not 0 < self.sample_fraction <= 1:
            raise ValueError(f"zen.dgc.sample_fraction ({self.sample_fraction!r}) must be in (0, 1]")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"zen.dgc.momentum ({self.momentum!r}) must be in [0, 1)")
        if self.clip_norm is not None:
            check_number(s, "clip_norm", self.clip_norm)
            if not self.clip_norm > 0:
                raise ValueError(f"zen.dgc.clip_norm ({self.clip_norm!r}) must be > 0 or null (off)")
        if self.warmup_steps < 0:
            raise ValueError(f"zen.dgc.warmup_steps ({self.warmup_steps!r}) must be >= 0")
        if not 0 < self.warmup_start_density <= 1:
            raise ValueError(f"zen.dgc.warmup_start_density ({self.warmup_start_density!r}) must be in (0, 1]")
        if self.warmup_steps > 0 and self.warmup_start_density < self.density:
            raise ValueError(f"zen.dgc.warmup_start_density ({self.warmup_start_density!r}) must be >= "
                             f"zen.dgc.density ({self.density!r}), because warm-up sends more, not less")
        if self.min_numel < 0:
            raise ValueError(f"zen.dgc.min_numel ({self.min_numel!r}) must be >= 0")

    @classmethod
    def from_dict(cls, values: "dict | DGCConfig | None") -> "DGCConfig":
        return config_from_dict(cls, values, "dgc")

    def density_at(self, step: int) -> float:
        """The density of optimizer step ``step`` (0-based), warm-up included."""
        if step >= self.warmup_steps:
            return self.density
        start = self.warmup_start_density
        return start * (self.density / start) ** (step / self.warmup_steps)


class DGCSparsifier(Sparsifier):
    """DGC top-k with momentum correction, masking, clipping, warm-up and exact error feedback.

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

    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """Select what ``grads`` send this step and keep the rest in the residuals.

        1. Guard: if any gradient is non-finite, send its non-finite entries and leave the memory alone.
        2. Clip each local gradient (``clip_norm``) and accumulate it into its velocity ``v``.
        3. Choose one threshold per selection unit (sampled + refined, or exact), common to the TP group.
        4. Select ``|v| ≥ threshold`` (non-zeros only) over the concatenation: one ``nonzero``.
        5. Error feedback: ``v ← v − sent`` exactly; zero the momentum at sent positions.

        Args:
            grads: the DGC gradients of one bucket, in bucket order, of one dtype and device.
            tp_comm: the tensor-parallel group (``None``: no TP); every TP rank must pass the same names.

        Returns:
            An element-form SparseGrad over the concatenation of ``grads``, values in their dtype.
        """
        if not grads:
            raise ValueError("DGCSparsifier.compress needs at least one gradient")
        cfg = self.config
        flats = [g.grad.reshape(-1) for g in grads]
        wire = flats[0].dtype
        adt = acc_dtype(wire)
        total = sum(f.numel() for f in flats)

        # Step 1: an overflowed (fp16) gradient must reach the engine as such and never the memory.
        # A sum is non-finite if any element is (one cheap pass); only then look element-wise, since
        # a sum of huge finite values may overflow too.
        if not bool(torch.isfinite(torch.stack([f.sum(dtype=adt) for f in flats])).all()):
            cat = torch.cat(flats)
            bad = (~torch.isfinite(cat)).nonzero().flatten()
            if bad.numel():
                return SparseGrad(bad, cat[bad], total)

        # Step 2: local clipping, then accumulate the velocity (momentum correction) or the gradient.
        vs = []
        for ng, g in zip(grads, flats):
            v = self.state.tensor(ng.name, "residual", g.numel(), adt, g.device)
            g = g.to(adt)  # may alias the bucket: only read below
            if cfg.clip_norm is not None:
                limit = cfg.clip_norm / math.sqrt(self.dp_size)
                g = g * (limit / (torch.linalg.vector_norm(g) + 1e-6)).clamp(max=1.0)
            if cfg.momentum_correction:
                u = self.state.tensor(ng.name, "momentum", g.numel(), adt, g.device)
                u.mul_(cfg.momentum).add_(g)
                v.add_(u)
            else:
                v.add_(g)
            vs.append(v)

        # Step 3: thresholds, one per selection unit (per tensor or per bucket).
        names = [g.name for g in grads]
        units = [[i] for i in range(len(vs))] if cfg.selection == "per_tensor" else [list(range(len(vs)))]
        abs_vs = [v.abs() for v in vs]
        thr_U = self._thresholds(names, abs_vs, units, cfg.density_at(self.state.step), tp_comm)
        # Zeros never travel, even when the threshold is 0 (fewer non-zeros than k).
        tiny = torch.finfo(adt).smallest_normal * torch.finfo(adt).eps
        thr_per = [None] * len(vs)
        for u, thr in zip(units, thr_U):
            thr = thr.clamp(min=tiny)
            for i in u:
                thr_per[i] = thr
                self.state.set(names[i], "threshold", thr)

        # Step 4: select over the concatenation; the nonzero is the bucket's one host synchronization.
        masks = [a >= t for a, t in zip(abs_vs, thr_per)]
        pos_K = torch.cat(masks).nonzero().flatten()
        cat_v = torch.cat(vs) if len(vs) > 1 else vs[0]
        sent_K = cat_v[pos_K].to(wire)

        # Step 5: residual = v − sent, exactly (the cast's rounding error stays behind); masking.
        for name, v, m in zip(names, vs, masks):
            if adt == wire:
                v.masked_fill_(m, 0)
            else:
                v.sub_(torch.where(m, v.to(wire).to(adt), torch.zeros((), dtype=adt, device=v.device)))
            if cfg.momentum_correction and cfg.momentum_masking:
                self.state.get(name, "momentum").masked_fill_(m, 0)
        return SparseGrad(pos_K, sent_K, total)

    # --- thresholds ---------------------------------------------------------------------------------
    def _thresholds(self, names: list[str], abs_vs: list[torch.Tensor], units: list[list[int]],
                    density: float, tp_comm) -> list[torch.Tensor]:
        """One 0-d threshold tensor per unit such that about ``density`` of the unit's values reach it."""
        exact = self.config.threshold == "exact"
        numel_U = [sum(abs_vs[i].numel() for i in u) for u in units]
        samples_U = []
        for u, n in zip(units, numel_U):
            parts = [abs_vs[i] for i in u]
            if exact:
                samples_U.append(torch.cat(parts) if len(parts) > 1 else parts[0])
            else:
                samples_U.append(self._sample(parts, n, density, names[u[0]]))
        tp = tp_comm is not None and tp_comm.size > 1
        if tp:
            samples_U, numel_U = _gather_samples(samples_U, numel_U, tp_comm)
        k_U = [max(1, math.ceil(density * n)) for n in numel_U]
        if exact:
            return [s.topk(min(k, s.numel())).values[-1] for s, k in zip(samples_U, k_U)]

        # Sampled: start at the sample's density quantile, then search (counts are global under TP).
        searches = [_ThresholdSearch(s.sort(descending=True).values, k, n) for s, k, n in zip(samples_U, k_U, numel_U)]
        for _ in range(REFINE_PASSES):
            counts_U = torch.stack([sum(torch.count_nonzero(abs_vs[i] >= s.thr) for i in u)
                                    for u, s in zip(units, searches)])
            if tp:
                tp_comm.all_reduce(counts_U)
            for j, s in enumerate(searches):
                s.update(counts_U[j])
            # On the CPU reading a flag costs nothing: stop once every unit is in the band. On a GPU
            # the passes run blind (a read would synchronize). TP ranks decide alike (global counts).
            if counts_U.device.type in FREE_HOST_READ_DEVICES and bool(torch.stack([s.done for s in searches]).all()):
                break
        return [s.thr for s in searches]

    def _sample(self, parts: list[torch.Tensor], numel: int, density: float, key: str) -> torch.Tensor:
        """Strided samples over the concatenation of ``parts``, with an offset that changes per step."""
        num = min(numel, max(math.ceil(self.config.sample_fraction * numel), math.ceil(MIN_KEPT_SAMPLES / density)))
        if num >= numel:
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        stride = numel // num
        if stride > 1 and stride % 2 == 0:
            stride -= 1  # an odd stride walks through every column of a power-of-two-wide matrix
        offset = zlib.crc32(f"{key}:{self.state.step}".encode()) % stride
        out, base = [], 0
        for a in parts:
            n = a.numel()
            # Sample j sits at offset + j·stride; those inside [base, base + n) belong to this part.
            j0 = max(0, -((offset - base) // stride))
            j1 = min(num, -((offset - base - n) // stride))
            if j1 > j0:
                out.append(a[torch.arange(j0, j1, device=a.device) * stride + (offset - base)])
            base += n
        return torch.cat(out)


def _at_rank(sorted_S: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The value at 1-based (fractional, device) rank ``rank`` of a descending sort, as a 0-d tensor."""
    idx = (rank.ceil().long() - 1).clamp(0, sorted_S.numel() - 1)
    return sorted_S.index_select(0, idx.reshape(1)).reshape(())


class _ThresholdSearch:
    """Find a threshold whose count lies in ``REFINE_BAND·k``, on device scalars only (no host branch).

    The first probe is the sample's density quantile. While only one side of the target is known, the
    next probe moves the sample rank by ``k / count`` (exact if the sample were perfectly
    representative). Once one probe counted too many and another too few, the next one interpolates
    between the closest two in (threshold, log count), which a lumpy sample cannot make oscillate.
    A probe inside the band is kept.
    """

    def __init__(self, sorted_S: torch.Tensor, k: int, numel: int) -> None:
        dev = sorted_S.device
        self.sorted_S, self.k = sorted_S, k
        ns = sorted_S.numel()
        # torch.full launches a fill; torch.tensor(x, device=cuda) would copy and synchronize.
        self.rank = torch.full((), min(max(1.0, k * ns / numel), ns), dtype=torch.float64, device=dev)
        self.thr = _at_rank(sorted_S, self.rank)
        f64 = dict(dtype=torch.float64, device=dev)
        self.done = torch.zeros((), dtype=torch.bool, device=dev)
        # Closest probe with too many selected (highest such threshold) and with too few (lowest).
        self.has_over, self.t_over, self.c_over = self.done.clone(), torch.zeros((), **f64), torch.zeros((), **f64)
        self.has_under, self.t_under, self.c_under = self.done.clone(), torch.zeros((), **f64), torch.zeros((), **f64)

    def update(self, count: torch.Tensor) -> None:
        """Record the count at ``self.thr`` and move ``self.thr`` to the next probe."""
        lo, hi = REFINE_BAND
        k, c, t = self.k, count.to(torch.float64), self.thr.to(torch.float64)
        self.done = self.done | ((c >= lo * k) & (c <= hi * k))
        over = (c > hi * k) & (~self.has_over | (t > self.t_over))
        under = (c < lo * k) & (~self.has_under | (t < self.t_under))
        self.t_over, self.c_over = torch.where(over, t, self.t_over), torch.where(over, c, self.c_over)
        self.t_under, self.c_under = torch.where(under, t, self.t_under), torch.where(under, c, self.c_under)
        self.has_over, self.has_under = self.has_over | over, self.has_under | under
        # Next probe: rank step on the sample, or interpolation once the target is bracketed.
        rank = (self.rank * k / c.clamp(min=1)).clamp(1, self.sorted_S.numel())
        t_rank = _at_rank(self.sorted_S, rank).to(torch.float64)
        log_over, log_under = self.c_over.clamp(min=0.5).log(), self.c_under.clamp(min=0.5).log()
        w = (log_over - math.log(k)) / (log_over - log_under).clamp(min=1e-12)
        t_interp = self.t_over + (self.t_under - self.t_over) * w
        t_next = torch.where(self.has_over & self.has_under, t_interp, t_rank)
        self.rank = torch.where(self.done, self.rank, rank)
        self.thr = torch.where(self.done, self.thr, t_next.to(self.thr.dtype))


def _gather_samples(samples_U: list[torch.Tensor], numel_U: list[int], tp_comm) -> tuple[list[torch.Tensor], list[int]]:
    """All-gather every unit's samples and numel over the TP group; pooled in rank order on every rank.

    Raises:
        RuntimeError: TP ranks disagree on the number of selection units.
    """
    device, dtype = samples_U[0].device, samples_U[0].dtype
    u = len(samples_U)
    header = torch.tensor([u, *numel_U, *(s.numel() for s in samples_U)], dtype=torch.int64, device=device)
    parts = tp_comm.all_gather_v(pack(header, *samples_U))
    pooled: list[list[torch.Tensor]] = [[] for _ in range(u)]
    totals = [0] * u
    for r, buf in enumerate(parts):
        u_r = int(view_as(buf, 0, 1, torch.int64))
        if u_r != u:
            raise RuntimeError(f"zen.dgc: TP rank {r} has {u_r} selection units but TP rank {tp_comm.rank} "
                               f"has {u}; every TP rank must compress the same parameters in the same buckets")
        meta = view_as(buf, 8, 2 * u, torch.int64).tolist()
        vals = view_as(buf, 8 * (1 + 2 * u), sum(meta[u:]), dtype)
        for j, (n, s) in enumerate(zip(meta[:u], vals.split(meta[u:]))):
            totals[j] += n
            pooled[j].append(s)
    return [torch.cat(p) for p in pooled], totals
