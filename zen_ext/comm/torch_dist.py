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
  one by one in that order). ``benchmarks/comm/results/exchange_netlab.md`` measures both forms on the
  emulated cluster.
* ``"a2a"``: one ``all_to_all_single`` with split sizes. gloo is never handed an empty tensor: the
  buffers carry one extra element addressed to oneself.

``all_gather_v`` (agreement checks, planner profiles, DGC's TP samples, ZEN's pulls) runs the rounds of
``comm/gather.py`` (counts in a round of their own, then direct, ring or Bruck payload rounds; inside a
slot, from a call's second time on, counts in the blocks: ``_all_gather_v_start_inline``), each
round one ``batch_isend_irecv``, whatever ``exchange_impl`` says, so ranks that disagree on
``exchange_impl`` or ``gather_impl`` still meet in the agreement check that reports it (``options()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import gather
from .base import GatherHandle, Communicator, backend_device
from .inline import HEAD_BYTES, inline_segment_bytes

__all__ = ["EXCHANGE_IMPLS", "TorchCommunicator", "backend_device"]

EXCHANGE_IMPLS = ("p2p", "a2a")
# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchCommunicator(Communicator):
    """Communicator over ``process_group`` (``None``: the default group).

    Args:
        process_group: the group whose ranks synchronize (e.g. the data-parallel group).
        exchange_impl: ``"p2p"`` or ``"a2a"`` (see the module docstring).
        gather_impl: ``all_gather_v``'s payload rounds: ``"auto"`` (``comm/gather.py`` picks from the
            counts), ``"direct"``, ``"ring"``, ``"bruck"`` or ``"bruck4"``.
        gather_costs: what ``"auto"`` weighs (``gather.GatherCosts``; ranks must agree).
    """

    def __init__(self, process_group=None, exchange_impl: str = "p2p", gather_impl: str = "auto",
                 gather_costs: gather.GatherCosts | None = None) -> None:
        super().__init__()
        if exchange_impl not in EXCHANGE_IMPLS:
            raise ValueError(f"exchange_impl ({exchange_impl!r}) must be one of {list(EXCHANGE_IMPLS)}")
        if gather_impl not in gather.GATHER_IMPLS:
            raise ValueError(f"gather_impl ({gather_impl!r}) must be one of {list(gather.GATHER_IMPLS)}")
        self.gather_impl = gather_impl
        self.gather_costs = gather_costs or gather.GatherCosts()
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
        return {"transport": self.exchange_impl, "backend": self.backend, "device_type": self.device.type,
                "gather": self.gather_impl}

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

    def _exchange_v_inline(self, send: list[torch.Tensor], send_caps: list[int],
                           recv_caps: list[int]) -> list[torch.Tensor]:
        """Counts in the payload messages (``comm/base.py``, "Counts in the payload"): one round, and a
        second between the pairs whose payload outgrew its capacity.

        1. One uint8 send buffer (one concatenation): per peer ``[count, signature | first min(count,
           cap) elements | zeros]``, ``inline_segment_bytes(cap)`` long; a receive buffer of the peers'
           segments, sized from ``recv_caps`` (known without a message).
        2. The segments in one ``batch_isend_irecv`` (``p2p``) or one ``all_to_all_single`` (``a2a``; an
           8-byte segment to oneself, so gloo never sees an empty split).
        3. One host read of every peer's head; check the signatures.
        4. Overflow: the rest of each outgrown payload, pair by pair, in one ``batch_isend_irecv``
           (only the two ranks of a pair know it happened, so it cannot be a collective).
        5. Each received part a view of its segment (or, after an overflow, the two pieces joined).
        """
        n, rank = self.size, self.rank
        dev, home = self.device, send[0].device
        dtype, esz = send[0].dtype, send[0].element_size()
        staged = [t.to(dev) for t in send] if home != dev else send
        a2a = self.exchange_impl == "a2a"
        # Step 1: the send buffer and the receive segments.
        counts = [t.numel() for t in send]
        heads = self._header([w for c in counts for w in (c, self._sig_word)]).view(torch.uint8).view(n, 16)
        seg_out = [inline_segment_bytes(c, esz) if j != rank else 8 * a2a for j, c in enumerate(send_caps)]
        seg_in = [inline_segment_bytes(c, esz) if j != rank else 8 * a2a for j, c in enumerate(recv_caps)]
        pad = torch.zeros(max(seg_out), dtype=torch.uint8, device=dev)
        pieces = []
        for j in range(n):
            if j == rank:
                pieces.append(pad[:seg_out[j]])
                continue
            body = staged[j][:min(counts[j], send_caps[j])].view(torch.uint8)
            pieces += [heads[j], body, pad[:seg_out[j] - 16 - body.numel()]]
        buf_out = torch.cat(pieces)
        buf_in = torch.empty(sum(seg_in), dtype=torch.uint8, device=dev)
        outs, ins = list(buf_out.split(seg_out)), list(buf_in.split(seg_in))
        # Step 2: the one round.
        if a2a:
            dist.all_to_all_single(buf_in, buf_out, seg_in, seg_out, group=self.group)
        else:
            others = [j for j in range(n) if j != rank]
            self._batch_p2p({j: outs[j] for j in others}, {j: ins[j] for j in others})
        # Step 3: the heads, in one host read.
        others = [j for j in range(n) if j != rank]
        head = torch.stack([ins[j][:16] for j in others]).view(torch.int64).view(-1, 2).tolist()
        words, recv_counts = [self._sig_word] * n, [0] * n
        for j, (c, w) in zip(others, head):
            recv_counts[j], words[j] = c, w
        self._verify_signatures(words)
        # Step 4: overflow, between the pairs that have one.
        tails_out = {j: staged[j][send_caps[j]:] for j in others if counts[j] > send_caps[j]}
        tails_in = {j: torch.empty(recv_counts[j] - recv_caps[j], dtype=dtype, device=dev)
                    for j in others if recv_counts[j] > recv_caps[j]}
        if tails_out or tails_in:
            self._batch_p2p(tails_out, tails_in)
        # Step 5: the parts.
        recv = [send[rank]] * n
        for j in others:
            first = ins[j][16:16 + min(recv_counts[j], recv_caps[j]) * esz].view(dtype)
            part = torch.cat([first, tails_in[j]]) if j in tails_in else first
            recv[j] = part if home == dev else part.to(home)
        return recv

    def _all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The started gather, drained."""
        handle = self._all_gather_v_start(t)
        for _ in handle.as_completed():
            pass
        return handle.parts

    def _post(self, recvs: list[tuple[int, torch.Tensor]], sends: list[tuple[int, torch.Tensor]]) -> list:
        """One round as one ``batch_isend_irecv`` (receives listed first; empty buffers left out on both
        sides, which know the sizes); returns its requests."""
        ops = [dist.P2POp(dist.irecv, b, group=self.group, group_peer=j) for j, b in recvs if b.numel()]
        ops += [dist.P2POp(dist.isend, b, group=self.group, group_peer=j) for j, b in sends if b.numel()]
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def _all_gather_v_start(self, t: torch.Tensor) -> GatherHandle:
        """The two phases of ``comm/gather.py``; the payload rounds run as the consumer reads.

        1. Counts: all-gather of ``(count, signature)`` rows (fixed sizes; ``gather.count_schedule``),
           one host read, check.
        2. Pick the payload algorithm from the counts (the same on every rank) and post its round 0
           into one buffer in relative block order (part ``j`` is a view of it).
        3. Reading rank ``j``'s part waits for the round that delivers it, then posts the next round at
           once (it forwards what just arrived), so the consumer decodes while that round is on the
           wire. ``finish`` runs the rounds left: the other ranks need what this rank forwards.
        """
        n, rank = self.size, self.rank
        if n == 1:
            self._verify_signatures([self._sig_word])
            return GatherHandle(rank, [t], plan=gather.GatherPlan("direct", [t.numel()], t.element_size(),
                                                                  self.gather_costs))
        dev = self.device
        # Step 1: counts. Row i of the table: rank (rank+i) mod n's [count, signature].
        table = torch.zeros((n, 2), dtype=torch.int64, device=dev)
        table[0] = self._header([t.numel(), self._sig_word])
        for recvs, sends in gather.count_schedule(n, rank, self.gather_costs):
            for work in self._post([(m.peer, table[m.first:m.first + m.count]) for m in recvs],
                                   [(m.peer, table[m.first:m.first + m.count]) for m in sends]):
                work.wait()
        rows = table.tolist()  # the gather's one host synchronization
        counts = [0] * n
        sigs = [0] * n
        for i, (c, w) in enumerate(rows):
            counts[(rank + i) % n], sigs[(rank + i) % n] = c, w
        self._verify_signatures(sigs)
        # Step 2: the algorithm, the buffer, round 0.
        esz = t.element_size()
        algo = gather.choose(self.gather_impl, [c * esz for c in counts], self.gather_costs)
        rel = [row[0] for row in rows]
        offs = [0]
        for c in rel:
            offs.append(offs[-1] + c)
        flat = torch.empty(offs[-1], dtype=t.dtype, device=dev)
        flat[:rel[0]].copy_(t)
        parts = [t] * n
        for i in range(1, n):
            parts[(rank + i) % n] = flat[offs[i]:offs[i + 1]]
        rounds = gather.schedule(algo, n, rank)
        when = gather.arrival_round(algo, n)

        def span(m: gather.Msg) -> torch.Tensor:
            return flat[offs[m.first]:offs[m.first + m.count]]

        state = {"done": 0, "works": []}

        def post(k: int) -> None:
            recvs, sends = rounds[k]
            state["works"] = self._post([(m.peer, span(m)) for m in recvs], [(m.peer, span(m)) for m in sends])

        def complete_through(k: int) -> None:
            # Step 3: wait round by round; each next round is posted as soon as its data is here.
            while state["done"] <= k:
                for work in state["works"]:
                    work.wait()
                state["works"] = []
                state["done"] += 1
                if state["done"] < len(rounds):
                    post(state["done"])

        post(0)

        def wait_for(j: int) -> torch.Tensor:
            complete_through(when[(j - rank) % n])
            return parts[j] if t.device == dev else parts[j].to(t.device)

        order = [(rank + i) % n for i in gather.arrival_order(algo, n)[1:]]
        return GatherHandle(rank, parts, {j: (lambda j=j: wait_for(j)) for j in order},
                            lambda: complete_through(len(rounds) - 1), order,
                            gather.GatherPlan(algo, counts, esz, self.gather_costs))

    def _all_gather_v_start_inline(self, t: torch.Tensor, caps: list[int]) -> GatherHandle:
        """The count-carrying gather (``comm/inline.py``): no count round, and the whole gather done here.

        1. One uint8 buffer of every rank's block in relative order, ``inline_segment_bytes(caps[j])``
           each (every rank holds the same ``caps``); this rank's block written in place.
        2. The payload rounds of the algorithm ``gather.choose`` picks for those block sizes, each one
           ``batch_isend_irecv``.
        3. One host read of every block's head; check the signatures.
        4. Overflow: each rank whose payload outgrew its block sends the rest to every peer, in one
           ``batch_isend_irecv`` (every rank read who did in step 3, so every rank takes part or none).
        5. Part ``j``: a view of its block (after an overflow, the two pieces joined).

        Unlike the count-round form, the handle yields nothing before the last round: a block's length is
        in its head, and reading heads round by round would take a host read per round.
        """
        n, rank = self.size, self.rank
        dev, home = self.device, t.device
        dtype, esz = t.dtype, t.element_size()
        staged = t.to(dev) if home != dev else t
        # Step 1: the buffer, this rank's block in it.
        seg = [inline_segment_bytes(caps[(rank + i) % n], esz) for i in range(n)]
        offs = [0]
        for b in seg:
            offs.append(offs[-1] + b)
        flat = torch.empty(offs[-1], dtype=torch.uint8, device=dev)
        body = staged[:caps[rank]].view(torch.uint8)
        flat[:HEAD_BYTES].copy_(self._header([t.numel(), self._sig_word]).view(torch.uint8))
        flat[HEAD_BYTES:HEAD_BYTES + body.numel()].copy_(body)
        flat[HEAD_BYTES + body.numel():offs[1]].zero_()
        # Step 2: the rounds.
        algo = gather.choose(self.gather_impl, gather.inline_block_bytes(caps, esz), self.gather_costs)

        def span(m: gather.Msg) -> torch.Tensor:
            return flat[offs[m.first]:offs[m.first + m.count]]

        for recvs, sends in gather.schedule(algo, n, rank):
            for work in self._post([(m.peer, span(m)) for m in recvs], [(m.peer, span(m)) for m in sends]):
                work.wait()
        # Step 3: the heads, in one host read.
        heads = torch.stack([flat[offs[i]:offs[i] + HEAD_BYTES] for i in range(n)]).view(torch.int64).tolist()
        counts, sigs = [0] * n, [0] * n
        for i, (c, w) in enumerate(heads):
            counts[(rank + i) % n], sigs[(rank + i) % n] = c, w
        self._verify_signatures(sigs)
        # Step 4: overflow.
        others = [j for j in range(n) if j != rank]
        tails_in = {j: torch.empty(counts[j] - caps[j], dtype=dtype, device=dev)
                    for j in others if counts[j] > caps[j]}
        if tails_in or counts[rank] > caps[rank]:
            tail = staged[caps[rank]:]
            self._batch_p2p({j: tail for j in others} if counts[rank] > caps[rank] else {}, tails_in)
        # Step 5: the parts.
        parts = [t] * n
        for i in range(1, n):
            j = (rank + i) % n
            first = flat[offs[i] + HEAD_BYTES:offs[i] + HEAD_BYTES + min(counts[j], caps[j]) * esz].view(dtype)
            part = torch.cat([first, tails_in[j]]) if j in tails_in else first
            parts[j] = part if home == dev else part.to(home)
        return GatherHandle(rank, parts, plan=gather.GatherPlan(algo, counts, esz, self.gather_costs, list(caps)))

    def _sendrecv(self, sends: dict, recv_counts: dict, dtype: torch.dtype) -> dict:
        """One fixed-size round as one ``batch_isend_irecv`` on the communicator's device."""
        dev = self.device
        home = next(iter(sends.values())).device if sends else dev
        recvs = {j: torch.empty(c, dtype=dtype, device=dev) for j, c in recv_counts.items()}
        for work in self._post(list(recvs.items()), [(j, t.to(dev)) for j, t in sends.items()]):
            work.wait()
        return {j: r.to(home) for j, r in recvs.items()}

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

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n = self.size
        if n == 1 or not t.numel():
            return t.clone() if n == 1 else t.new_empty(0)
        dev = self.device
        buf = t if t.device == dev else t.to(dev)
        if out is None or out.device != dev or not out.is_contiguous():  # the caller's out is copied into
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
