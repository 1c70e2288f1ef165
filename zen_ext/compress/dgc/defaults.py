"""The ``zen.dgc`` defaults decided when zen attaches to an engine (``DGCSparsifier.resolve_defaults``):
DGC's momentum correction and its rotating flush (from the engine's optimizer), and its density ramp.

DGC's DGCSGD moves momentum into the sparsifier; with an optimizer that keeps its own moments that
would apply momentum twice, so ``zen.dgc.momentum_correction: null`` is decided here, once the engine
has its optimizer (before the first step), and the reason goes into the start-up log. So is
``zen.dgc.flush_fraction: null``: a bound on how long error feedback holds a coordinate back pays
under ``zen_ext.optim.CatchUpAdamW`` (which moves a held-back coordinate as far as the steps it
missed) and not under plain Adam (docs/results/dgc_history.md).
"""

from __future__ import annotations

import dataclasses
import logging

from .config import DGCConfig

log = logging.getLogger("zen_ext.config")  # the config's logger: users filter zen's config messages by it


FLUSH_WITH_CATCH_UP = 0.1
"""``zen.dgc.flush_fraction`` chosen for null under a catching-up optimizer at ``density >=
FLUSH_MIN_DENSITY``: at 5 % every coordinate is then sent at least once per 200 steps."""
FLUSH_MIN_DENSITY = 0.05
"""Below this density the flush's stride (1,000 steps at 1 %) rarely binds, and the share of the top-k
budget it takes bought nothing measurable (docs/results/dgc_history.md)."""


def _innermost(optimizer):
    """The real optimizer inside wrappers (``.optimizer`` / ``.optim``: DeepSpeed's ZeRO, BF16 and FP16
    optimizers, ColossalAI's OptimizerWrapper, Accelerate's AcceleratedOptimizer): the innermost object
    with param groups, or ``optimizer`` itself."""
    chain = [optimizer]
    while optimizer is not None and len(chain) < 8:
        nxt = next((getattr(chain[-1], a) for a in ("optimizer", "optim")
                    if getattr(chain[-1], a, None) is not None), None)
        if nxt is None or any(nxt is c for c in chain):
            break
        chain.append(nxt)
    return next((c for c in reversed(chain) if getattr(c, "param_groups", None)), optimizer)


def optimizer_catches_up(optimizer) -> bool:
    """Whether ``optimizer`` (wrapped or not) moves a held-back gradient as the steps it missed: a
    ``zen_ext.optim.CatchUpAdamW`` with a group that catches up."""
    groups = getattr(_innermost(optimizer), "param_groups", None) or []
    return any(g.get("catch_up", False) for g in groups)


def optimizer_momentum(optimizer) -> tuple[bool | None, str]:
    """Whether ``optimizer`` applies momentum of its own, and its description.

    Wrappers are unwrapped through their ``.optimizer`` / ``.optim`` attribute (DeepSpeed's ZeRO,
    BF16 and FP16 optimizers, ColossalAI's OptimizerWrapper, Accelerate's AcceleratedOptimizer).

    Returns:
        ``(False, "SGD (momentum 0)")`` for SGD without momentum, ``(True, ...)`` for optimizers that
        keep moments (any with ``betas``: the Adam family, LAMB, Lion; SGD with momentum > 0), and
        ``(None, ...)`` when unknown (no optimizer, or one without either hint).
    """
    inner = _innermost(optimizer)
    groups = getattr(inner, "param_groups", None)
    if not groups:
        return None, "no optimizer given" if optimizer is None else f"{type(optimizer).__name__} (param groups unknown)"
    name = type(inner).__name__
    if any("betas" in g for g in groups) or any(t in name for t in ("Adam", "Lamb", "LAMB", "Lion")):
        return True, f"{name} keeps its own moments"
    if any("momentum" in g for g in groups):
        m = max(float(g.get("momentum") or 0.0) for g in groups)
        if m == 0 and "SGD" in name:
            return False, f"{name} with momentum 0"
        return m > 0 or None, f"{name} with momentum {m:g}"
    return None, f"{name} (not known to be momentum-free)"


def resolve_dgc_defaults(d: DGCConfig, optimizer, *, quiet: bool = False) -> tuple[DGCConfig, str]:
    """Decide ``zen.dgc.momentum_correction``, ``zen.dgc.flush_fraction`` and ``zen.dgc.warmup_steps``
    where null (the first two from the optimizer the engine has).

    1. Momentum correction (``u ← m·u + g; v ← v + u``) moves the momentum into the sparsifier, which is
       right only when the optimizer applies none (DGC's DGCSGD: SGD with momentum 0). With Adam-family
       optimizers or momentum-SGD it would apply momentum twice, so null becomes false there and
       whenever the optimizer is unknown (plain error feedback, right for every optimizer). An explicit
       true with an optimizer that keeps moments is kept, with a warning.
    2. The rotating flush: null becomes ``FLUSH_WITH_CATCH_UP`` under a catching-up optimizer
       (``CatchUpAdamW``) at ``density >= FLUSH_MIN_DENSITY``, 0 otherwise.
    3. DGC's density ramp: null ``warmup_steps`` becomes ``DEFAULT_WARMUP_STEPS`` where ``density <
       warmup_start_density`` (``DGCConfig.default_ramp_steps``), 0 otherwise.

    Args:
        d: the validated ``zen.dgc`` section.
        optimizer: the engine's optimizer (wrapped or not), or None when the caller has none.
        quiet: log no warning (the ranks other than 0).

    Returns:
        The section with the fields decided (a copy when one changed) and a short reason for logs
        (empty when DGC is off).
    """
    if not d.enabled:
        return d, ""
    # Step 1: momentum correction.
    has_momentum, what = optimizer_momentum(optimizer)
    if d.momentum_correction is None:
        if optimizer is None and not quiet:
            log.warning("zen: zen.dgc.momentum_correction is null and no optimizer was given: using false (plain "
                        "error feedback, right for Adam and momentum-SGD); pass the training optimizer (the DDP "
                        "hook's optimizer=), or set it true for SGD with momentum 0 (DGC's DGCSGD)")
        correction = has_momentum is False
        why = ("DGC supplies the momentum (dgc.momentum %g), as DGC's DGCSGD" % d.momentum if correction else
               "momentum correction would apply momentum twice" if has_momentum else
               "plain error feedback is right for any optimizer")
        note = f"momentum_correction={str(correction).lower()} (chosen: {what}; {why})"
    else:
        correction = d.momentum_correction
        if correction and has_momentum and not quiet:
            log.warning("zen: zen.dgc.momentum_correction is true but the optimizer (%s) applies momentum too, so "
                        "momentum is applied twice; set it false (or null to choose from the optimizer), or use "
                        "SGD with momentum 0 as DGC's DGCSGD does", what)
        note = f"momentum_correction={str(correction).lower()} (set in the config; optimizer: {what})"
    # Step 2: the rotating flush, said only where it is on or a catching-up optimizer goes without it.
    flush = d.flush_fraction
    if flush is None:
        up = optimizer_catches_up(optimizer)
        flush = FLUSH_WITH_CATCH_UP if up and d.density >= FLUSH_MIN_DENSITY else 0.0
        if flush:
            stride = dataclasses.replace(d, flush_fraction=flush).flush_stride(d.density)
            note += (f"; flush_fraction={flush:g} (chosen: the optimizer catches up held-back gradients; each "
                     f"coordinate is sent at least every {stride} steps)")
        elif up:
            note += f"; flush_fraction=0 (chosen: density {d.density:g} < {FLUSH_MIN_DENSITY:g})"
    # Step 3: DGC's density ramp, said where it is on by default (it sends more in its first steps).
    ramp = d.warmup_steps
    if ramp is None:
        ramp = d.default_ramp_steps()
        if ramp:
            note += f"; warmup_steps={ramp} (default: DGC's warm-up, density {d.warmup_start_density:g} → {d.density:g})"
    if (correction, flush, ramp) != (d.momentum_correction, d.flush_fraction, d.warmup_steps):
        d = dataclasses.replace(d, momentum_correction=correction, flush_fraction=flush, warmup_steps=ramp)
    return d, note
