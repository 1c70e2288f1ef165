"""The ``zen.dgc`` section: ``DGCConfig``, its options, defaults and validation (``sparsifier.py`` is
the sparsifier that reads it; ``defaults.py`` decides its null fields when zen attaches to an engine).

Options measured worse than the defaults were removed; a config that still names one is refused with
the reason (``RETIRED_KEYS``). Their measurements: docs/results/dgc_history.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..base import check_bool, check_choice, check_int, check_number, config_from_dict

DEFAULT_WARMUP_STEPS = 100
"""``zen.dgc.warmup_steps`` for null: DGC's density ramp (25 % → ``density``) over 100 optimizer steps
(the longest of the lengths measured; docs/results/dgc_history.md)."""
SELECTIONS = ("per_tensor", "per_bucket")
THRESHOLDS = ("sampled", "exact")
RESIDUAL_DTYPES = ("float32", "bfloat16", "int4")
VALUE_BITS = (8, 4)
"""``zen.dgc.value_bits``' values (zen_ext/core/lowbit.py)."""
INT4_ROUNDINGS = ("nearest", "stochastic")
HISTORY = "docs/results/dgc_history.md"
"""Where the measurements of the removed options are kept."""
RETIRED_KEYS = {
    "feedback": 'EF21 ("ef21") measured far worse than error feedback, the one kept',
    "normalize_beta": "measured worse than off",
    "selection_chunk": "measured no better than one threshold per tensor",
    "dense_from_step": "a dense tail measured worse than a uniform density of the same traffic",
}
"""Keys of ``zen.dgc`` that were removed, and why: naming one is an error (``DGCConfig.from_dict``)."""


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
    """Optimizer steps at the start that send every entry (density 1), before any warm-up ramp: for an
    optimizer that must learn from dense gradients first. 0 = off."""
    warmup_steps: int | None = None
    """Steps over which density ramps exponentially from ``warmup_start_density`` down to ``density``
    (after ``dense_steps``): DGC's warm-up. null (default): decided when zen attaches to the engine
    (``defaults.resolve_dgc_defaults``): ``DEFAULT_WARMUP_STEPS`` (100) where ``density <
    warmup_start_density``, else 0 (a sparsifier built without an engine reads null as 0); 0 = off.
    The ramp's first 100 steps send about 2.5× the elements of 100 steps at 5 %."""
    warmup_start_density: float = 0.25
    """Density at step 0 of the warm-up, in [density, 1] (DGC's schedule starts at 0.25)."""
    min_numel: int = 1024
    """Parameters with fewer elements (and all 1-D ones) go dense: their top-k saves nothing."""
    dense_params: tuple[str, ...] = ()
    """Regular expressions (``re.search`` on the parameter name): matching parameters stay dense,
    e.g. ``["lm_head"]`` for the output layer. Empty (default): routing by shape and size only."""
    flush_fraction: float | None = None
    """Share of each step's density spent on a rotating stride of coordinates, in [0, 1): every
    ``1/(flush_fraction·density)``-th element of each tensor, from a start that moves by one each step,
    the same on every rank, sends its residual whatever its size; the top-k keeps the rest of the budget.
    It bounds how long error feedback holds a coordinate back (each is flushed once per stride of
    steps). 0 = off. null (default): 0.1 when the optimizer is ``zen_ext.optim.CatchUpAdamW`` (the
    recipes' default under DGC) and ``density >= 0.05``, else 0, decided when zen attaches (it helped
    only under a catching-up optimizer: docs/results/dgc_history.md)."""
    residual_dtype: str = "float32"
    """dtype of the residual and momentum: ``"float32"`` (8 bytes per parameter with momentum
    correction) or ``"bfloat16"`` (4 bytes; the accumulation then rounds to 8 mantissa bits), or
    ``"int4"``: the residual as 4-bit codes between each block of 256 elements' min and max (fp32),
    0.53 bytes per parameter, quantized after each step's selection (MicroAdam's error feedback; the
    momentum, when momentum correction keeps one, stays fp32); needs ``threshold: "sampled"`` and no
    ``clip_norm``. fp64 gradients keep fp64 memory either way."""
    int4_rounding: str = "nearest"
    """How the ``"int4"`` residual rounds to its 16 levels: ``"nearest"`` (at most ``(max − min)/30`` off)
    or ``"stochastic"`` (up, with the probability of the fraction: unbiased, so a small gradient that
    keeps coming accumulates instead of being rounded away each step; at most ``(max − min)/15`` off;
    the draw hashes the element and the step, the same on every device)."""
    value_bits: int | None = None
    """Bits of each value on the wire: null (default) sends the gradient's dtype, as always; ``8`` or ``4``
    send symmetric codes with one scale per block of selected values (fp32 per 128 at 8 bits, bf16 per 16
    at 4: 1.03 or 0.63 bytes a value, scales included), with error feedback at both ends: what quantization loses stays in DGC's
    residual (``residual = accumulated − dequantized(sent)``), and each ZEN owner keeps an owner residual
    (fp32, about ``numel/n`` per bucket per rank, checkpointed) for its sums (``owner_error_feedback``).
    Needs a scheme that carries low-bit values (``zen``, ``zen_coo``, or ``auto``, which then chooses
    among them; under reduce-scatter ``zen``'s, or ``auto`` narrowed to it). Design:
    zen_ext/core/lowbit.py; docs/sparsifiers.md."""
    owner_error_feedback: bool = True
    """With ``value_bits``: each owner adds its residual to its sum before quantizing it for the pull, and
    keeps what that quantization lost (DoubleSqueeze's server-side memory). false: the owner's rounding is
    dropped each step (for measuring what the owner residual buys; it then holds no state)."""

    def __post_init__(self) -> None:
        s = "dgc"
        for name in ("enabled", "momentum_masking", "owner_error_feedback"):
            check_bool(s, name, getattr(self, name))
        if self.momentum_correction is not None:  # null: resolved from the optimizer when attached
            check_bool(s, "momentum_correction", self.momentum_correction)
        for name in ("density", "sample_fraction", "momentum", "warmup_start_density"):
            check_number(s, name, getattr(self, name))
        if self.flush_fraction is not None:  # null: decided from the optimizer when attached
            check_number(s, "flush_fraction", self.flush_fraction)
        if self.warmup_steps is not None:  # null: decided when zen attaches (default_ramp_steps)
            check_int(s, "warmup_steps", self.warmup_steps)
        check_int(s, "dense_steps", self.dense_steps)
        check_int(s, "min_numel", self.min_numel)
        check_choice(s, "selection", self.selection, SELECTIONS)
        check_choice(s, "threshold", self.threshold, THRESHOLDS)
        check_choice(s, "residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        check_choice(s, "int4_rounding", self.int4_rounding, INT4_ROUNDINGS)
        if self.residual_dtype == "int4" and self.threshold == "exact":
            raise ValueError('zen.dgc.residual_dtype ("int4") must go with zen.dgc.threshold "sampled", because the '
                             'exact top-k sorts a full-size fp32 copy of the values the 4-bit residual avoids')
        if self.residual_dtype == "int4" and self.clip_norm is not None:
            raise ValueError(f'zen.dgc.residual_dtype ("int4") must go with zen.dgc.clip_norm null, because local '
                             f'clipping ({self.clip_norm!r}) scales a full-size fp32 copy of the gradients the 4-bit '
                             f'residual avoids')
        if self.value_bits is not None and (isinstance(self.value_bits, bool) or self.value_bits not in VALUE_BITS):
            raise ValueError(f"zen.dgc.value_bits ({self.value_bits!r}) must be one of {list(VALUE_BITS)} or null "
                             f"(the gradient's dtype)")
        if not 0 < self.density <= 1:
            raise ValueError(f"zen.dgc.density ({self.density!r}) must be in (0, 1]")
        if self.flush_fraction is not None and not 0 <= self.flush_fraction < 1:
            raise ValueError(f"zen.dgc.flush_fraction ({self.flush_fraction!r}) must be in [0, 1)")
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
        """The section from a plain dict (JSON keys equal field names), or ``values`` itself.

        Raises:
            ValueError: a removed key (``RETIRED_KEYS``: why, and where it was measured), an unknown
                key (the valid ones are listed), or ``momentum_masking`` true beside an explicit false
                ``momentum_correction`` (a JSON-only check: the dataclass default of masking is true).
        """
        if isinstance(values, dict):
            retired = [k for k in RETIRED_KEYS if k in values]
            if retired:
                k = retired[0]
                raise ValueError(f"zen.dgc.{k} was removed ({RETIRED_KEYS[k]}: {HISTORY}); remove the key")
            if values.get("momentum_correction") is False and values.get("momentum_masking") is True:
                raise ValueError("zen.dgc.momentum_masking (True) must be false when zen.dgc.momentum_correction "
                                 "is false, because masking zeroes the momentum that only momentum correction keeps")
        return config_from_dict(cls, values, "dgc")

    def density_at(self, step: int) -> float:
        """The density of optimizer step ``step`` (0-based): 1 for ``dense_steps``, then the warm-up ramp."""
        if step < self.dense_steps:
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
