"""The ``"zen"`` section's defaults that depend on the engine's optimizer: DGC's momentum correction.

DGC's DGCSGD moves momentum into the sparsifier; with an optimizer that keeps its own moments that
would apply momentum twice, so ``zen.dgc.momentum_correction: null`` is decided here, once the engine
has its optimizer (before the first step), and the reason goes into the start-up log.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ZenConfig

log = logging.getLogger("zen_ext.config")  # the config's logger: users filter zen's config messages by it


def optimizer_momentum(optimizer) -> tuple[bool | None, str]:
    """Whether ``optimizer`` applies momentum of its own, and its description.

    Wrappers are unwrapped through their ``.optimizer`` / ``.optim`` attribute (DeepSpeed's ZeRO,
    BF16 and FP16 optimizers, ColossalAI's OptimizerWrapper, Accelerate's AcceleratedOptimizer).

    Returns:
        ``(False, "SGD (momentum 0)")`` for SGD without momentum, ``(True, ...)`` for optimizers that
        keep moments (any with ``betas``: the Adam family, LAMB, Lion; SGD with momentum > 0), and
        ``(None, ...)`` when unknown (no optimizer, or one without either hint).
    """
    chain = [optimizer]
    while optimizer is not None and len(chain) < 8:
        nxt = next((getattr(chain[-1], a) for a in ("optimizer", "optim")
                    if getattr(chain[-1], a, None) is not None), None)
        if nxt is None or any(nxt is c for c in chain):
            break
        chain.append(nxt)
    # The innermost object with param groups is the real optimizer.
    inner = next((c for c in reversed(chain) if getattr(c, "param_groups", None)), optimizer)
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


def resolve_dgc_defaults(cfg: "ZenConfig", optimizer) -> "tuple[ZenConfig, str]":
    """Decide ``zen.dgc.momentum_correction`` when it is null, from the optimizer the engine has.

    DGC's momentum correction (``u ← m·u + g; v ← v + u``) moves the momentum into the sparsifier,
    which is right only when the optimizer applies none (DGC's DGCSGD: SGD with momentum 0). With
    Adam-family optimizers or momentum-SGD it would apply momentum twice, so null becomes false
    there and whenever the optimizer is unknown (plain error feedback, right for every optimizer).
    An explicit true with an optimizer that keeps moments is kept, with a warning.

    Args:
        cfg: the validated ``"zen"`` section.
        optimizer: the engine's optimizer (wrapped or not), or None when the caller has none.

    Returns:
        The config with the field decided (a copy when it changed) and a short reason for logs
        (empty when DGC is off).
    """
    d = cfg.dgc
    if not d.enabled:
        return cfg, ""
    has_momentum, what = optimizer_momentum(optimizer)
    if d.momentum_correction is None:
        value = has_momentum is False and d.feedback != "ef21"  # EF21 estimates the gradient itself
        cfg = dataclasses.replace(cfg, dgc=dataclasses.replace(d, momentum_correction=value))
        why = ("DGC supplies the momentum (dgc.momentum %g), as DGC's DGCSGD" % d.momentum if value else
               "momentum correction would apply momentum twice" if has_momentum else
               "plain error feedback is right for any optimizer")
        return cfg, f"momentum_correction={str(value).lower()} (chosen: {what}; {why})"
    if d.momentum_correction and has_momentum:
        log.warning("zen: zen.dgc.momentum_correction is true but the optimizer (%s) applies momentum too, so "
                    "momentum is applied twice; set it false (or null to choose from the optimizer), or use SGD "
                    "with momentum 0 as DGC's DGCSGD does", what)
    return cfg, f"momentum_correction={str(d.momentum_correction).lower()} (set in the config; optimizer: {what})"
