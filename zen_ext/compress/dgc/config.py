"""The ``zen.dgc`` section: ``DGCConfig``, its options, defaults and validation (``compress/dgc.py``
is the sparsifier that reads it)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .base import check_bool, check_choice, check_int, check_number, config_from_dict

DEFAULT_WARMUP_STEPS = 100
"""``zen.dgc.warmup_steps`` for null: DGC's density ramp (25 % → ``density``) over 100 optimizer steps
(the longest measured; 20 and 50 closed less of the gap to dense, see ``DGCConfig.warmup_steps``)."""
SELECTIONS = ("per_tensor", "per_bucket")
THRESHOLDS = ("sampled", "exact")
RESIDUAL_DTYPES = ("float32", "bfloat16")
FEEDBACKS = ("ef", "ef21")


@dataclass(frozen=True)
class DGCConfig:
    """The ``zen.dgc`` section. Tuning: start at the defaults; under Adam train with
    ``zen_ext.optim.CatchUpAdamW`` (the recipes' default under DGC; it closes most of DGC's loss gap to
    dense); lower ``density`` only with warm-up; fine-tune on a decaying learning rate."""

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
    dense_from_step: int = 0
    """Optimizer step from which every entry is sent again (density 1) to the end: a dense tail that
    releases the residuals and ends training on dense gradients, at dense's traffic for those steps.
    0 (default) = off. Measured under AdamW, DGC 5 % with the last 20 % of the steps dense (24 % of the
    elements on average; benchmarks/results/time_to_quality.md): +0.9 % fine-tuning and +6.8 % from
    scratch, where a uniform 25 % gives +0.6 % and +1.9 %."""
    warmup_steps: int | None = None
    """Steps over which density ramps exponentially from ``warmup_start_density`` down to ``density``
    (after ``dense_steps``): DGC's warm-up. null (default): decided when zen attaches to the engine
    (``config_defaults.resolve_dgc_defaults``): ``DEFAULT_WARMUP_STEPS`` (100) where ``density <
    warmup_start_density``, else 0 (a sparsifier built without an engine reads null as 0); 0 = off.
    Measured from scratch at 5 % (5 seeds, benchmarks/results/time_to_quality_catch_up_scratch.md): gap to dense +2.24 % without a ramp, +1.98 %
    / +1.87 % / +1.67 % with 20 / 50 / 100 steps under CatchUpAdamW; +8.4 % → +8.0 % under AdamW; it
    never hurt fine-tuning. The ramp's first 100 steps send about 2.5× the elements of 100 steps at 5 %."""
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
    flush_fraction: float | None = None
    """Share of each step's density spent on a rotating stride of coordinates, in [0, 1): every
    ``1/(flush_fraction·density)``-th element of each tensor, from a start that moves by one each step,
    the same on every rank, sends its residual whatever its size; the top-k keeps the rest of the budget.
    It bounds how long error feedback holds a coordinate back (each is flushed once per stride of
    steps). 0 = off. null (default): 0.1 when the optimizer is ``zen_ext.optim.CatchUpAdamW`` (the
    recipes' default under DGC) and ``density >= 0.05``, else 0, decided when zen attaches. Measured
    from scratch with CatchUpAdamW (time_to_quality_catch_up_scratch.md, 5 seeds): +2.3 % → +1.4 % at
    5 % with the demo's density ramp, no change without a ramp or at 1 %; under plain Adam worse than off."""
    normalize_beta: float = 0.0
    """Adam-aware selection: rank the residuals by ``|r| / sqrt(s)``, ``s`` each element's running mean
    of its squared local gradient with this decay (AdamW's ``beta2``, e.g. 0.95), in place of ``|r|``:
    a coordinate is sent once its residual is large against its own gradient scale, as Adam normalizes
    each coordinate's step. One more buffer of memory per parameter; the bucket takes the torch path.
    0 (default) = off, in [0, 1). Measured under AdamW (benchmarks/results/time_to_quality.md): far
    worse than off at 5 % (0.95: +35.9 % from scratch, +4.9 % fine-tuning, against +8.4 / +3.7 %): the
    budget the small-scale coordinates take is missed where the large residuals are; kept as a measured
    alternative."""
    selection_chunk: int = 0
    """Finer selection units: the exact top ``density`` of every run of this many elements of each
    tensor (e.g. a few rows), in place of one threshold per tensor; needs ``threshold: "exact"`` and no
    tensor parallelism. 0 (default) = off (``selection`` decides). Measured under AdamW at 5 %
    (benchmarks/results/time_to_quality.md, 256: +9.8 % from scratch, +4.0 % fine-tuning, against +8.4 %
    and the exact per-tensor top-k's +4.0 %): no better than one threshold per tensor."""
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
        for name in ("density", "sample_fraction", "momentum", "warmup_start_density", "normalize_beta"):
            check_number(s, name, getattr(self, name))
        if self.flush_fraction is not None:  # null: decided from the optimizer when attached
            check_number(s, "flush_fraction", self.flush_fraction)
        if self.warmup_steps is not None:  # null: decided when zen attaches (default_ramp_steps)
            check_int(s, "warmup_steps", self.warmup_steps)
        check_int(s, "dense_steps", self.dense_steps)
        check_int(s, "dense_from_step", self.dense_from_step)
        if self.dense_from_step < 0:
            raise ValueError(f"zen.dgc.dense_from_step ({self.dense_from_step!r}) must be >= 0 (0: off)")
        check_int(s, "min_numel", self.min_numel)
        check_int(s, "selection_chunk", self.selection_chunk)
        if self.selection_chunk < 0 or (self.selection_chunk and self.threshold != "exact"):
            raise ValueError(f'zen.dgc.selection_chunk ({self.selection_chunk!r}) must be 0 or, with zen.dgc.threshold '
                             f'"exact" (got {self.threshold!r}), a positive number of elements')
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
        if self.flush_fraction is not None and not 0 <= self.flush_fraction < 1:
            raise ValueError(f"zen.dgc.flush_fraction ({self.flush_fraction!r}) must be in [0, 1)")
        if not 0 <= self.normalize_beta < 1:
            raise ValueError(f"zen.dgc.normalize_beta ({self.normalize_beta!r}) must be in [0, 1)")
        if self.normalize_beta and self.feedback == "ef21":
            raise ValueError(f'zen.dgc.normalize_beta ({self.normalize_beta!r}) must be 0 when zen.dgc.feedback '
                             'is "ef21": the normalized selection is for error feedback ("ef")')
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
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"zen.dgc.warmup_steps ({self.warmup_steps!r}) must be >= 0")
        if self.dense_steps < 0:
            raise ValueError(f"zen.dgc.dense_steps ({self.dense_steps!r}) must be >= 0")
        if not 0 < self.warmup_start_density <= 1:
            raise ValueError(f"zen.dgc.warmup_start_density ({self.warmup_start_density!r}) must be in (0, 1]")
        if self.warmup_steps and self.warmup_start_density < self.density:
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
        """The density of optimizer step ``step`` (0-based): 1 for ``dense_steps``, then the warm-up ramp;
        1 again from ``dense_from_step``."""
        if step < self.dense_steps or 0 < self.dense_from_step <= step:
            return 1.0
        step -= self.dense_steps
        ramp = self.ramp_steps
        if step >= ramp:
            return self.density
        start = self.warmup_start_density
        return start * (self.density / start) ** (step / ramp)

    @property
    def ramp_steps(self) -> int:
        """The warm-up's length: ``warmup_steps``, 0 while null (not yet decided)."""
        return self.warmup_steps or 0

    def default_ramp_steps(self) -> int:
        """What a null ``warmup_steps`` becomes: ``DEFAULT_WARMUP_STEPS`` where the ramp starts above
        ``density`` (it sends more), else 0."""
        return DEFAULT_WARMUP_STEPS if self.density < self.warmup_start_density else 0

    def flush_stride(self, density: float) -> int:
        """The stride of the rotating flush at ``density`` (0: no flush this step)."""
        if not self.flush_fraction or density >= 1.0:
            return 0
        return max(1, round(1.0 / (self.flush_fraction * density)))
