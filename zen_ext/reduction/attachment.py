"""What every engine adapter's attachment builds and does alike, so an adapter only hooks its engine.

``assemble`` builds the reduction machinery an attachment keeps (routing and the Synchronizer, the
communication worker, the BucketReducer, statistics); ``ZenAttachment`` is the base of the adapters'
attachments (``ZenDeepSpeed``, the DDP hook's ``ZenHookState``): per-step statistics, the end-of-run
summary, zen_ext's own state in the engine's checkpoints (one file per rank, DGC residuals differing
per rank) and releasing the worker and the statistics file at the end.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..config import ZenConfig
from .assembly import build_synchronizer, restore_sync_state, summary_text
from .reducer import BucketReducer
from .stats import StepStats
from .synchronizer import Synchronizer
from .worker import CommWorker

log = logging.getLogger(__name__)

__all__ = ["Assembled", "ZenAttachment", "assemble", "STATE_DIRNAME"]

STATE_DIRNAME = "zen_ext"
"""The folder of zen_ext's per-rank files inside an engine checkpoint's tag folder."""


@dataclass
class Assembled:
    """The reduction machinery of one attachment (``assemble``)."""

    kinds: dict[str, str]
    sync: Synchronizer
    reducer: BucketReducer
    worker: CommWorker | None
    stats: StepStats


OUTER_REFUSAL = (
    "zen.outer (enabled) is served by torch DDP (zen_ext.engines.ddp_outer.register_outer) and DeepSpeed ZeRO-0 "
    "with fp32 weights (zen_ext.deepspeed.initialize; ZeRO-1/2 inside replica groups given by an mpu), and on "
    "FSDP2 HSDP by zen_ext.engines.fsdp_outer.register_outer; not by the per-step attachments (zen_ext.fsdp.attach, ColossalAI, the DDP hook register_zen_hook): set "
    "zen.outer.enabled false there")


def assemble(module, cfg: ZenConfig, *, sync_comm, tp_comm, rank: int, dp_size: int, device, node=None,
             tp_replicated: frozenset = frozenset(), guard_comm=None, worker_off: str | None = None,
             worker_in_reducer: bool = True, monitor=None) -> Assembled:
    """Build what an attachment reduces with.

    1. Route each parameter of ``module`` and build the Synchronizer over ``sync_comm``.
    2. With ``zen.async_sync``, the communication worker of ``sync_comm``'s group on ``device``, unless
       ``worker_off`` says why the adapter cannot use one (rank 0 logs it). The reducer pipelines an
       engine bucket's ZEN buckets over it when ``worker_in_reducer``; an adapter that hands whole
       engine buckets to the worker itself (the DDP hook) passes False.
    3. The BucketReducer around the Synchronizer (re-bucketing, node sharding, the non-finite guard
       over ``guard_comm``); the parameters of a ``row_sparse`` kind (natural sparsity's embeddings) among
       ``tp_replicated`` (replicated across the TP group, identical gradients) are its TP-shared rows.
    4. Per-step statistics (JSONL on rank 0, the engine's ``monitor`` when given).

    Raises:
        NotImplementedError: ``zen.outer`` is enabled: these per-step attachments would synchronize every
            step; the outer synchronization has adapters of its own (named in the message).
    """
    if cfg.outer.enabled:
        raise NotImplementedError(OUTER_REFUSAL)
    # Step 1: routing and the Synchronizer.
    kinds, sync = build_synchronizer(module, cfg, sync_comm=sync_comm, tp_comm=tp_comm, rank=rank)
    # Step 2: the worker.
    worker = None
    if cfg.async_sync and worker_off is None:
        worker = CommWorker.acquire(sync_comm.group, device)
    elif cfg.async_sync and rank == 0:
        log.info("zen: zen.async_sync is off with %s; buckets synchronize on the training thread", worker_off)
    # Step 3: the reducer.
    tp_shared = frozenset(n for n in tp_replicated if kinds.get(n) in sync.row_kinds)
    reducer = BucketReducer(sync, cap_bytes=cfg.bucket_cap_bytes, dp_size=dp_size, node=node, tp_comm=tp_comm,
                            tp_shared=tp_shared, guard_comm=guard_comm, worker=worker if worker_in_reducer else None)
    # Step 4: statistics.
    return Assembled(kinds, sync, reducer, worker, StepStats(rank, cfg.stats.jsonl_path, monitor))


class ZenAttachment:
    """The part of an adapter's attachment that does not depend on the engine.

    A subclass sets ``cfg``, ``rank``, ``dp_size``, ``sync``, ``reducer``, ``stats`` and ``worker``
    (``assemble`` builds the last four), names itself in ``summary_label`` and its adapter's logger in
    ``log_name`` (users filter warnings by the adapter they use).
    """

    __slots__ = ()
    summary_label = "engine"
    log_name = __name__

    # --- statistics -----------------------------------------------------------------------------------
    def annotate(self, **values) -> None:
        """Add fields (e.g. ``loss``) to the current step's statistics record."""
        self.stats.annotate(**values)

    @property
    def totals(self) -> dict:
        """This rank's totals so far (bytes_sent, dense_bytes, ...)."""
        return dict(self.stats.totals)

    def summary(self, print_it: bool | None = None) -> str:
        """Gather every rank's totals (a collective over the default group: call it on all ranks) and
        return the summary text; rank 0 prints it when ``zen.stats.summary`` is on."""
        import torch.distributed as dist

        totals = [None] * dist.get_world_size()
        dist.all_gather_object(totals, {**self.stats.totals, "losses": self.stats.losses})
        return summary_text(self.stats, self.cfg, self.sync, self.rank, totals, self.summary_label, print_it)

    def _release(self) -> None:
        """Drain and release the communication worker (buckets already handed over finish; a released
        worker refuses new jobs), then close the statistics file, so rank 0's JSONL is complete on disk.
        Call it once (the subclass's ``close`` guards)."""
        if self.worker is not None:
            self.worker.drain()
            self.worker.release()
        self.stats.close()

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's ZEN state (DGC residuals and momenta differ per rank: one file per rank)."""
        return {"sync": self.sync.state_dict(), "dp_size": self.dp_size, "rank": self.rank,
                "config": self.cfg.to_dict(), **self._extra_state()}

    def load_state_dict(self, sd: dict, why: str = "") -> None:
        """Restore ``state_dict()``: all of it at the same data-parallel size; on a resize (or from
        another rank's file, ``why``) only what the ranks share (step counters, so DGC's warm-up
        continues; the planner's state), while DGC residuals, momenta and thresholds restart, with one
        warning saying so."""
        restore_sync_state(self.sync, sd, self.dp_size, why, logger=logging.getLogger(self.log_name))
        self._load_extra_state(sd)

    def _extra_state(self) -> dict:
        """The subclass's own entries of ``state_dict`` (e.g. its step counter)."""
        return {}

    def _load_extra_state(self, sd: dict) -> None:
        """Restore ``_extra_state``'s entries."""

    def rank_state_path(self, root: str, tag, rank: int | None = None) -> str:
        """``<root>/<tag>/zen_ext/rank<NNNNN>.pt``: where a rank's state goes in an engine checkpoint."""
        return os.path.join(root, str(tag), STATE_DIRNAME, f"rank{self.rank if rank is None else rank:05d}.pt")

    def save_rank_state(self, root: str, tag) -> str:
        """Write this rank's ``state_dict()`` into the checkpoint ``<root>/<tag>``; returns the path."""
        path = self.rank_state_path(root, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.state_dict(), path)
        return path

    def load_rank_state(self, root: str, tag) -> bool:
        """Restore this rank's state from the checkpoint ``<root>/<tag>``; returns False (with a
        warning) when it holds none.

        1. This rank's own file, saved at the same data-parallel size: all of it.
        2. Otherwise (a resize, or no file of this rank's) rank 0's file, whose shared part every rank
           takes, so all ranks resume alike (a rank without a file of its own would restart at step 0).
        Files hold only tensors, numbers and strings: read with ``weights_only=True`` (no code from a
        tampered file runs). ``load_own_or_shared`` does the choosing.
        """
        path, first = self.rank_state_path(root, tag), self.rank_state_path(root, tag, 0)
        mine = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
        shared = (lambda: torch.load(first, map_location="cpu", weights_only=True)) if os.path.isfile(first) else None
        return self.load_own_or_shared(mine, shared, where=path)

    def load_own_or_shared(self, mine: dict | None, shared, where: str) -> bool:
        """Restore this rank's state from a checkpoint that holds one ``state_dict()`` per rank (the
        engines' files, a distributed checkpoint's per-rank entries); returns False (with a warning) when
        it holds none.

        1. ``mine`` (this rank's own state), saved at the same data-parallel size: all of it.
        2. Otherwise (a resize, or no state of this rank's) ``shared()`` (rank 0's state, loaded only
           when needed), whose shared part every rank takes, so all ranks resume alike (a rank without a
           state of its own would restart at step 0).

        Args:
            mine: this rank's saved ``state_dict()``, or None.
            shared: a callable returning rank 0's saved ``state_dict()``, or None when there is none.
            where: where this rank's state was looked for (for the warning).
        """
        # Step 1: this rank's state.
        if mine is not None and mine.get("dp_size") == self.dp_size:
            self.load_state_dict(mine)
            return True
        # Step 2: rank 0's shared part.
        if shared is not None:
            sd = shared()
            why = (("" if mine is not None else f"no ZEN state was saved for rank {self.rank}, and ")
                   + f"the checkpoint was saved with dp_size {sd.get('dp_size')}, now {self.dp_size}")
            self.load_state_dict(sd, why=why)
            return True
        logging.getLogger(self.log_name).warning(
            "zen: no ZEN state at %s (a checkpoint without ZEN?): DGC residuals start fresh", where)
        return False
