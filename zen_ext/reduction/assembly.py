"""What every engine adapter builds and keeps alike: the routing and the Synchronizer, the end-of-run
summary, and restoring zen_ext's own state (one place, so the adapters cannot drift apart)."""

from __future__ import annotations

import logging

from ..compress.routing import classify_parameters
from ..config import ZenConfig
from .synchronizer import Synchronizer
from .stats import StepStats, append_planner_reasons, report_summary

log = logging.getLogger(__name__)

__all__ = ["build_synchronizer", "resize_warning", "restore_sync_state", "summary_text"]


def build_synchronizer(module, cfg: ZenConfig, *, sync_comm, tp_comm, rank: int) -> tuple[dict[str, str], Synchronizer]:
    """Route each parameter of ``module`` (a registered kind or dense) and build the Synchronizer over
    ``sync_comm`` (a sparsifier that ``uses_tp_group``, DGC, agrees its thresholds over ``tp_comm``).

    Routing uses facts the TP ranks share (the largest shard size), so uneven AutoTP shards never send
    a parameter to DGC on one TP rank and dense on another; rank 0 logs it.

    Returns:
        ``(kinds, sync)``: parameter name → kind, and the Synchronizer.
    """
    kinds = classify_parameters(module, sections=cfg.sections(), log=rank == 0, tp_comm=tp_comm)
    sync = Synchronizer(dp_comm=sync_comm, scheme=cfg.build_scheme(), param_kinds=kinds, sections=cfg.sections(),
                        tp_comm=tp_comm)
    return kinds, sync


def summary_text(stats: StepStats, cfg: ZenConfig, sync: Synchronizer, rank: int, totals: list, label: str,
                 print_it: bool | None) -> str:
    """The end-of-run summary from every rank's gathered ``totals`` (the adapter gathers them over its
    engine's group), with ``auto``'s reasons for what it chose; rank 0 prints it when asked."""
    text = report_summary(stats, cfg, totals, rank, label, print_it)
    return append_planner_reasons(text, sync.scheme, cfg, rank, print_it)


def restore_sync_state(sync: Synchronizer, sd: dict, dp_size: int, why: str = "", logger=None) -> bool:
    """Restore a saved ``{"sync": ..., "dp_size": ...}``: all of it at the same data-parallel size; on a
    resize (or from another rank's file, ``why``) only what the ranks share (step counters, so DGC's
    warm-up continues; the planner's state), while DGC residuals, momenta and thresholds restart, with
    one warning saying so, on ``logger`` (the adapter's). Returns True when only the shared part was
    restored."""
    partial = bool(why) or sd.get("dp_size") != dp_size
    if partial:
        (logger or log).warning(resize_warning(sd.get("dp_size"), dp_size, sd["sync"], why))
    sync.load_state_dict(sd["sync"], per_rank=not partial)
    return partial


def resize_warning(saved_dp_size, dp_size: int, sd: dict, why: str = "") -> str:
    """The one warning a resumed run logs when it restores only the shared part of a Synchronizer state.

    Args:
        saved_dp_size: the data-parallel size the state was saved with (None if unknown).
        dp_size: the data-parallel size now.
        sd: the Synchronizer ``state_dict()`` being restored.
        why: what made it a partial restore, when not the size (e.g. a missing per-rank file).
    """
    kept = [f"the step counter ({sd['sparsifiers']['step']}; DGC warm-up and sampling continue from it)"]
    if "scheme" in sd:
        kept.append("the scheme's state (the auto planner's choices)")
    cause = why or f"the checkpoint was saved with dp_size {saved_dp_size}, now {dp_size}"
    return (f"zen: {cause}: restored {' and '.join(kept)}; DGC residuals, momenta and thresholds are per rank "
            f"and restart from zero")
