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

This module holds the hook and its registration; what the hook keeps is ``ddp_state.ZenHookState``.
"""

import logging

import torch
import torch.distributed as dist

from ..config import ZenConfig
from .ddp_state import ZenHookState

log = logging.getLogger(__name__)

__all__ = ["ZenHookState", "register_zen_hook", "zen_comm_hook"]


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
