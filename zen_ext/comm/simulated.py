"""SimWorld: ``n`` virtual ranks in one process, each a thread running the *same* scheme code.

Ranks meet at a shared barrier for every collective: each deposits what it sends, the barrier
releases, each takes what is addressed to it, and a second barrier frees the slots for reuse. Payloads
are handed over by reference (no copies), so 128 ranks of a 10M-element gradient fit on a laptop. A
rank that raises aborts the barrier, so the others fail with it instead of hanging.

Example::

    >>> world = SimWorld(4)
    >>> outs = world.run(lambda comm, x: scheme.sync(comm, x), inputs)  # doctest: +SKIP
    >>> world.stats[0].bytes_sent  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

import torch

from . import gather
from .base import CommStats, Communicator, GatherHandle


class _Shared:
    def __init__(self, n: int, timeout_s: float, max_active: int) -> None:
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        # At most max_active ranks compute at once (a rank gives its token back while it waits at a
        # barrier): peak memory is then set by max_active ranks' temporaries, not n of them.
        self.active = threading.BoundedSemaphore(max_active)
        self.slots: list[Any] = [None] * n
        self.result: Any = None


class SimCommunicator(Communicator):
    """One virtual rank's view of a SimWorld."""

    def __init__(self, rank: int, size: int, shared: _Shared, device: torch.device | str = "cpu",
                 gather_impl: str = "auto", gather_costs: gather.GatherCosts | None = None) -> None:
        super().__init__()
        self.rank, self.size, self._sh = rank, size, shared
        self._device = torch.device(device)
        self.gather_impl = gather_impl
        self.gather_costs = gather_costs or gather.GatherCosts()
        self._holding = False  # holds a compute token (set by SimWorld.run)

    @property
    def device(self) -> torch.device:
        return self._device

    def options(self) -> dict:
        return {"transport": "sim", "device_type": self._device.type}

    def _wait(self) -> None:
        if not self._holding:  # driven by the caller's own threads, outside SimWorld.run
            self._sh.barrier.wait()
            return
        self._sh.active.release()
        try:
            self._sh.barrier.wait()
        finally:
            self._sh.active.acquire()

    def _post_and_collect(self, item: Any) -> list[Any]:
        self._sh.slots[self.rank] = item
        self._wait()
        got = list(self._sh.slots)
        self._wait()
        return got

    def _exchange_v(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        # The signature word travels with the payloads, as in TorchCommunicator's header, and is
        # compared before any payload is taken.
        got = self._post_and_collect((self._sig_word, send))
        self._verify_signatures([g[0] for g in got])
        return [got[j][1][self.rank] for j in range(self.size)]

    def _exchange_v_inline(self, send: list[torch.Tensor], send_caps: list[int],
                           recv_caps: list[int]) -> list[torch.Tensor]:
        # As _exchange_v, and each receiver checks what a real transport relies on without a message:
        # the sender reserved for it exactly what it reserves for the sender (else NCCL would hang).
        got = self._post_and_collect((self._sig_word, send, send_caps))
        for j, (_, _, theirs) in enumerate(got):
            if j != self.rank and theirs[self.rank] != recv_caps[j]:
                raise RuntimeError(f"SimWorld: rank {j} reserved {theirs[self.rank]} elements for rank {self.rank}, "
                                   f"which reserved {recv_caps[j]} (the count-carrying exchange's capacities "
                                   f"must be agreed)")
        self._verify_signatures([g[0] for g in got])
        return [got[j][1][self.rank] for j in range(self.size)]

    def _all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._all_gather_v_start(t).parts

    def _round(self, sends: dict[int, Any], recv_from: list[int]) -> list[Any]:
        """One round: deposit ``{peer: payload}``, take what each of ``recv_from`` addressed to this rank."""
        got = self._post_and_collect(sends)
        return [got[j][self.rank] for j in recv_from]

    def _all_gather_v_start(self, t: torch.Tensor) -> GatherHandle:
        """The rounds of ``comm/gather.py``, as TorchCommunicator runs them, blocks handed by reference.

        1. Counts: the all-gather of ``(count, signature)`` pairs (``gather.count_schedule``); check.
        2. Payloads: the same algorithm TorchCommunicator picks, round by round; every message is the
           list of the blocks it carries, so which rank forwards what is the real schedule.
        """
        n, rank = self.size, self.rank
        if n == 1:
            self._verify_signatures([self._sig_word])
            return GatherHandle(rank, [t], plan=gather.GatherPlan("direct", [t.numel()], t.element_size(),
                                                                  self.gather_costs))
        # Step 1: counts.
        rows: list[Any] = [None] * n
        rows[0] = (t.numel(), self._sig_word)
        for recvs, sends in gather.count_schedule(n, rank, self.gather_costs):
            got = self._round({m.peer: rows[m.first:m.first + m.count] for m in sends}, [m.peer for m in recvs])
            for m, payload in zip(recvs, got):
                rows[m.first:m.first + m.count] = payload
        counts = [rows[(i - rank) % n][0] for i in range(n)]
        self._verify_signatures([rows[(i - rank) % n][1] for i in range(n)])
        # Step 2: payloads.
        esz = t.element_size()
        algo = gather.choose(self.gather_impl, [c * esz for c in counts], self.gather_costs)
        blocks: list[Any] = [None] * n
        blocks[0] = t
        for recvs, sends in gather.schedule(algo, n, rank):
            got = self._round({m.peer: blocks[m.first:m.first + m.count] for m in sends}, [m.peer for m in recvs])
            for m, payload in zip(recvs, got):
                blocks[m.first:m.first + m.count] = payload
        parts = [blocks[(j - rank) % n] for j in range(n)]
        return GatherHandle(rank, parts, plan=gather.GatherPlan(algo, counts, esz, self.gather_costs))

    def _all_gather_v_start_inline(self, t: torch.Tensor, caps: list[int]) -> GatherHandle:
        """The count-carrying gather (``comm/inline.py``), as TorchCommunicator runs it.

        1. Check what a real transport relies on without a message: every rank holds the same ``caps``
           (else NCCL would hang on mismatched sizes).
        2. The payload rounds of the algorithm chosen for the block sizes; a block is ``(count,
           signature, the first min(count, cap) elements)``. Check the signatures.
        3. Overflow: the ranks whose payload outgrew its block hand the rest to every peer.
        """
        n, rank = self.size, self.rank
        # Step 1: agreed capacities.
        for j, theirs in enumerate(self._post_and_collect(list(caps))):
            if list(theirs) != list(caps):
                raise RuntimeError(f"SimWorld: rank {j} sized all_gather_v's blocks {list(theirs)}, rank {rank} "
                                   f"{list(caps)} (the count-carrying gather's capacities must be agreed)")
        # Step 2: the blocks.
        esz = t.element_size()
        algo = gather.choose(self.gather_impl, gather.inline_block_bytes(caps, esz), self.gather_costs)
        blocks: list[Any] = [None] * n
        blocks[0] = (t.numel(), self._sig_word, t[:caps[rank]])
        for recvs, sends in gather.schedule(algo, n, rank):
            got = self._round({m.peer: blocks[m.first:m.first + m.count] for m in sends}, [m.peer for m in recvs])
            for m, payload in zip(recvs, got):
                blocks[m.first:m.first + m.count] = payload
        mine = [blocks[(j - rank) % n] for j in range(n)]
        self._verify_signatures([b[1] for b in mine])
        counts = [b[0] for b in mine]
        parts = [b[2] for b in mine]
        parts[rank] = t
        # Step 3: overflow.
        if any(c > cap for c, cap in zip(counts, caps)):
            tails = self._post_and_collect(t[caps[rank]:] if counts[rank] > caps[rank] else None)
            for j in range(n):
                if j != rank and tails[j] is not None:
                    parts[j] = torch.cat([parts[j], tails[j]])
        return GatherHandle(rank, parts, plan=gather.GatherPlan(algo, counts, esz, self.gather_costs, list(caps)))

    def _sendrecv(self, sends: dict, recv_counts: dict, dtype: torch.dtype) -> dict:
        got = self._post_and_collect(sends)
        return {j: got[j].get(self.rank, torch.empty(0, dtype=dtype, device=self._device)) for j in recv_counts}

    def _gather_words(self, word: int) -> list[int]:
        return self._post_and_collect(word)

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        self._sh.slots[self.rank] = t
        self._wait()
        # Rank r reduces the r-th chunk over all ranks in rank order (a fixed summation order, so
        # results are deterministic), writing it into every rank's buffer after the next barrier.
        flat = [s.reshape(-1) for s in self._sh.slots]
        numel = flat[0].numel()
        lo, hi = numel * self.rank // self.size, numel * (self.rank + 1) // self.size
        acc = flat[0][lo:hi].clone()
        for f in flat[1:]:
            if op == "sum":
                acc += f[lo:hi]
            else:
                torch.maximum(acc, f[lo:hi], out=acc)
        self._wait()
        for f in flat:
            f[lo:hi] = acc
        self._wait()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        got = self._post_and_collect(t if self.rank == src else None)
        if self.rank != src:
            t.copy_(got[src])


class SimWorld:
    """``n`` virtual ranks in one process.

    Args:
        n: number of ranks (>= 1).
        timeout_s: how long a rank waits at a collective before the run fails (a scheme that calls
            different collectives on different ranks must fail loudly, never hang).
        max_active: ranks computing at once between collectives (default: the CPU count). Keeps
            memory bounded at n = 128, where every rank builds a dense result.
        device: the ranks' ``comm.device`` (where counts, headers and object gathers are built), e.g.
            ``"cuda"`` to run schemes on CUDA tensors as NCCL would see them.
        gather_impl, gather_costs: ``all_gather_v``'s payload rounds, as in ``TorchCommunicator``.
    """

    def __init__(self, n: int, timeout_s: float = 600.0, max_active: int | None = None,
                 device: torch.device | str = "cpu", gather_impl: str = "auto",
                 gather_costs: gather.GatherCosts | None = None) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"SimWorld n ({n}) must be an int >= 1")
        if gather_impl not in gather.GATHER_IMPLS:
            raise ValueError(f"SimWorld gather_impl ({gather_impl!r}) must be one of {list(gather.GATHER_IMPLS)}")
        self.gather_impl, self.gather_costs = gather_impl, gather_costs
        self.n = n
        self.timeout_s = timeout_s
        self.max_active = max(1, max_active or os.cpu_count() or 1)
        self.device = torch.device(device)
        self.stats: list[CommStats] = [CommStats() for _ in range(n)]
        self._comms: list[SimCommunicator] | None = None

    def communicators(self) -> list[SimCommunicator]:
        shared = _Shared(self.n, self.timeout_s, self.max_active)
        self._comms = [SimCommunicator(r, self.n, shared, self.device, self.gather_impl, self.gather_costs)
                       for r in range(self.n)]
        self.stats = [c.stats for c in self._comms]
        return self._comms

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any] | None = None) -> list[Any]:
        """Run ``fn(comm, inputs[rank])`` (or ``fn(comm)``) on every rank; returns the per-rank results.

        Stats of this run are in ``self.stats`` (one ``CommStats`` per rank).

        Raises:
            The first exception raised by any rank (the others are aborted).
        """
        if inputs is not None and len(inputs) != self.n:
            raise ValueError(f"SimWorld.run needs {self.n} inputs, got {len(inputs)}")
        comms = self.communicators()
        results: list[Any] = [None] * self.n
        errors: list[tuple[int, BaseException]] = []

        def body(r: int) -> None:
            sh = comms[r]._sh
            sh.active.acquire()
            comms[r]._holding = True
            try:
                args = (comms[r],) if inputs is None else (comms[r], inputs[r])
                results[r] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 — re-raised below, after every rank stopped
                errors.append((r, exc))
                sh.barrier.abort()
            finally:
                sh.active.release()

        if self.n == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}") for r in range(self.n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            real = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
            rank, exc = (real or errors)[0]
            raise RuntimeError(f"SimWorld rank {rank} failed: {exc!r}") from exc
        return results


def run_grid(rows: int, cols: int, fn: Callable[[int, int, SimCommunicator, SimCommunicator], Any],
             col_rank: Callable[[int, int], int] | None = None, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(k, l, row_comm, col_comm)`` on every cell of a ``rows × cols`` grid of virtual ranks, one
    thread each; returns the results by ``k·cols + l``.

    Two groups meet at a cell, as a rank of a 2-D process mesh is in two: row ``k``'s world of ``cols``
    ranks (a node's ranks, a tensor-parallel group), where the cell is rank ``l``, and column ``l``'s world
    of ``rows`` ranks (one local rank of every node, a data-parallel group), where it is rank
    ``col_rank(k, l)`` (default ``k``; any permutation of ``range(rows)`` per column, as ``new_group``
    orders a group by global rank).

    Raises:
        ValueError: ``rows`` or ``cols`` below 1.
        The first exception a cell raised, as it was raised (not the ``BrokenBarrierError`` of the cells it
        stopped): a failing cell aborts every world of the grid, so no other cell waits out its timeout.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"run_grid rows ({rows}) and cols ({cols}) must be >= 1")
    row_worlds = [SimWorld(cols, timeout_s=timeout_s).communicators() for _ in range(rows)]
    col_worlds = [SimWorld(rows, timeout_s=timeout_s).communicators() for _ in range(cols)]
    results: list[Any] = [None] * (rows * cols)
    errors: list[BaseException] = []

    def body(k: int, l: int) -> None:
        col = col_worlds[l][k if col_rank is None else col_rank(k, l)]
        try:
            results[k * cols + l] = fn(k, l, row_worlds[k][l], col)
        except BaseException as exc:  # noqa: BLE001 — re-raised below, after every cell stopped
            errors.append(exc)
            for world in row_worlds + col_worlds:
                world[0]._sh.barrier.abort()

    threads = [threading.Thread(target=body, args=(k, l), name=f"sim-cell-{k}-{l}")
               for k in range(rows) for l in range(cols)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results
