"""OuterSync: local steps, then a sparse outer synchronization of the pseudo-gradients (DiLoCo, arXiv
2311.08105; SparseLoCo, arXiv 2508.15706), summed by a lossless sync scheme (ZEN by default).

Between outer steps each replica trains alone (its engine synchronizes nothing). Every ``every``-th
inner step, per bucket of the flat parameter vector (``zen.bucket_cap_mb``):

1. Pseudo-gradient ``Δ = θ_global − θ_local`` (fp32, on ``state_device``).
2. Error feedback ``e ← β·e + Δ``; top-k of ``|e|`` per ``chunk``-element chunk; the picked values leave
   ``e`` (``outer/select.py``). Density 1: ``Δ`` itself, no ``e``.
3. Sum across replicas: the picks as a ``SparseGrad`` through the scheme (``scheme.sync_group``, the call the
   Synchronizer makes per bucket), or a dense all-reduce at density 1. With ``average: "contributors"``
   ZEN's owners count the replicas that sent each index (``op="contributors"``); other schemes get each
   pick as a row ``(value, 1)``, so the sum also counts them. With ``value_bits`` the picks travel in 8
   or 4 bits and what quantization loses stays in ``e`` (``outer/average.py``).
4. Average: ``/R`` (``"mean"``) or ``/count`` where ``count > 0`` (``"contributors"``; at ZEN's owners).
5. Outer SGD on θ_global (torch.optim.SGD's formula: ``buf ← μ·buf + g``; Nesterov ``g + μ·buf``).
6. Every replica restarts from θ_global (copied into its parameters).

Every replica computes the same θ_global bit for bit: the scheme returns the same sum on every rank and
steps 4–6 are deterministic. The constructor broadcasts rank 0's parameters so that replicas also
start equal, and compares config, scheme and layout across ranks (RuntimeError naming both ranks).

Bytes each replica sends per bucket and outer step: the scheme's for K = ``picks_per_bucket`` entries
(zen: ``≈ 2·(R−1)/R·|∪ picks|`` entries for balanced partitions, against an all-gather's ``(R−1)·K``); at
density 1 a ring all-reduce's ``2·(R−1)/R·N·4``. State per parameter on ``state_device``: 4 B θ_global,
+4 B error feedback (density < 1), +4 B momentum (momentum > 0); ``state_bytes()`` measures it.

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
from .select import picks_per_bucket, select_

log = logging.getLogger(__name__)

OUTER_STATE_FORMAT = "zen_ext.outer"
OUTER_STATE_VERSION = 1
STATE_DTYPE = torch.float32

__all__ = ["OuterSync", "state_bytes_per_param"]


def state_bytes_per_param(cfg: OuterConfig) -> int:
    """The formula: bytes of outer state per parameter element (θ_global, error feedback, momentum), fp32."""
    return 4 * (1 + (0 if cfg.dense else 1) + (1 if cfg.momentum > 0 else 0))


@dataclasses.dataclass
class _Bucket:
    names: list[str]
    params: list[torch.Tensor]
    numel: int
    theta_N: torch.Tensor  # θ_global, fp32, on the state device
    err_N: torch.Tensor | None  # error feedback (density < 1)
    mom_N: torch.Tensor | None  # outer momentum buffer (momentum > 0)
    picks: int  # entries one replica sends per outer step


class OuterSync:
    """The outer synchronization of one replica's parameters over ``comm`` (the replicas).

    Args:
        named_params: ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``), the same names,
            shapes and order on every replica; parameters without ``requires_grad`` are left out.
        comm: the replicas (one rank per replica, or each rank's peers in the other replica groups).
        cfg: the ``zen.outer`` section (OuterConfig or dict).
        scheme: the lossless SyncScheme (or its registered name) that sums the picks: ``zen.scheme``.
        bucket_cap_mb: at most this many MB of fp32 state per bucket (``zen.bucket_cap_mb``).

    Raises:
        ValueError: ``cfg.enabled`` is false, a lossy scheme, no parameters.
        RuntimeError: replicas disagree on config, scheme or parameter layout.

    Example::

        >>> outer = OuterSync(model.named_parameters(), comm, {"enabled": True})  # doctest: +SKIP
        >>> for step in range(1, steps + 1):  # doctest: +SKIP
        ...     loss_fn(model).backward(); opt.step(); opt.zero_grad()
        ...     outer.maybe_step(step)
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], comm: Communicator,
                 cfg: "OuterConfig | dict", *, scheme: "SyncScheme | str" = "zen",
                 bucket_cap_mb: float = 128.0) -> None:
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
        self._agree(named)
        self._start_equal()

    # --- construction -------------------------------------------------------------------------------
    def _state_device(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.cfg.state_device == "cpu" else p.device

    def _build_buckets(self, named, bucket_cap_mb: float) -> list[_Bucket]:
        cap = max(1, int(bucket_cap_mb * 2**20) // 4)
        groups: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for n, p in named:  # whole parameters, in order; a parameter larger than the cap is a bucket alone
            if groups[-1] and size + p.numel() > cap:
                groups.append([])
                size = 0
            groups[-1].append((n, p))
            size += p.numel()
        out = []
        for g in groups:
            params = [p for _, p in g]
            dev = self._state_device(params[0])
            theta = torch.cat([p.detach().reshape(-1) for p in params]).to(dev, STATE_DTYPE)
            numel = theta.numel()
            err = None if self.cfg.dense else torch.zeros_like(theta)
            mom = torch.zeros_like(theta) if self.cfg.momentum > 0 else None
            out.append(_Bucket([n for n, _ in g], params, numel, theta, err, mom, picks_per_bucket(self.cfg, numel)
                               if not self.cfg.dense else numel))
        return out

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every parameter's name, shape and dtype, bucket by bucket (what replicas must share)."""
        return [(n, tuple(p.shape), str(p.dtype)) for b in self.buckets for n, p in zip(b.names, b.params)]

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
        """θ_global := rank 0's parameters on every replica, copied into the parameters."""
        for b in self.buckets:
            buf = b.theta_N.to(self.comm.device)
            self.comm.broadcast(buf, src=0)
            b.theta_N.copy_(buf)
            self._restart_from(b)

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
        """One outer synchronization of every bucket (steps 1–6 of the module docstring)."""
        t0 = time.perf_counter()
        before = self.comm.stats.snapshot()
        st = self._stats
        union = []
        for i, b in enumerate(self.buckets):
            # Step 1: pseudo-gradient, in fp32 on the state device.
            local_N = torch.cat([p.detach().reshape(-1) for p in b.params]).to(b.theta_N.device, STATE_DTYPE)
            delta_N = torch.sub(b.theta_N, local_N, out=local_N)
            # Steps 2-4: what is sent, summed and averaged.
            if b.err_N is None:
                avg_N = self._dense_sum(delta_N)
                avg_N.div_(self.comm.size)
            else:
                b.err_N.mul_(self.cfg.error_decay).add_(delta_N)
                idx_K, val_K = select_(b.err_N, self.cfg)
                avg_N, union_1 = self._sparse_sum(i, b, idx_K, val_K)
                if union_1 is not None:
                    union.append(union_1)
            st["picks"] += b.picks
            st["numel"] += b.numel
            # Step 5: outer SGD on θ_global (torch.optim.SGD's single-tensor formula, dampening 0).
            step_N = avg_N
            if b.mom_N is not None:
                b.mom_N.mul_(self.cfg.momentum).add_(avg_N)
                step_N = avg_N.add_(b.mom_N, alpha=self.cfg.momentum) if self.cfg.nesterov else b.mom_N
            b.theta_N.add_(step_N, alpha=-self.cfg.lr)
            # Step 6: the replica restarts from θ_global.
            self._restart_from(b)
        if union:  # one host read per outer step, for the statistics
            st["union"] += int(torch.stack(union).sum())
        d = self.comm.stats - before
        st["bytes_sent"] += d.bytes_sent
        st["bytes_recv"] += d.bytes_recv
        st["outer_steps"] += 1
        st["outer_s"] += time.perf_counter() - t0
        self.outer_steps += 1

    def _dense_sum(self, delta_N: torch.Tensor) -> torch.Tensor:
        """Density 1: one all-reduce of the whole pseudo-gradient (dense DiLoCo), on the communicator's device."""
        buf = delta_N.to(self.comm.device)
        self.comm.all_reduce(buf)
        return buf.to(delta_N.device)

    def _sparse_sum(self, i: int, b: _Bucket, idx_K: torch.Tensor, val_K: torch.Tensor):
        """The picks of every replica summed by the scheme and averaged (``outer/average.py``).

        Returns:
            ``(avg_N, union_1 or None)``, ``avg_N`` on the state device.
        """
        avg, union_1 = sum_average(self.comm, self.scheme, self.form, str(i), b.numel, idx_K, val_K, b.err_N,
                                   self.cfg.value_bits)
        return avg.to(b.theta_N.device), union_1

    def _restart_from(self, b: _Bucket) -> None:
        """Copy θ_global into the bucket's parameters (one copy to their device, one fused copy into them)."""
        theta = b.theta_N.to(b.params[0].device)
        views, at = [], 0
        for p in b.params:
            views.append(theta[at : at + p.numel()].view_as(p))
            at += p.numel()
        torch._foreach_copy_([p.data for p in b.params], views)

    # --- statistics ---------------------------------------------------------------------------------
    @staticmethod
    def _empty_stats() -> dict:
        return {"outer_steps": 0, "bytes_sent": 0, "bytes_recv": 0, "picks": 0, "union": 0, "numel": 0,
                "outer_s": 0.0}

    def pop_stats(self) -> dict:
        """Totals since the last call, then reset: ``outer_steps``; ``bytes_sent``/``bytes_recv`` over the
        replicas (this rank); ``picks``: entries this replica sent; ``union``: indices at least one replica
        sent (``"contributors"`` only, else 0; counted at ZEN's owners: the non-zero averages); ``numel``: elements synchronized; ``outer_s``: seconds."""
        st, self._stats = self._stats, self._empty_stats()
        return st

    def state_bytes(self) -> int:
        """Bytes of θ_global, error feedback and momentum held now (``state_bytes_per_param`` × P)."""
        return sum(t.numel() * t.element_size() for b in self.buckets for t in (b.theta_N, b.err_N, b.mom_N)
                   if t is not None)

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """θ_global, the error feedback (this replica's own), the outer momentum, counters; CPU tensors."""
        cpu = (lambda t: None if t is None else t.detach().to("cpu", copy=True))
        return {"format": OUTER_STATE_FORMAT, "version": OUTER_STATE_VERSION,
                "config": dataclasses.asdict(self.cfg), "layout": self.layout(),
                "outer_steps": self.outer_steps, "last_step": self.last_step, "inner_steps": self.inner_steps,
                "buckets": [{"theta": cpu(b.theta_N), "error": cpu(b.err_N), "momentum": cpu(b.mom_N)}
                            for b in self.buckets]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()`` (the parameters themselves come from the engine's checkpoint).

        Raises:
            ValueError: not an outer state of this version, another layout, or state the config lacks.
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
        for b, saved in zip(self.buckets, sd["buckets"]):
            for name, t in (("theta", b.theta_N), ("error", b.err_N), ("momentum", b.mom_N)):
                if t is None:
                    continue
                if saved[name] is None:
                    raise ValueError(f"zen.outer state_dict has no {name} (saved with density/momentum that "
                                     f"keep none); this config needs it")
                t.copy_(saved[name])
        self.outer_steps, self.last_step = int(sd["outer_steps"]), int(sd["last_step"])
        self.inner_steps = int(sd["inner_steps"])
