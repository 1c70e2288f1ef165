"""OuterSync: local steps, then a sparse outer synchronization of the pseudo-gradients (DiLoCo, arXiv
2311.08105; SparseLoCo, arXiv 2508.15706), summed by a lossless sync scheme (ZEN by default).

Between outer steps each replica trains alone (its engine synchronizes nothing). Every ``every``-th
inner step, per bucket of the flat parameter vector (``zen.bucket_cap_mb``):

1. Pseudo-gradient ``Δ = θ_ref − θ_local`` (fp32, on ``state_device``): ``θ_ref`` is θ_global at
   ``delay: 0``, the anchor ``θ_a`` at ``delay: 1`` (the replica's parameters right after its last outer
   step), so Δ is this round's own movement and nothing is sent twice.
2. Error feedback ``e ← β·e + Δ``; top-k of ``|e|`` per ``chunk``-element chunk; the picked values leave
   ``e`` (``outer/select.py``). Density 1: ``Δ`` itself, no ``e``.
3. ``delay: 1`` only, merge the previous round: wait for round t−1's sum (started at the previous outer
   step; its steps 4–6 already moved θ_global on the communication thread), then
   ``θ_local ← θ_global + (θ_local − θ_a)`` (restart from θ_global, keeping this round's own movement,
   which is in flight) and ``θ_a ← θ_local``. Nothing in flight (the first outer step, after
   ``finish``): ``θ_local`` unchanged, ``θ_a ← θ_local``.
4. Sum across replicas: the picks as a ``SparseGrad`` through the scheme (``scheme.sync_group``, the call the
   Synchronizer makes per bucket), or a dense all-reduce at density 1. With ``average: "contributors"``
   ZEN's owners count the replicas that sent each index (``op="contributors"``); other schemes get each
   pick as a row ``(value, 1)``, so the sum also counts them. With ``value_bits`` the picks travel in 8
   or 4 bits and what quantization loses stays in ``e`` (``outer/average.py``). ``delay: 1``:
   steps 4–6 run on a communication thread (``reduction/worker.py``'s ``CommWorker``) over a
   communicator of their own (``overlap_comm``: never the training thread's group), while the inner
   steps of round t+1 go on.
5. Average: ``/R`` (``"mean"``) or ``/count`` where ``count > 0`` (``"contributors"``; at ZEN's owners).
6. Outer SGD on θ_global (torch.optim.SGD's formula: ``buf ← μ·buf + g``; Nesterov ``g + μ·buf``).
7. ``delay: 0`` only: every replica restarts from θ_global (copied into its parameters).

Why step 3 counts nothing twice (``delay: 1``): the invariant is ``θ_local = θ_global + p_t + q`` where
``p_t = θ_a − θ_global`` is the replica's own movement in round t (in flight, not yet in θ_global) and
``q = θ_local − θ_a`` its movement since. Once round t's average is in θ_global, step 3 swaps ``p_t``
for it: ``θ_global_new + (θ_local − θ_a) = θ_global_new + q``. Each round's own movement therefore
lives in the replica's parameters for one round, until its average replaces it; Streaming DiLoCo
(arXiv 2501.18512) mixes the two instead (``α·θ_local + (1 − α)·θ_global``); this merge is additive.
``finish()`` applies the round in flight the same way and sets ``θ_a ← θ_global`` (nothing in flight),
so right after an outer step it leaves every replica at θ_global; the engines call it at the end.

Every replica computes the same θ_global bit for bit: the scheme returns the same sum on every rank and
steps 5–6 are deterministic. At ``delay: 1`` the parameters differ across replicas after an outer step
(each carries its own round in flight); θ_global does not. The constructor broadcasts rank 0's
parameters so that replicas also start equal, and compares config, scheme and layout across ranks
(RuntimeError naming both ranks).

Bytes each replica sends per bucket and outer step: the scheme's for K = ``picks_per_bucket`` entries
(zen: ``≈ 2·(R−1)/R·|∪ picks|`` entries for balanced partitions, against an all-gather's ``(R−1)·K``); at
density 1 a ring all-reduce's ``2·(R−1)/R·N·4``. State per parameter on ``state_device``: 4 B θ_global,
+4 B error feedback (density < 1), +4 B momentum (momentum > 0), +4 B the anchor θ_a (delay 1);
``state_bytes()`` measures it.

Legend: ``_N`` elements of a bucket, ``_K`` picks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable

import torch

from ..comm.base import Communicator
from ..core.registry import build_scheme
from ..core.scheme import SyncScheme
from .average import plan, sum_average
from .config import OuterConfig
from .overlap import InFlight, private_communicator
from .select import picks_per_bucket, select_

log = logging.getLogger(__name__)

OUTER_STATE_FORMAT = "zen_ext.outer"
OUTER_STATE_VERSION = 1
STATE_DTYPE = torch.float32

__all__ = ["OuterSync", "state_bytes_per_param"]


def state_bytes_per_param(cfg: OuterConfig) -> int:
    """The formula: bytes of outer state per parameter element (θ_global, error feedback, momentum, anchor), fp32."""
    return 4 * (1 + (0 if cfg.dense else 1) + (1 if cfg.momentum > 0 else 0) + cfg.delay)


@dataclasses.dataclass
class _Bucket:
    names: list[str]
    params: list[torch.Tensor]
    numel: int
    theta_N: torch.Tensor  # θ_global, fp32, on the state device
    err_N: torch.Tensor | None  # error feedback (density < 1)
    mom_N: torch.Tensor | None  # outer momentum buffer (momentum > 0)
    picks: int  # entries one replica sends per outer step
    anchor_N: torch.Tensor | None = None  # θ_a (delay 1): the parameters right after the last outer step
    inflight: InFlight | None = None  # delay 1: the round whose sum is started and not merged yet


class OuterSync:
    """The outer synchronization of one replica's parameters over ``comm`` (the replicas).

    Args:
        named_params: ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``), the same names,
            shapes and order on every replica; parameters without ``requires_grad`` are left out.
        comm: the replicas (one rank per replica, or each rank's peers in the other replica groups).
        cfg: the ``zen.outer`` section (OuterConfig or dict).
        scheme: the lossless SyncScheme (or its registered name) that sums the picks: ``zen.scheme``.
        bucket_cap_mb: at most this many MB of fp32 state per bucket (``zen.bucket_cap_mb``).
        overlap_comm: ``delay: 1`` only: the communicator the communication thread sums over (the same
            ranks as ``comm``, a process group nothing else uses). Default: built from a
            ``TorchCommunicator`` (``outer/overlap.py``; collective over ``comm``'s members).

    Raises:
        ValueError: ``cfg.enabled`` is false, a lossy scheme, no parameters, ``delay: 1`` without a
            communicator of its own.
        RuntimeError: replicas disagree on config, scheme or parameter layout.

    Example::

        >>> outer = OuterSync(model.named_parameters(), comm, {"enabled": True})  # doctest: +SKIP
        >>> for step in range(1, steps + 1):  # doctest: +SKIP
        ...     loss_fn(model).backward(); opt.step(); opt.zero_grad()
        ...     outer.maybe_step(step)
        >>> outer.finish()  # doctest: +SKIP
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], comm: Communicator,
                 cfg: "OuterConfig | dict", *, scheme: "SyncScheme | str" = "zen",
                 bucket_cap_mb: float = 128.0, overlap_comm: Communicator | None = None) -> None:
        self.cfg = OuterConfig.from_dict(cfg)
        if not self.cfg.enabled:
            raise ValueError("zen.outer.enabled (False) must be true to build an OuterSync")
        self.comm = comm
        self.scheme = build_scheme(scheme) if isinstance(scheme, str) else scheme
        if not self.scheme.lossless:
            raise ValueError(f"zen.scheme ({self.scheme.name!r}) must be a lossless scheme with zen.outer (the "
                             f"outer sum must equal a dense sum of the picks): e.g. zen, agsparse, sparcml, auto")
        self.form = plan(self.cfg, self.scheme)  # how the picks travel and are averaged (outer/average.py)
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("OuterSync named_params must hold at least one parameter that requires grad")
        self.outer_steps = 0
        self.last_step = 0
        self.inner_steps = 0
        self._stats = self._empty_stats()
        self.buckets = self._build_buckets(named, bucket_cap_mb)
        self.sum_comm, self._worker = comm, None  # where steps 4-6 run: here (delay 0) or on the thread
        self._agree(named)  # first: ranks that disagree on delay must fail here, not hang building a group
        if self.cfg.delay:
            from ..reduction.worker import CommWorker

            self.sum_comm = overlap_comm if overlap_comm is not None else private_communicator(comm)
            if self.sum_comm is comm or (self.sum_comm.rank, self.sum_comm.size) != (comm.rank, comm.size):
                raise ValueError(f"OuterSync overlap_comm (rank {self.sum_comm.rank} of {self.sum_comm.size}) must "
                                 f"be another communicator over the same ranks as comm (rank {comm.rank} of "
                                 f"{comm.size})")
            self.scheme.check_agreement(self.sum_comm)
            self._worker = CommWorker(self.sum_comm.device, name="zen-outer")
        self._start_equal()

    # --- construction -------------------------------------------------------------------------------
    def local(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor this replica synchronizes for parameter ``p``: ``p`` itself. A sharded engine returns
        the rank's shard (``engines/fsdp_outer.py``: the DTensor's local tensor, looked up at each call
        because FSDP may re-pad and replace it)."""
        return p

    def _state_device(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.cfg.state_device == "cpu" else p.device

    def _build_buckets(self, named, bucket_cap_mb: float) -> list[_Bucket]:
        cap = max(1, int(bucket_cap_mb * 2**20) // 4)
        groups: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for n, p in named:  # whole parameters, in order; a parameter larger than the cap is a bucket alone
            numel = self.local(p).numel()
            if groups[-1] and size + numel > cap:
                groups.append([])
                size = 0
            groups[-1].append((n, p))
            size += numel
        out = []
        for g in groups:
            params = [p for _, p in g]
            dev = self._state_device(self.local(params[0]))
            theta = torch.cat([self.local(p).detach().reshape(-1) for p in params]).to(dev, STATE_DTYPE)
            numel = theta.numel()
            err = None if self.cfg.dense else torch.zeros_like(theta)
            mom = torch.zeros_like(theta) if self.cfg.momentum > 0 else None
            out.append(_Bucket([n for n, _ in g], params, numel, theta, err, mom, picks_per_bucket(self.cfg, numel)
                               if not self.cfg.dense else numel, torch.zeros_like(theta) if self.cfg.delay else None))
        return out

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every parameter's name, shape and dtype, bucket by bucket (what replicas must share)."""
        return [(n, tuple(t.shape), str(t.dtype)) for b in self.buckets for n, p in zip(b.names, b.params)
                for t in (self.local(p),)]

    def _agree(self, named) -> None:
        """Compare what shapes the collectives (config, scheme, layout, bucket sizes) across ranks."""
        self.scheme.check_agreement(self.comm)
        mine = (dataclasses.asdict(self.cfg), self.scheme.name, [b.numel for b in self.buckets], self.layout())
        for rank, theirs in enumerate(self.comm.all_gather_object(mine)):
            if theirs != mine:
                what = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                label = ("zen.outer config", "zen.scheme", "bucket sizes", "parameter layout")[what]
                raise RuntimeError(f"zen.outer: replicas disagree on the {label}: rank {self.comm.rank} has "
                                   f"{mine[what]!r}, rank {rank} has {theirs[what]!r}")

    def _start_equal(self) -> None:
        """θ_global := rank 0's parameters on every replica, copied into the parameters (and the anchor)."""
        for b in self.buckets:
            buf = b.theta_N.to(self.comm.device)
            self.comm.broadcast(buf, src=0)
            b.theta_N.copy_(buf)
            self._write(b, b.theta_N)
            if b.anchor_N is not None:
                b.anchor_N.copy_(b.theta_N)

    # --- the outer step -----------------------------------------------------------------------------
    def maybe_step(self, step: int) -> bool:
        """Call after inner optimizer step ``step`` (1-based count of inner steps done); runs the outer
        step when ``step`` is a multiple of ``every`` (once per such step). Returns whether it ran."""
        self.inner_steps = step
        if step % self.cfg.every or step <= self.last_step:
            return False
        self.outer_step()
        self.last_step = step
        return True

    def step_done(self) -> bool:
        """One more inner optimizer step is done (``maybe_step`` with the count kept here): what an
        optimizer post-step hook calls (``engines/ddp_outer.py``)."""
        return self.maybe_step(self.inner_steps + 1)

    @torch.no_grad()
    def outer_step(self) -> None:
        """One outer synchronization of every bucket (steps 1–7 of the module docstring)."""
        t0 = time.perf_counter()
        before = self.comm.stats.snapshot()
        st = self._stats
        union = []
        for i, b in enumerate(self.buckets):
            if b.inflight is not None and b.err_N is not None and self.cfg.value_bits:
                # The round in flight's sender feedback writes e (outer/average.py): done before step 2.
                self._wait(b)
            # Step 1: pseudo-gradient, in fp32 on the state device, against θ_global or the anchor.
            local_N = self._read(b)
            if b.anchor_N is None:
                delta_N = torch.sub(b.theta_N, local_N, out=local_N)
            else:
                delta_N = torch.sub(b.anchor_N, local_N)
            # Step 2: what is sent (density 1: all of Δ).
            if b.err_N is None:
                payload = (delta_N,)
            else:
                b.err_N.mul_(self.cfg.error_decay).add_(delta_N)
                payload = select_(b.err_N, self.cfg)
            st["picks"] += b.picks
            st["numel"] += b.numel
            if self.cfg.delay:
                # Step 3: round t-1 (already in θ_global) replaces this replica's own movement of that round.
                self._merge(b, local_N)
                # Steps 4-6 on the communication thread, while the next round trains.
                b.inflight = self._launch(i, b, payload)
                continue
            # Steps 4-6: sum, average, outer SGD.
            u = self._sum_and_step(i, b, payload)
            if u is not None:
                union.append(u)
            # Step 7: the replica restarts from θ_global.
            self._write(b, b.theta_N)
        if union:  # one host read per outer step, for the statistics
            st["union"] += int(torch.stack(union).sum())
        d = self.comm.stats - before
        st["bytes_sent"] += d.bytes_sent
        st["bytes_recv"] += d.bytes_recv
        st["outer_steps"] += 1
        st["outer_s"] += time.perf_counter() - t0
        self.outer_steps += 1

    def _sum_and_step(self, i: int, b: _Bucket, payload: tuple) -> torch.Tensor | None:
        """Steps 4–6 over ``sum_comm``: the sum, the average, the outer SGD step on θ_global. Returns the
        number of indices some replica sent (1-element tensor, ``"contributors"``) or None."""
        # Steps 4-5: summed and averaged.
        union = None
        if b.err_N is None:
            avg_N = self._dense_sum(payload[0])
            avg_N.div_(self.sum_comm.size)
        else:
            avg_N, union = self._sparse_sum(i, b, *payload)
        # Step 6: outer SGD on θ_global (torch.optim.SGD's single-tensor formula, dampening 0).
        step_N = avg_N
        if b.mom_N is not None:
            b.mom_N.mul_(self.cfg.momentum).add_(avg_N)
            step_N = avg_N.add_(b.mom_N, alpha=self.cfg.momentum) if self.cfg.nesterov else b.mom_N
        b.theta_N.add_(step_N, alpha=-self.cfg.lr)
        return union

    def _dense_sum(self, delta_N: torch.Tensor) -> torch.Tensor:
        """Density 1: one all-reduce of the whole pseudo-gradient (dense DiLoCo), on the communicator's device."""
        buf = delta_N.to(self.sum_comm.device)
        self.sum_comm.all_reduce(buf)
        return buf.to(delta_N.device)

    def _sparse_sum(self, i: int, b: _Bucket, idx_K: torch.Tensor, val_K: torch.Tensor):
        """The picks of every replica summed by the scheme and averaged (``outer/average.py``).

        Returns:
            ``(avg_N, union_1 or None)``, ``avg_N`` on the state device.
        """
        avg, union_1 = sum_average(self.sum_comm, self.scheme, self.form, str(i), b.numel, idx_K, val_K, b.err_N,
                                   self.cfg.value_bits)
        return avg.to(b.theta_N.device), union_1

    # --- delay 1: the round in flight ---------------------------------------------------------------
    def _launch(self, i: int, b: _Bucket, payload: tuple) -> InFlight:
        """Hand steps 4–6 of bucket ``i`` to the communication thread; its measurements land in ``rec``."""
        rec: dict = {}
        comm = self.sum_comm

        def job() -> torch.Tensor:
            before, t0 = comm.stats.snapshot(), time.perf_counter()
            rec["union"] = self._sum_and_step(i, b, payload)
            d = comm.stats - before
            rec.update(bytes_sent=d.bytes_sent, bytes_recv=d.bytes_recv, sum_s=time.perf_counter() - t0)
            return b.theta_N  # on CUDA the future's event then follows θ_global's update

        return InFlight(self._worker.submit(job, [t for t in payload if t.is_cuda]), rec)

    def _wait(self, b: _Bucket) -> None:
        """Wait for the bucket's sum in flight (steps 4–6 done: θ_global holds it) and count its statistics once."""
        fl = b.inflight
        if fl is None:
            return
        if fl.future is not None:
            t0 = time.perf_counter()
            fl.future.wait()  # re-raises what the thread raised
            self._stats["wait_s"] += time.perf_counter() - t0
            fl.future = None
        if fl.rec is not None:
            st, rec = self._stats, fl.rec
            if rec.get("union") is not None:
                st["union"] += int(rec["union"])
            for k in ("bytes_sent", "bytes_recv", "sum_s"):
                st[k] += rec.get(k, 0)
            fl.rec = None

    def _merge(self, b: _Bucket, local_N: torch.Tensor) -> None:
        """Step 3: ``θ_local ← θ_global + (θ_local − θ_a)`` once the round in flight is in θ_global (nothing
        in flight: unchanged); then ``θ_a ← θ_local`` as the parameters hold it."""
        if b.inflight is not None:
            self._wait(b)
            self._write(b, torch.sub(local_N, b.anchor_N).add_(b.theta_N))
            b.inflight = None
            local_N = self._read(b)  # what the parameters hold (bf16 parameters round the merge)
        b.anchor_N.copy_(local_N)

    @torch.no_grad()
    def finish(self) -> None:
        """End of training (or before evaluating θ_global): apply the round in flight (``delay: 1``).

        1. Wait for every bucket's sum in flight (θ_global then holds every round started).
        2. Merge it: ``θ_local ← θ_global + (θ_local − θ_a)`` (right after an outer step: θ_global exactly).
        3. ``θ_a ← θ_global``: nothing is in flight, so the next pseudo-gradient is measured from θ_global.

        Training may go on afterwards. Not a collective of its own (it waits on sums every replica already
        started), but every replica must call it at the same step to stay in step. Nothing at ``delay: 0``.
        """
        for b in self.buckets:
            if b.inflight is None:
                continue
            # Step 1: wait.
            self._wait(b)
            # Step 2: merge.
            self._write(b, self._read(b).sub_(b.anchor_N).add_(b.theta_N))
            b.inflight = None
            # Step 3: nothing in flight.
            b.anchor_N.copy_(b.theta_N)

    def close(self) -> None:
        """``finish()``, then stop the communication thread (``delay: 1``); idempotent. The OuterSync cannot
        take another outer step at ``delay: 1`` afterwards."""
        self.finish()
        if self._worker is not None:
            self._worker.close()

    # --- parameters ---------------------------------------------------------------------------------
    def _read(self, b: _Bucket) -> torch.Tensor:
        """The bucket's parameters as one new fp32 vector on the state device."""
        return torch.cat([self.local(p).detach().reshape(-1) for p in b.params]).to(b.theta_N.device, STATE_DTYPE)

    def _write(self, b: _Bucket, flat_N: torch.Tensor) -> None:
        """Copy ``flat_N`` into the bucket's parameters (one copy to their device, one fused copy into them)."""
        locals_ = [self.local(p) for p in b.params]
        flat = flat_N.to(locals_[0].device)
        views, at = [], 0
        for t in locals_:
            views.append(flat[at : at + t.numel()].view_as(t))
            at += t.numel()
        torch._foreach_copy_([t.data for t in locals_], views)

    # --- statistics ---------------------------------------------------------------------------------
    @staticmethod
    def _empty_stats() -> dict:
        return {"outer_steps": 0, "bytes_sent": 0, "bytes_recv": 0, "picks": 0, "union": 0, "numel": 0,
                "outer_s": 0.0, "sum_s": 0.0, "wait_s": 0.0}

    def pop_stats(self) -> dict:
        """Totals since the last call, then reset: ``outer_steps``; ``bytes_sent``/``bytes_recv`` over the
        replicas (this rank); ``picks``: entries this replica sent; ``union``: indices at least one replica
        sent (``"contributors"`` only, else 0; counted at ZEN's owners: the non-zero averages); ``numel``:
        elements synchronized; ``outer_s``: seconds the training thread spent in outer steps. ``delay: 1``:
        the sums' bytes, union and ``sum_s`` (seconds on the communication thread) count when their round
        is waited for (the next outer step, ``finish``, ``state_dict``); ``wait_s``: seconds the training
        thread waited for them."""
        st, self._stats = self._stats, self._empty_stats()
        return st

    def state_bytes(self) -> int:
        """Bytes of θ_global, error feedback, momentum and anchor held now (``state_bytes_per_param`` × P)."""
        return sum(t.numel() * t.element_size() for b in self.buckets for t in (b.theta_N, b.err_N, b.mom_N, b.anchor_N)
                   if t is not None)

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """θ_global, the error feedback (this replica's own), the outer momentum, counters; CPU tensors.

        ``delay: 1``: the round in flight is waited for first (its sum completes; nothing is merged into the
        parameters early), so θ_global holds it; the anchor and an ``in_flight`` flag per bucket carry the
        merge still due, which the next outer step makes exactly as the uninterrupted run does.
        """
        for b in self.buckets:
            self._wait(b)
        cpu = (lambda t: None if t is None else t.detach().to("cpu", copy=True))
        return {"format": OUTER_STATE_FORMAT, "version": OUTER_STATE_VERSION,
                "config": dataclasses.asdict(self.cfg), "layout": self.layout(),
                "outer_steps": self.outer_steps, "last_step": self.last_step, "inner_steps": self.inner_steps,
                "buckets": [{"theta": cpu(b.theta_N), "error": cpu(b.err_N), "momentum": cpu(b.mom_N),
                             "anchor": cpu(b.anchor_N), "in_flight": b.inflight is not None}
                            for b in self.buckets]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()`` (the parameters themselves come from the engine's checkpoint).

        A state saved at ``delay: 0`` (no anchor) resumes at ``delay: 1`` with nothing in flight (anchor
        θ_global); one saved with a round in flight needs ``delay: 1``.

        Raises:
            ValueError: not an outer state of this version, another layout, state the config lacks, or a
                round in flight at ``delay: 0``.
        """
        if not isinstance(sd, dict) or sd.get("format") != OUTER_STATE_FORMAT:
            raise ValueError(f"zen.outer state_dict must have format {OUTER_STATE_FORMAT!r}")
        if sd.get("version") != OUTER_STATE_VERSION:
            raise ValueError(f"zen.outer state_dict version ({sd.get('version')!r}) must be {OUTER_STATE_VERSION}")
        if [tuple(x) for x in sd["layout"]] != [(n, tuple(s), d) for n, s, d in self.layout()]:
            raise ValueError("zen.outer state_dict holds another parameter layout than this model's")
        if sd["config"] != dataclasses.asdict(self.cfg):
            log.warning("zen.outer: resuming with a different config: saved %s, now %s", sd["config"],
                        dataclasses.asdict(self.cfg))
        if not self.cfg.delay and any(saved.get("in_flight") for saved in sd["buckets"]):
            raise ValueError("zen.outer state_dict was saved with a round in flight (delay 1); zen.outer.delay (0) "
                             "must be 1 to resume it (or call finish() before saving)")
        for b, saved in zip(self.buckets, sd["buckets"]):
            self._wait(b)
            for name, t in (("theta", b.theta_N), ("error", b.err_N), ("momentum", b.mom_N)):
                if t is None:
                    continue
                if saved[name] is None:
                    raise ValueError(f"zen.outer state_dict has no {name} (saved with density/momentum that "
                                     f"keep none); this config needs it")
                t.copy_(saved[name])
            if b.anchor_N is not None:
                b.anchor_N.copy_(saved["anchor"] if saved.get("anchor") is not None else b.theta_N)
                b.inflight = InFlight(None, None) if saved.get("in_flight") else None
        self.outer_steps, self.last_step = int(sd["outer_steps"]), int(sd["last_step"])
        self.inner_steps = int(sd["inner_steps"])
