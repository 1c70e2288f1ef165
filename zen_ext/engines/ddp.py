"""ZEN as a torch DDP communication hook (ZEN paper §4: "We register a custom_comm_hook in PyTorch's DDP
to enable DGC and our synchronization scheme", with 128 MB buckets).

DDP fuses gradients into flat buckets (``bucket_cap_mb``) and hands each bucket to the hook as soon as
its gradients are ready. With ``zen.async_sync`` (off by default; see its config docstring) the hook only enqueues the bucket and
returns a pending future: a communication worker (one thread per process group, FIFO, so every rank
runs the buckets in the same order) synchronizes it while autograd computes the gradients of the
earlier layers, and completes the future; DDP waits for all futures at the end of the backward pass.
With ``zen.async_sync`` false the hook synchronizes inside the call and returns a completed future.
Both paths run the same operations in the same order, so their results are bitwise equal. The hook maps the
bucket's parameters to their names, lets the Synchronizer route each one (untied embedding rows →
natural sparsity, large matrices → DGC top-k, the rest dense) through the configured scheme, and
writes the data-parallel *mean* back (a custom hook replaces DDP's own averaging).

Bytes each rank sends per bucket are the Synchronizer's (reduction/synchronizer.py): the dense part's ring
all-reduce ``2·(n−1)/n·D·itemsize`` plus, per sparse part, the scheme's traffic (``zen``, paper Eq. 1:
``≈ 2·(n−1)/n·nnz`` COO entries for balanced partitions); ``pop_step_stats`` reports them next to what
DDP's all-reduce would have sent.

State is keyed by parameter name, never by bucket index: DDP builds a small first bucket and rebuilds
its buckets after the first iteration (in gradient-ready order), which would scramble per-bucket
memory (the warm-up that PowerSGD needs for the same reason is unnecessary here). A new bucket layout
is agreed across ranks once by the Synchronizer.

ColossalAI's ``TorchDDPPlugin`` and ``HybridParallelPlugin`` (zero_stage 0) wrap the model in torch
DDP, so ``zen_ext.engines.colossalai`` registers this hook after ``boost``; plain DDP users call
``register_zen_hook(ddp_model, {"dgc": {"enabled": True}})`` before the first backward.
"""

import atexit
import logging
import time
import weakref

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig, resolve_dgc_defaults
from ..reduction.synchronizer import GradSlice, Synchronizer
from ..reduction import BucketReducer, CommWorker, locate_slices
from ..reduction.assembly import build_synchronizer, restore_sync_state, summary_text
from ..reduction.stats import StepStats, startup_line

log = logging.getLogger(__name__)

__all__ = ["ZenHookState", "register_zen_hook", "zen_comm_hook"]


class ZenHookState:
    """Everything the ZEN DDP hook keeps between buckets and steps.

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
        kinds, sync = build_synchronizer(module, cfg, sync_comm=dp_comm, tp_comm=tp_comm, rank=rank)
        # Step 3: the reducer.
        guard = TorchCommunicator(guard_group) if guard_nonfinite else None
        reducer = BucketReducer(sync, cap_bytes=cfg.bucket_cap_bytes, dp_size=dp_comm.size, tp_comm=tp_comm,
                                guard_comm=guard)
        # Step 4: the worker (the device of the gradients: the module's parameters). Not with a TP
        # group: the backward pass itself issues collectives on it (row-parallel layers), and ZEN's
        # DGC threshold agreement on the same group from another thread could reach the ranks in
        # different orders.
        worker = None
        if cfg.async_sync and tp_comm is not None:
            if rank == 0:
                log.info("zen: zen.async_sync is off with a tensor-parallel group (the backward pass uses that "
                         "group too); buckets synchronize inside the hook")
        elif cfg.async_sync:
            first = next(module.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
            worker = CommWorker.acquire(dp_comm.group, device)
        if rank == 0:
            log.info("zen: DDP comm hook (dp=%d, tp=%d, guard_nonfinite=%s, async_sync=%s): %s", dp_comm.size,
                     tp_comm.size if tp_comm else 1, guard_nonfinite, worker is not None, cfg.to_dict())
            print(startup_line(f"a DDP comm hook (dp={dp_comm.size}, tp={tp_comm.size if tp_comm else 1})", cfg, kinds,
                               {n: p.numel() for n, p in module.named_parameters()}, dgc_note), flush=True)
        return cls(sync=sync, reducer=reducer, names=names, cfg=cfg,
                   stats=StepStats(rank, cfg.stats.jsonl_path), rank=rank, worker=worker)

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

    def annotate(self, **values) -> None:
        """Add fields (e.g. ``loss``) to the record of the step being synchronized."""
        self.stats.annotate(**values)

    def summary(self, print_it: bool | None = None) -> str:
        """Gather every rank's totals (a collective over the default group: call it on all ranks) and
        return the summary text; rank 0 prints it when ``zen.stats.summary`` is on."""
        totals = [None] * dist.get_world_size()
        dist.all_gather_object(totals, {**self.stats.totals, "losses": self.stats.losses})
        return summary_text(self.stats, self.cfg, self.sync, self.rank, totals, f"DDP hook dp={self.dp_size}", print_it)

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
        # Step 1: the worker.
        if self.worker is not None:
            self.worker.drain()
            self.worker.release()
        # Step 2: statistics.
        self.stats.close()
        # Step 3: the machinery and its communicators.
        self.sync = self.reducer = None
        self._layouts.clear()

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's ZEN state (DGC residuals and momenta differ per rank: save one file per rank)."""
        return {"sync": self.sync.state_dict(), "step": self.step, "dp_size": self.dp_size, "rank": self.rank,
                "config": self.cfg.to_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()``.

        A different data-parallel size (a resize) restores what the ranks share (step counters, so
        DGC's warm-up continues; the planner's state) and restarts only the per-rank DGC residuals,
        momenta and thresholds, with one warning saying so.
        """
        restore_sync_state(self.sync, sd, self.dp_size, logger=log)
        self.step = int(sd.get("step", 0))


def _close_at_exit(ref) -> None:
    state = ref()
    if state is not None:
        state.close()


# NOTE: no ``from __future__ import annotations`` in this module: DDP's register_comm_hook checks that
# the hook's annotations are the objects dist.GradBucket and Future[Tensor], not strings.
def zen_comm_hook(state: ZenHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: synchronize the bucket with ZEN and return its data-parallel mean.

    With ``zen.async_sync`` on the bucket goes to the process group's communication worker and
    the future completes when it is synchronized, while autograd goes on with the earlier layers
    (ZEN's exchanges are variable-size sequences, not one async collective, so a thread runs them).
    Otherwise the reduction runs inside the hook and the future is already complete, as in
    PyTorch's PowerSGD hook on gloo.

    Args:
        state: the ``ZenHookState`` built for the DDP-wrapped module.
        bucket: the flat gradient bucket DDP hands over.

    Returns:
        A future of the bucket buffer, which holds the mean over the data-parallel group once the
        future is complete.

    Example::

        >>> state = ZenHookState.build(ddp.module, {"dgc": {"enabled": True}})  # doctest: +SKIP
        >>> ddp.register_comm_hook(state, zen_comm_hook)  # doctest: +SKIP
    """
    if state.worker is not None:
        return state.submit_bucket(bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(state.reduce_bucket(bucket))
    return fut


def register_zen_hook(ddp_model, cfg: "ZenConfig | dict | None" = None, *, tp_group=None, guard_group=None,
                      guard_nonfinite: bool = False, optimizer=None) -> ZenHookState:
    """Build a ``ZenHookState`` for a DDP model and register ``zen_comm_hook`` on it.

    Call it after wrapping and before the first backward. The data-parallel group is the one DDP
    was built with.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel``.
        cfg: the ``"zen"`` section (ZenConfig, dict, or None for the defaults).
        tp_group, guard_group, guard_nonfinite, optimizer: see ``ZenHookState.build`` (pass the
            optimizer so that DGC's momentum correction is chosen from it).

    ``zen.async_sync`` (when on) synchronizes buckets on the communication worker while the backward
    pass goes on, except with ``find_unused_parameters=True`` or a tensor-parallel group, where other
    collectives share the groups during the backward pass (then the hook blocks, as before). Keep the
    main thread off the data-parallel group's collectives between ``forward`` and the end of
    ``backward`` (DDP itself does).

    Returns:
        The state (statistics, ``state_dict`` for checkpoints, ``summary``; ``close()`` at the end).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel.
        ValueError: ``zen.enabled`` is false (keep DDP's own all-reduce: do not register).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_zen_hook needs a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}")
    cfg = cfg if isinstance(cfg, ZenConfig) else ZenConfig.from_dict(cfg)
    if not cfg.enabled:
        raise ValueError("zen.enabled (False) must be true to register the ZEN hook; skip the call to keep "
                         "DDP's all-reduce")
    state = ZenHookState.build(ddp_model.module, cfg, dp_group=ddp_model.process_group, tp_group=tp_group,
                               guard_group=guard_group, guard_nonfinite=guard_nonfinite, optimizer=optimizer)
    why = _backward_collectives(ddp_model) if state.worker is not None else None
    if why is not None:
        # The backward pass itself runs a collective on the training thread, possibly while the worker
        # still synchronizes buckets: the two would reach the ranks in different orders (NCCL: a hang).
        if state.rank == 0:
            log.info("zen: zen.async_sync is off with %s; buckets synchronize inside the hook", why)
        state.worker.release()
        state.worker = None
    ddp_model.register_comm_hook(state, zen_comm_hook)
    return state


def _backward_collectives(ddp_model) -> str | None:
    """Why the backward pass of ``ddp_model`` issues collectives of its own on the training thread
    (then a communication worker would race them), or None. DDP with ``find_unused_parameters``
    all-reduces its used-parameter map once the last bucket is ready; ``SyncBatchNorm``'s backward
    all-reduces its statistics' gradients (on the data-parallel group by default)."""
    if getattr(ddp_model, "find_unused_parameters", False):
        return "find_unused_parameters=True (DDP's own all-reduce of the used-parameter map shares the group)"
    sync_bn = [n for n, m in ddp_model.module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if sync_bn:
        return (f"SyncBatchNorm layers ({sync_bn[0]}{' and %d more' % (len(sync_bn) - 1) if len(sync_bn) > 1 else ''}: "
                "their backward all-reduces statistics during the backward pass)")
    return None
