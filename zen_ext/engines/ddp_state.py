"""``ZenHookState``: what the ZEN DDP hook (``engines/ddp.py``) keeps between buckets and steps: the
reduction machinery built for the DDP-wrapped module, the bucket layouts seen, the step counter, and,
from ``reduction.attachment.ZenAttachment``, statistics, the summary, checkpoint state and shutdown.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig, resolve_dgc_defaults
from ..reduction import BucketReducer, CommWorker, locate_slices
from ..reduction.attachment import ZenAttachment, assemble
from ..reduction.stats import StepStats, startup_line
from ..reduction.plan import GradSlice
from ..reduction.synchronizer import Synchronizer

log = logging.getLogger("zen_ext.engines.ddp")

__all__ = ["ZenHookState"]


class ZenHookState(ZenAttachment):
    """Everything the ZEN DDP hook keeps between buckets and steps (statistics, summary and
    ``state_dict`` from ``ZenAttachment``).

    Build it with ``ZenHookState.build`` (or ``register_zen_hook``, which also registers the hook).
    Tuning: start with the defaults (natural sparsity on, DGC off — lossless); turn on
    ``zen.dgc`` for dense models, where density 0.05 (the paper's top-5 %) is the usual start.

    Args:
        sync: the Synchronizer over the data-parallel group.
        reducer: the BucketReducer wrapping ``sync`` (non-finite guard, re-bucketing, statistics).
        names: ``id(parameter)`` → parameter name, from the DDP-wrapped module.
        cfg: the validated ``"zen"`` section.
        stats: per-step statistics (JSONL on rank 0).
        rank: this process's global rank.
        worker: the communication worker that synchronizes buckets while the backward pass goes on
            (``zen.async_sync``), or None to synchronize inside the hook.
    """

    __slots__ = (
        # Configuration, fixed after build.
        "cfg", "names", "rank", "dp_size", "op",
        # The reduction machinery.
        "sync", "reducer",
        # Internal state: bucket layouts seen (parameter ids → slices), steps, calls.
        "_layouts", "step", "hook_calls", "_t_step",
        # Statistics.
        "stats",
        # Asynchronous synchronization (None: blocking); shutdown: set by close() (the atexit handler
        # holds a weak reference).
        "worker", "closed", "__weakref__",
    )

    log_name = log.name

    def __init__(self, *, sync: Synchronizer, reducer: BucketReducer, names: dict[int, str], cfg: ZenConfig,
                 stats: StepStats, rank: int, worker: "CommWorker | None" = None) -> None:
        self.cfg = cfg
        self.names = names
        self.rank = rank
        self.dp_size = sync.dp_comm.size
        # DDP's own reduction is the mean over the data-parallel group; the hook keeps that contract.
        self.op = "mean"
        self.sync = sync
        self.reducer = reducer
        self._layouts: dict[tuple[int, ...], list[GradSlice]] = {}
        self.step = 0
        self.hook_calls = 0
        self._t_step = 0.0
        self.stats = stats
        self.worker = worker
        self.closed = False
        # Scripts that never call close() still get it, before the interpreter tears modules down.
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def build(cls, module: torch.nn.Module, cfg: "ZenConfig | dict | None" = None, *, dp_group=None,
              tp_group=None, guard_group=None, guard_nonfinite: bool = False, optimizer=None) -> "ZenHookState":
        """Build the state for the parameters of ``module`` (the module DDP wraps).

        1. Validate the ``"zen"`` section and refuse what the DDP path does not serve.
        2. Classify each parameter (natural / dgc / dense) and build the scheme and the Synchronizer
           over ``dp_group``, with DGC thresholds agreed over ``tp_group``.
        3. Wrap it in a BucketReducer (optional non-finite guard over ``guard_group``).
        4. With ``zen.async_sync``, attach the communication worker of ``dp_group``.

        Args:
            module: the model as DDP sees it (``ddp.module``); its parameter names key all state.
            cfg: the ``"zen"`` section (ZenConfig, dict, or None for the defaults).
            dp_group: the data-parallel group DDP reduces over (None: the default group).
            tp_group: the tensor-parallel group (DGC agrees one threshold per layer across it), or None.
            guard_group: the group spanning every rank that reduces (None: the default group); used
                when ``guard_nonfinite``.
            guard_nonfinite: make a NaN/Inf gradient on any rank NaN-fill every rank's bucket instead
                of synchronizing it, so a loss scaler (fp16, AMP ``GradScaler``) still sees the overflow
                that DGC could otherwise drop, and no residual memory is polluted.
            optimizer: the training optimizer, from which a null ``zen.dgc.momentum_correction`` is
                decided (``config.resolve_dgc_defaults``); None: false (plain error feedback, right for
                any optimizer), with a warning when DGC is on.

        Raises:
            ValueError, TypeError: an invalid ``"zen"`` section.
            NotImplementedError: ``zen.hierarchical`` true (node-sharded reduction is DeepSpeed-only).
        """
        # Step 1: configuration.
        cfg = cfg if isinstance(cfg, ZenConfig) else ZenConfig.from_dict(cfg)
        if cfg.hierarchical is True:
            raise NotImplementedError(
                "zen.hierarchical (True) must be false or \"auto\" with the DDP hook: node-sharded (hierarchical) "
                "reduction is implemented for zen_ext.deepspeed only; \"auto\" runs ZEN over the whole "
                "data-parallel group")
        rank = dist.get_rank()
        if optimizer is None and cfg.dgc.enabled and cfg.dgc.momentum_correction is None and rank == 0:
            log.warning("zen: zen.dgc.momentum_correction is null and no optimizer was given: using false (plain "
                        "error feedback, right for Adam and momentum-SGD); pass optimizer= to register_zen_hook, or "
                        "set it true for SGD with momentum 0 (DGC's DGCSGD)")
        cfg, dgc_note = resolve_dgc_defaults(cfg, optimizer)
        # Step 2: routing and the Synchronizer.
        names = {id(p): n for n, p in module.named_parameters()}
        dp_comm = TorchCommunicator(dp_group, cfg.exchange_impl)
        tp_comm = None
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            tp_comm = TorchCommunicator(tp_group, cfg.exchange_impl)
        # Steps 3 and 4: the reducer, and the worker on the device of the gradients (the module's
        # parameters). No worker with a TP group: the backward pass itself issues collectives on it
        # (row-parallel layers), and ZEN's DGC threshold agreement on the same group from another
        # thread could reach the ranks in different orders. The hook hands whole buckets to the worker.
        first = next(module.parameters(), None)
        built = assemble(module, cfg, sync_comm=dp_comm, tp_comm=tp_comm, rank=rank, dp_size=dp_comm.size,
                         device=first.device if first is not None else torch.device("cpu"),
                         guard_comm=TorchCommunicator(guard_group) if guard_nonfinite else None,
                         worker_off="a tensor-parallel group (the backward pass uses that group too)"
                         if tp_comm is not None else None, worker_in_reducer=False)
        if rank == 0:
            log.info("zen: DDP comm hook (dp=%d, tp=%d, guard_nonfinite=%s, async_sync=%s): %s", dp_comm.size,
                     tp_comm.size if tp_comm else 1, guard_nonfinite, built.worker is not None, cfg.to_dict())
            print(startup_line(f"a DDP comm hook (dp={dp_comm.size}, tp={tp_comm.size if tp_comm else 1})", cfg,
                               built.kinds, {n: p.numel() for n, p in module.named_parameters()}, dgc_note), flush=True)
        return cls(sync=built.sync, reducer=built.reducer, names=names, cfg=cfg, stats=built.stats, rank=rank,
                   worker=built.worker)

    # --- per bucket -----------------------------------------------------------------------------------
    def slices_for(self, bucket: "dist.GradBucket") -> list[GradSlice]:
        """The named slices of a DDP bucket, cached per layout (DDP rebuilds buckets once).

        Raises:
            RuntimeError: a bucket parameter that is not a parameter of the wrapped module, or a
                gradient that is not a view into the bucket buffer (a DDP change).
        """
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        slices = self._layouts.get(key)
        if slices is None:
            missing = [tuple(p.shape) for p in params if id(p) not in self.names]
            if missing:
                raise RuntimeError(f"zen: DDP bucket {bucket.index()} holds parameters of shapes {missing[:3]} that "
                                   f"are not parameters of the module the ZEN hook was built for; build the "
                                   f"state from ddp_model.module")
            # The gradients are views into the bucket buffer: their addresses give the offsets,
            # whatever padding or order DDP chose.
            named = [(self.names[id(p)], g) for p, g in zip(params, bucket.gradients())]
            slices = locate_slices([bucket.buffer()], named)
            if len(slices) != len(params):
                raise RuntimeError(f"zen: found {len(slices)} of the {len(params)} gradients of DDP bucket "
                                   f"{bucket.index()} inside its buffer (torch {torch.__version__}); the ZEN hook "
                                   f"needs DDP's gradients to be views into the bucket")
            self._layouts[key] = slices
        return slices

    def reduce_bucket(self, bucket: "dist.GradBucket") -> torch.Tensor:
        """Replace the bucket buffer by its data-parallel mean, in this thread; returns the buffer."""
        self._check_open()
        return self._reduce(bucket.buffer(), self.slices_for(bucket), bucket.is_last())

    def submit_bucket(self, bucket: "dist.GradBucket") -> torch.futures.Future:
        """Hand the bucket to the communication worker; the returned future completes with the mean.

        Everything read from the ``GradBucket`` is read here, in the hook's thread: the worker only
        sees the buffer and the (cached) slices.
        """
        self._check_open()
        buf = bucket.buffer()
        slices, last = self.slices_for(bucket), bucket.is_last()
        return self.worker.submit(lambda: self._reduce(buf, slices, last), [buf])

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("zen: the ZEN hook state was closed (close() ends training); DDP still calls the hook, "
                               "so build a new DDP model and register_zen_hook to train again")

    def _reduce(self, buf: torch.Tensor, slices: list[GradSlice], last: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        self.hook_calls += 1
        self.reducer.reduce_(buf, slices, self.op)
        self._t_step += time.perf_counter() - t0
        if last:
            # DDP reduces buckets in index order and the last one closes the iteration; with
            # no_sync() accumulation the hook only runs on the synchronizing micro-batch, so this
            # is once per optimizer step.
            self.end_step()
        return buf

    # --- per step -------------------------------------------------------------------------------------
    def end_step(self) -> dict:
        """Close a synchronized step: advance the Synchronizer (DGC warm-up), write the stats record."""
        self.step += 1
        self.sync.end_step()
        rec = self.reducer.pop_stats()
        rec["reduce_s"] = self._t_step
        self._t_step = 0.0
        return self.stats.end_step(self.step, rec)

    @property
    def summary_label(self) -> str:
        return f"DDP hook dp={self.dp_size}"

    def close(self) -> None:
        """End of training: release what the hook holds, in the order process shutdown needs.

        1. Drain the communication worker: buckets already handed over finish (DDP has waited for
           them anyway once ``backward`` returned), then drop this state's reference to the worker,
           which stops and joins its thread when no other state of the same process group uses it. A
           thread still inside a gloo/NCCL call when ``destroy_process_group()`` runs, or a joinable
           thread alive at interpreter exit, aborts the process ("terminate called without an active
           exception").
        2. Close the statistics file, so rank 0's JSONL is complete on disk.
        3. Drop the Synchronizer and the reducer, and with them this state's references to the
           process groups, so ``destroy_process_group()`` frees the groups while the interpreter is whole.

        Call it after the last step and ``summary()``, before ``destroy_process_group()``; the hook
        refuses to run afterwards. Idempotent; an ``atexit`` handler calls it for scripts that do not.
        """
        if self.closed:
            return
        self.closed = True
        # Steps 1 and 2: the worker, statistics.
        self._release()
        # Step 3: the machinery and its communicators.
        self.sync = self.reducer = None
        self._layouts.clear()

    # --- checkpoints: ZenAttachment.state_dict / load_state_dict, plus the step counter ----------------
    def _extra_state(self) -> dict:
        return {"step": self.step}

    def _load_extra_state(self, sd: dict) -> None:
        self.step = int(sd.get("step", 0))


def _close_at_exit(ref) -> None:
    state = ref()
    if state is not None:
        state.close()
