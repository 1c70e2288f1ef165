"""TorchCommunicator: the Communicator protocol over a torch.distributed process group (gloo, NCCL).

NCCL-safe by construction (checked in CI by ``zen_ext.comm.nccl_guard`` on gloo):

* **No lone point-to-point op.** NCCL runs the ops to one peer on one stream, so a lone ``irecv``
  waits for the peer's ``isend``, which is queued behind the peer's own ``irecv``: a deadlock. Every
  point-to-point op here is part of one ``batch_isend_irecv`` (one NCCL group on the group's own
  communicator, not one lazily created communicator per peer pair), or the exchange is one
  ``all_to_all_single`` with split sizes.
* **Every tensor on ``self.device``.** NCCL: the current CUDA device, resolved at each use (a
  communicator built before ``torch.cuda.set_device`` still follows it); gloo: the CPU. Headers are
  built there, and a payload on another device (a CUDA gradient over gloo, a CPU tensor over NCCL) is
  staged there and its result moved back.

Variable-size exchanges (``exchange_v``) send a header first (``all_to_all_single`` of an int64
count and the call signature per peer, see ``comm/base.py``), then the payloads with one of two
transports, ``zen.exchange_impl``:

* ``"p2p"`` (default): the payloads as one ``batch_isend_irecv`` (receives listed first; gloo runs them
  one by one in that order). ``benchmarks/results/exchange_netlab.md`` measures both forms on the
  emulated cluster.
* ``"a2a"``: one ``all_to_all_single`` with split sizes. gloo is never handed an empty tensor: the
  buffers carry one extra element addressed to oneself.

``all_gather_v`` (agreement checks, planner profiles, DGC's TP samples, ZEN's pulls) uses the batched
point-to-point form whatever ``exchange_impl`` says, so ranks that disagree on ``exchange_impl`` still
meet in the agreement check that reports it (``options()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import GatherHandle, Communicator, backend_device

__all__ = ["EXCHANGE_IMPLS", "TorchCommunicator", "backend_device"]

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
        self.backend = str(dist.get_backend(self.group))

    @property
    def device(self) -> torch.device:
        # Resolved at each use: engines call torch.cuda.set_device after building communicators.
        return backend_device(self.backend)

    def options(self) -> dict:
        return {"transport": self.exchange_impl, "backend": self.backend, "device_type": self.device.type}

    # --- helpers ----------------------------------------------------------------------------------
    def _header(self, words: list[int]) -> torch.Tensor:
        return torch.tensor(words, dtype=torch.int64, device=self.device)

    def _batch_p2p(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """Post every send and receive as one batch (one NCCL group), then wait for all of them.

        Empty buffers are left out on both sides (each side knows the sizes from the header).
        """
        ops = [dist.P2POp(dist.irecv, buf, group=self.group, group_peer=j) for j, buf in recvs.items() if buf.numel()]
        ops += [dist.P2POp(dist.isend, buf, group=self.group, group_peer=j) for j, buf in sends.items() if buf.numel()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    # --- transport ----------------------------------------------------------------------------------
    def _exchange_v(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        """Header (count + signature per peer, one all_to_all_single), check, then the payloads."""
        if self.size == 1:
            self._verify_signatures([self._sig_word])
            return [send[0]]
        dev = self.device
        home = send[0].device
        # Step 1: header. Row j goes to rank j: [count of send[j], this rank's call signature].
        head_in = self._header([w for t in send for w in (t.numel(), self._sig_word)])
        head_out = torch.empty_like(head_in)
        dist.all_to_all_single(head_out, head_in, group=self.group)
        head = head_out.view(self.size, 2).tolist()  # the exchange's one host synchronization
        self._verify_signatures([h[1] for h in head])
        recv_counts = [h[0] for h in head]
        # Step 2: payloads, on the communicator's device.
        staged = [t.to(dev) for t in send] if home != dev else send
        dtype = send[0].dtype
        if self.exchange_impl == "p2p":
            recv = [torch.empty(c, dtype=dtype, device=dev) for c in recv_counts]
            others = [j for j in range(self.size) if j != self.rank]
            self._batch_p2p({j: staged[j] for j in others}, {j: recv[j] for j in others})
        else:
            in_splits = [t.numel() for t in staged]
            out_splits = list(recv_counts)
            in_splits[self.rank] += 1
            out_splits[self.rank] += 1
            parts = list(staged)
            parts[self.rank] = torch.cat([staged[self.rank], torch.zeros(1, dtype=dtype, device=dev)])
            buf_in = torch.cat(parts)
            buf_out = torch.empty(sum(out_splits), dtype=dtype, device=dev)
            dist.all_to_all_single(buf_out, buf_in, out_splits, in_splits, group=self.group)
            recv = list(buf_out.split(out_splits))
        # Step 3: back to the payload's device; one's own part never travelled.
        if home != dev:
            recv = [r.to(home) for r in recv]
        recv[self.rank] = send[self.rank]
        return recv

    def _all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The started gather (header, check, one batch of point-to-point ops), drained."""
        handle = self._all_gather_v_start(t)
        for _ in handle.as_completed():
            pass
        return handle.parts

    def _all_gather_v_start(self, t: torch.Tensor) -> GatherHandle:
        """``_all_gather_v`` whose payload requests are waited per peer, as the consumer reads them.

        1. Header (size + signature, one all-gather, the one host synchronization), check.
        2. Post every receive and send as one ``batch_isend_irecv`` (one NCCL group).
        3. The handle waits for peer ``j``'s receive only when ``j``'s message is read; the sends are
           waited last. Where the backend returns one request for the whole batch (NCCL coalesces
           the group), the first wait completes every message.
        """
        if self.size == 1:
            self._verify_signatures([self._sig_word])
            return GatherHandle(self.rank, [t])
        # Step 1: header.
        dev = self.device
        mine = self._header([t.numel(), self._sig_word])
        heads = torch.empty(2 * self.size, dtype=torch.int64, device=dev)
        _all_gather_single(heads, mine, group=self.group)
        head = heads.view(self.size, 2).tolist()
        self._verify_signatures([h[1] for h in head])
        # Step 2: post the batch.
        staged = t.to(dev) if t.device != dev else t
        parts = [torch.empty(h[0], dtype=t.dtype, device=dev) for h in head]
        parts[self.rank] = t
        peers = [j for j in range(self.size) if j != self.rank]
        recv_peers = [j for j in peers if parts[j].numel()]
        for j in peers:
            if not parts[j].numel():  # nothing travels: the consumer gets it on the payload's device
                parts[j] = t.new_empty(0)
        ops = [dist.P2POp(dist.irecv, parts[j], group=self.group, group_peer=j) for j in recv_peers]
        ops += [dist.P2POp(dist.isend, staged, group=self.group, group_peer=j) for j in peers if staged.numel()]
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        # Step 3: per-peer waits. Each request is waited exactly once: a second wait on a gloo
        # receive blocks for another message that never comes.
        per_op = len(works) == len(ops)
        pending = dict(enumerate(works))

        def wait_for(j: int):
            if per_op:
                pending.pop(recv_peers.index(j)).wait()
            else:
                while pending:
                    pending.popitem()[1].wait()
            return parts[j] if t.device == dev else parts[j].to(t.device)

        def finish() -> None:
            while pending:
                pending.popitem()[1].wait()

        return GatherHandle(self.rank, parts, {j: (lambda j=j: wait_for(j)) for j in recv_peers}, finish)

    def _gather_words(self, word: int) -> list[int]:
        got = torch.empty(self.size, dtype=torch.int64, device=self.device)
        _all_gather_single(got, self._header([word]), group=self.group)
        return got.tolist()

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        if self.size > 1 and t.numel():
            dev = self.device
            buf = t if t.device == dev else t.to(dev)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
            if buf is not t:
                t.copy_(buf)

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        n = self.size
        if n == 1 or not t.numel():
            return t.clone() if n == 1 else t.new_empty(0)
        dev = self.device
        buf = t if t.device == dev else t.to(dev)
        out = torch.empty(t.numel() // n, dtype=t.dtype, device=dev)
        # torch 2.13 renamed the *_tensor collectives to *_single (the old names warn).
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, buf, group=self.group)
        return out if out.device == t.device else out.to(t.device)

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        n = self.size
        if n == 1:
            return t.clone()
        dev = self.device
        buf = t if t.device == dev else t.to(dev)
        out = torch.empty(n * t.numel(), dtype=t.dtype, device=dev)
        if t.numel():
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, buf, group=self.group)
        return out if out.device == t.device else out.to(t.device)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if self.size > 1 and t.numel():
            dev = self.device
            buf = t if t.device == dev else t.to(dev)
            dist.broadcast(buf, group=self.group, group_src=src)
            if buf is not t:
                t.copy_(buf)


# Under ZEN_NCCL_GUARD=1 (the test suite), every process that talks through a TorchCommunicator runs
# under the NCCL rules (comm/nccl_guard.py), spawned engine workers included.
from . import nccl_guard as _nccl_guard  # noqa: E402

_nccl_guard.maybe_install()
