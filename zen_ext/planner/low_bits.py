"""``auto`` under ``zen.dgc.value_bits`` (``core/lowbit.py``): it chooses only among the candidates that carry
low-bit values, and its cost model predicts their bytes with the values' bits for the gradients that carry
them (``ZenScheme.predict_traffic`` with ``value_bits``); every other gradient is predicted as always.

A checkpoint resumed with ``value_bits`` turned on, off or changed (``replan_for_value_bits``) keeps the
calibration and re-plans every slice: the saved choices were made among other candidates and for other
bytes, so they say nothing about this run's; the link and the machine's rates are the same."""

from __future__ import annotations

import logging

from ..core.registry import scheme_class
from ..core.scheme import low_bits_error
from ..core.types import SparseGrad
from .calibration import Calibration

logger = logging.getLogger(__name__)


def narrow_to_low_bits(auto, bits: int, carriers: list[str] | None = None) -> None:
    """Keep ``auto``'s candidates that carry low-bit values; raise (naming ``carriers``) when none does."""
    keep = tuple(c for c in auto.candidates if scheme_class(c).carries_low_bits)
    if not keep:
        raise ValueError(low_bits_error(bits, f"zen.scheme 'auto' with zen.candidates {list(auto.candidates)}",
                                        carriers))
    auto.candidates = keep
    auto._schemes = {c: auto._schemes[c] for c in keep}
    auto._low_bits = {"value_bits": int(bits)}
    auto.carries_low_bits = True  # its sync_group's check passes the gradients on to the chosen carrier


def low_bit_options(auto, c: str, grad) -> dict:
    """Candidate ``c``'s cost-model options for ``grad``: its own, plus ``value_bits`` where ``grad`` carries it."""
    opts = auto._schemes[c].options()
    if auto._low_bits and isinstance(grad, SparseGrad) and grad.lowbit is not None:
        opts = {**opts, **auto._low_bits}
    return opts


def _carriers_only(options: dict) -> dict:
    """``options`` with its candidates narrowed as ``narrow_to_low_bits`` does."""
    cands = options.get("candidates") or []
    return {**options, "candidates": [c for c in cands if scheme_class(c).carries_low_bits]}


def replan_for_value_bits(auto, sd: dict) -> bool:
    """Whether ``sd`` is ``auto``'s state but for ``zen.dgc.value_bits`` (turned on, off or changed since it was
    saved); then restore only the calibration, with a log line, and leave every slice to be planned anew.

    1. Same bits (``sd["low_bits"]`` equal, or absent and the options equal): False, the caller restores all.
    2. Other bits: the options must be equal once both candidate sets are narrowed to the low-bit carriers
       (the narrowing is what value_bits changes); else False (the caller's error names the settings).
    3. Restore the calibration; the slices, the measured runs and the refinement restart (their
       predictions and measurements were of other bytes).
    """
    saved, now = sd.get("options"), auto.options()
    saved_bits = sd.get("low_bits")  # absent in states saved before it was recorded: inferred from the options
    # Step 1: same bits.
    if saved_bits == auto._low_bits or (saved_bits is None and saved == now):
        return False
    # Step 2: the rest of the settings.
    if not isinstance(saved, dict) or _carriers_only(saved) != _carriers_only(now):
        return False
    # Step 3: the calibration only.
    auto._states, auto._runs, auto._refine = {}, {}, {}
    auto._calib = {int(r): Calibration.from_state(c) for r, c in sd["calibration"].items()}
    was = "unrecorded" if saved_bits is None else saved_bits.get("value_bits", "unset")
    logger.info("zen: auto re-plans every slice: the checkpoint was saved with zen.dgc.value_bits %s (candidates "
                "%s), this run has %s (candidates %s); the calibration is kept", was, saved["candidates"],
                auto._low_bits.get("value_bits", "unset"), now["candidates"])
    return True
