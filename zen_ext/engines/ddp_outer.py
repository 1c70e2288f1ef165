"""zen.outer on torch DDP: inner steps reduce nothing, every H-th optimizer step runs the outer sync.

The inner steps must not synchronize. DDP offers two ways: ``no_sync()`` (a context manager the training
loop must wrap around every forward and backward) and a communication hook. This module registers a
hook that returns each bucket unchanged (``local_grads_hook``): the user's loop stays as it is, each
replica's gradients are bitwise those of the replica alone, and DDP keeps its reducer's bookkeeping. The
outer step runs from a post-step hook on the inner optimizer (``optimizer.register_step_post_hook``),
so the loop needs no call of its own either.

With ``zen.outer.delay: 1`` the outer sum runs on a communication thread over a process group of its own
(built from DDP's group's members when the OuterSync is made): call ``outer.finish()`` at the end of
training to apply the round still in flight.

Per-step collectives DDP would still run are refused before training: ``broadcast_buffers`` with
buffers (rank 0's buffers broadcast at every forward) and ``find_unused_parameters`` (the used-parameter
map all-reduced at every backward).
"""

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig
from ..outer.sync import OuterSync

__all__ = ["local_grads_hook", "register_outer"]


# NOTE: no ``from __future__ import annotations``: DDP's register_comm_hook checks the annotations' objects.
def local_grads_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's local gradients, unreduced (inner steps of zen.outer)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register_outer(ddp_model, cfg: "ZenConfig | dict", optimizer=None) -> OuterSync:
    """Turn ``ddp_model``'s per-step all-reduce off and attach the outer synchronization of ``zen.outer``.

    Call after wrapping and before the first backward. The replicas are DDP's process group; rank 0's
    parameters are broadcast as the common start.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` (``broadcast_buffers=False`` when the
            module has buffers; ``find_unused_parameters=False``).
        cfg: the ``"zen"`` section (ZenConfig or dict) with ``outer.enabled`` true; ``scheme``,
            ``bucket_cap_mb`` and ``exchange_impl`` apply to the outer sum.
        optimizer: the inner optimizer; when given, the outer step runs after every ``every``-th
            ``optimizer.step()`` (a post-step hook). Without it, call ``outer.maybe_step(step)`` yourself.

    Returns:
        The ``OuterSync`` (``state_dict`` for checkpoints, ``pop_stats``, ``finish`` at the end of training).

    Raises:
        TypeError: not a DistributedDataParallel.
        ValueError: ``zen.outer.enabled`` is false, or DDP would still synchronize every step.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_outer needs a torch.nn.parallel.DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}")
    cfg = cfg if isinstance(cfg, ZenConfig) else ZenConfig.from_dict(cfg)
    if not (cfg.enabled and cfg.outer.enabled):
        raise ValueError("zen.outer.enabled (False) must be true to register the outer synchronization")
    if getattr(ddp_model, "broadcast_buffers", False) and any(True for _ in ddp_model.module.buffers()):
        raise ValueError("DistributedDataParallel broadcast_buffers (True) must be False with zen.outer: DDP "
                         "would broadcast rank 0's buffers at every forward (a per-step sync)")
    if getattr(ddp_model, "find_unused_parameters", False):
        raise ValueError("DistributedDataParallel find_unused_parameters (True) must be False with zen.outer: "
                         "DDP would all-reduce its used-parameter map at every backward (a per-step sync)")
    comm = TorchCommunicator(ddp_model.process_group, exchange_impl=cfg.exchange_impl)
    outer = OuterSync(ddp_model.module.named_parameters(), comm, cfg.outer, scheme=cfg.build_scheme(),
                      bucket_cap_mb=cfg.bucket_cap_mb)
    ddp_model.register_comm_hook(None, local_grads_hook)
    if optimizer is not None:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: outer.step_done())
    return outer
