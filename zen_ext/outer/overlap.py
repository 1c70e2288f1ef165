"""What ``zen.outer.delay: 1`` runs its sums over: a communicator of its own and a communication thread.

The outer sum of round t runs on a ``CommWorker`` thread (``reduction/worker.py``, the thread of
``zen.async_sync``) while the training thread takes the inner steps of round t + 1. The thread never
shares a process group with the training thread: two threads issuing collectives on one gloo group at
once would interleave their messages, and whatever the training loop runs on the engine's group meanwhile
(a loss all-reduce for logging, a barrier, a checkpoint's gathers) would. ``private_communicator`` builds a
group with the same members for the thread alone.
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm.base import Communicator

__all__ = ["InFlight", "private_communicator"]


def private_communicator(comm: Communicator) -> Communicator:
    """A communicator over the same ranks as ``comm`` on a process group of its own (same backend,
    ``exchange_impl`` and gather options), for the communication thread of ``delay: 1``.

    ``torch.distributed.new_group`` with ``use_local_synchronization``: only the group's members call it
    (every member at the same point: OuterSync's constructor, which already runs collectives on ``comm``).

    Raises:
        ValueError: ``comm`` is not a ``TorchCommunicator`` (a SimWorld rank, say): pass ``overlap_comm``
            to OuterSync yourself (a second ``SimWorld(n).communicators()``, driven by the thread).
    """
    import torch.distributed as dist

    from ..comm.torch_dist import TorchCommunicator

    if not isinstance(comm, TorchCommunicator):
        raise ValueError(f"zen.outer.delay (1) needs a communicator of its own for the communication thread: "
                         f"OuterSync builds one from a TorchCommunicator, not from {type(comm).__name__}; pass "
                         f"overlap_comm= (the same ranks, a group nothing else uses)")
    ranks = dist.get_process_group_ranks(comm.group)
    group = dist.new_group(ranks, backend=dist.get_backend(comm.group), use_local_synchronization=True,
                           group_desc="zen_outer_overlap")
    return TorchCommunicator(group, exchange_impl=comm.exchange_impl, gather_impl=comm.gather_impl,
                             gather_costs=comm.gather_costs)


@dataclasses.dataclass
class InFlight:
    """One bucket's round whose sum was started (``delay: 1``) and is not merged into the parameters yet.

    ``future``: the CommWorker's future of steps 4–6 (None once waited for, or restored from a checkpoint:
    θ_global already holds the round). ``rec``: what the thread measured (``union``, ``bytes_sent``,
    ``bytes_recv``, ``sum_s``), filled by the thread, read after the future completes (None once counted).
    """

    future: "torch.futures.Future | None"
    rec: "dict | None"
