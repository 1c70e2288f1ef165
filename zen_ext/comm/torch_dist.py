"""TorchCommunicator: the Communicator protocol over a torch.distributed process group (gloo, NCCL).

Variable-size exchanges send counts first, then payloads, with one of two transports:

* ``"p2p"`` (default): point-to-point with every receive posted before any send. On rate-limited
  links this reached 86–98 % of the link rate against 50–70 % for gloo's ``all_to_all_single``
  (shared/research/netlab.md), and ``benchmarks/bench_exchange.py`` re-measures it.
* ``"a2a"``: one ``all_to_all_single`` with split sizes.

gloo is never handed an empty tensor: empty payloads are skipped in p2p, and the a2a buffers carry one
extra element addressed to oneself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Communicator

EXCHANGE_IMPLS = ("p2p", "a2a")
# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchCommunicator(Communicator):
    """Communicator over ``process_group`` (``None``: the default group).

    Args:
        process_group: the group whose ranks synchronize (e.g. the data-parallel group).
        exchange_impl: ``"p2p"`` or ``"a2a"`` (see the module docstring).
    """

    def __init__(self, process_group=None, exchange_impl: str = "p2p") -> None:
        super().__init__()
        if exchange_impl not in EXCHANGE_IMPLS:
            raise ValueError(f"exchange_impl ({exchange_impl!r}) must be one of {list(EXCHANGE_IMPLS)}")
        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed to be initialized first")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.exchange_impl = exchange_impl
        self.backend = dist.get_backend(self.group)
        # NCCL needs counts on the device; gloo on the CPU.
        self._count_device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"

    def _exchange_counts(self, counts: list[int]) -> list[int]:
        send = torch.tensor(counts, dtype=torch.int64, device=self._count_device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    def _p2p(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        # Receives first: a send that finds its receive already posted streams without a stall.
        reqs = [dist.irecv(buf, group=self.group, group_src=j) for j, buf in recvs.items() if buf.numel()]
        reqs += [dist.isend(buf, group=self.group, group_dst=j) for j, buf in sends.items() if buf.numel()]
        for r in reqs:
            r.wait()

    def _exchange_v(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.size == 1:
            return [send[0]]
        recv_counts = self._exchange_counts([t.numel() for t in send])
        dtype, device = send[0].dtype, send[0].device
        if self.exchange_impl == "p2p":
            recv = [torch.empty(c, dtype=dtype, device=device) for c in recv_counts]
            recv[self.rank] = send[self.rank]
            others = [j for j in range(self.size) if j != self.rank]
            self._p2p({j: send[j] for j in others}, {j: recv[j] for j in others})
            return recv
        in_splits = [t.numel() for t in send]
        out_splits = list(recv_counts)
        in_splits[self.rank] += 1
        out_splits[self.rank] += 1
        pad = torch.zeros(1, dtype=dtype, device=device)
        parts = list(send)
        parts[self.rank] = torch.cat([send[self.rank], pad])
        buf_in = torch.cat(parts)
        buf_out = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(buf_out, buf_in, out_splits, in_splits, group=self.group)
        recv = list(buf_out.split(out_splits))
        recv[self.rank] = send[self.rank]
        return recv

    def _all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [t]
        size = torch.tensor([t.numel()], dtype=torch.int64, device=self._count_device)
        sizes = torch.empty(self.size, dtype=torch.int64, device=self._count_device)
        _all_gather_single(sizes, size, group=self.group)
        out = [torch.empty(int(c), dtype=t.dtype, device=t.device) for c in sizes.tolist()]
        out[self.rank] = t
        others = [j for j in range(self.size) if j != self.rank]
        self._p2p({j: t for j in others}, {j: out[j] for j in others})
        return out

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        if self.size > 1 and t.numel():
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if self.size > 1 and t.numel():
            dist.broadcast(t, group=self.group, group_src=src)
