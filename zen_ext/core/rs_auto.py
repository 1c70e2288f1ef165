"""``auto`` reduce-scatter: per gradient key, the candidate (``dense``, ``direct``, ``zen``) with the
lowest predicted time, and why.

The prediction reads an ``RSProfile`` (core/reduce_scatter.py): every rank's entry count inside every
owner's range, gathered once per key (one object all-gather of ``n`` ints per rank, outside the byte
accounting as every agreement payload is) on the first call and every ``reprofile_every`` calls after.
Each candidate's predictor sits next to it (``predict_dense_bytes``, ``predict_direct_bytes``,
``predict_zen_bytes``) and gives the busiest rank's bytes, its messages and the rounds; the time is
``bytes · 8 / bandwidth + messages · latency``. The profile is the same on every rank, so is the
choice. ``timings["scheme"]`` names it and ``timings["why"]`` gives every candidate's prediction;
rank 0 logs each new decision once.

Measured, not only predicted (as the all-reduce ``auto``, planner/auto.py): the model sees bytes and
rounds, not the CPU a scheme spends hashing and decoding, and on the emulated cluster it put ``zen``
ahead of ``direct`` where ``direct`` ran 2.6× faster. So after each profile, every candidate predicted
within ``EXPLORE_MARGIN`` of the best runs twice, interleaved (the first run of each is cold: per-layout
tables, the exchange's first call), and the choice is the fastest second run. A run's time is the
slowest rank's (one object all-gather of the group's times, outside the byte accounting like the
profile), so every rank makes the same choice. Every run is lossless, so trial calls return the exact
result too.

Without a fixed link (``bandwidth_gbps`` / ``latency_us`` null), 10 Gbit/s and 20 µs are assumed: the
choice is mostly a matter of bytes, which the profile decides.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from .rs_base import RSProfile, ReduceScatterScheme, as_units
from .rs_dense import DenseReduceScatter, predict_dense_bytes
from .rs_direct import DirectReduceScatter, predict_direct_bytes
from .rs_zen import ZenReduceScatter, predict_zen_bytes
from .types import index_dtype

log = logging.getLogger(__name__)

CANDIDATES = ("dense", "direct", "zen")
DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US = 10.0, 20.0
# Candidates predicted within this factor of the best are measured before the choice is final: the
# model's error differs between schemes (bench_rs_cluster: zen's time over its prediction 2-7x, direct's
# 1.2-2x on 2 shared cores).
EXPLORE_MARGIN = 2.0


def predict(name: str, p: RSProfile, itemsize: int, width: int) -> dict:
    """Candidate ``name``'s predicted bytes, messages and rounds for profile ``p``."""
    if name == "dense":
        return predict_dense_bytes(p.n, [length * width for length in p.lengths], itemsize)
    return {"direct": predict_direct_bytes, "zen": predict_zen_bytes}[name](p)


class AutoReduceScatter(ReduceScatterScheme):
    """Choose a reduce-scatter per gradient key from a byte and round cost model.

    Args:
        bandwidth_gbps, latency_us: the link the predictions assume (null: 10 Gbit/s, 20 µs).
        seed: ``zen``'s hash seed.
        reprofile_every: calls of a key between re-profiles (0: never re-profile).
        schemes: the candidates (a subset of ``dense``, ``direct``, ``zen``).
    """

    name = "auto"

    def __init__(self, bandwidth_gbps: float | None = None, latency_us: float | None = None, seed: int = 0,
                 reprofile_every: int = 1000, schemes: list[str] | tuple[str, ...] | None = None) -> None:
        if bandwidth_gbps is not None and not bandwidth_gbps > 0:
            raise ValueError(f"zen.bandwidth_gbps ({bandwidth_gbps!r}) must be > 0")
        if latency_us is not None and not latency_us >= 0:
            raise ValueError(f"zen.latency_us ({latency_us!r}) must be >= 0")
        if not isinstance(reprofile_every, int) or reprofile_every < 0:
            raise ValueError(f"zen.reprofile_every ({reprofile_every!r}) must be an int >= 0 (0: never)")
        schemes = tuple(CANDIDATES if schemes is None else schemes)
        if not schemes or any(s not in CANDIDATES for s in schemes):
            raise ValueError(f"zen.reduce_scatter schemes ({list(schemes)!r}) must be a non-empty subset of {list(CANDIDATES)}")
        self._fixed = (bandwidth_gbps, latency_us)
        self.bandwidth_gbps = DEFAULT_BANDWIDTH_GBPS if bandwidth_gbps is None else float(bandwidth_gbps)
        self.latency_us = DEFAULT_LATENCY_US if latency_us is None else float(latency_us)
        self.seed, self.reprofile_every, self.schemes = int(seed), reprofile_every, schemes
        classes = {"dense": DenseReduceScatter, "direct": DirectReduceScatter, "zen": ZenReduceScatter}
        self._built = {s: classes[s](**({"seed": self.seed} if s == "zen" else {})) for s in schemes}
        # (rank, key, ...) -> [choice, why, calls, trials to run, {candidate: measured seconds}]
        self._decisions: dict[tuple, list] = {}
        self._lock = threading.Lock()

    def require_low_bits(self, bits: int, carriers: "list[str] | None" = None) -> None:
        """``zen.dgc.value_bits``: choose only among the candidates that carry low-bit values (``zen``)."""
        keep = tuple(s for s in self.schemes if self._built[s].carries_low_bits)
        if not keep:
            super().require_low_bits(bits, carriers)
        self.schemes = keep
        self._built = {s: self._built[s] for s in keep}

    def options(self) -> dict:
        return dict(bandwidth_gbps=self._fixed[0], latency_us=self._fixed[1], seed=self.seed,
                    reprofile_every=self.reprofile_every, schemes=list(self.schemes))

    def decisions(self) -> dict:
        """``{key: (choice, why)}`` of this process's lowest rank (for summaries)."""
        ranks = sorted({k[0] for k in self._decisions})
        return {k[1]: tuple(v[:2]) for k, v in self._decisions.items() if ranks and k[0] == ranks[0]}

    def _reduce_scatter_group(self, comm, grads, ranges, op, outs, timings, keys):
        """1. Per gradient, its decision key; the keys without a current decision are profiled together:
           local entry counts per owner (one host read), one object all-gather, predictions, choice.
        2. Each candidate runs its members of the group (candidate order: the same on every rank): the
           decision, or the key's next trial.
        3. Trials: the slowest rank's time per trial (one object all-gather), the choice after the last.
        """
        n, rank = comm.size, comm.rank
        # Step 1: decide.
        dkeys, stale = [], []
        for i, (g, rs, key) in enumerate(zip(grads, ranges, keys)):
            numel = g.numel() if isinstance(g, torch.Tensor) else g.dense_numel
            dk = (rank, key if key is not None else "", numel, tuple(rs))
            dkeys.append(dk)
            d = self._decisions.get(dk)
            if d is None or (self.reprofile_every and d[2] >= self.reprofile_every):
                stale.append(i)
        if stale:
            self._profile(comm, [grads[i] for i in stale], [ranges[i] for i in stale], [dkeys[i] for i in stale])
        # Step 2: run each candidate's members: the decision, or the key's next trial.
        running = [d[3][0] if d[3] else d[0] for d in (self._decisions[dk] for dk in dkeys)]
        results: list[torch.Tensor | None] = [None] * len(grads)
        elapsed = [0.0] * len(grads)
        for name in self.schemes:
            members = [i for i, r in enumerate(running) if r == name]
            if not members:
                continue
            t0 = time.perf_counter()
            got = self._built[name].reduce_scatter_group_validated(
                comm, [grads[i] for i in members], [ranges[i] for i in members], op, [outs[i] for i in members],
                [timings[i] for i in members], [keys[i] for i in members])
            for i, res in zip(members, got):
                results[i], elapsed[i] = res, time.perf_counter() - t0
        # Step 3: trials: the slowest rank's time of each (one object all-gather for the group; the
        # decisions, hence the trials, are the same on every rank), then the choice once all ran.
        trial = [i for i, dk in enumerate(dkeys) if self._decisions[dk][3]]
        if trial:
            every = comm.all_gather_object([elapsed[i] for i in trial])
            for j, i in enumerate(trial):
                self._record_trial(comm, dkeys[i], running[i], max(e[j] for e in every))
        for i, dk in enumerate(dkeys):
            d = self._decisions[dk]
            d[2] += 1
            if timings[i] is not None:
                timings[i]["scheme"], timings[i]["why"] = running[i], d[1]
        return results

    def _record_trial(self, comm, dk: tuple, name: str, seconds: float) -> None:
        """A trial of ``name`` took ``seconds`` (slowest rank): keep it (a later run overwrites the cold
        first one); after the last trial, the fastest measured candidate is the decision."""
        d = self._decisions[dk]
        d[3].pop(0)
        d[4][name] = seconds
        if d[3]:
            return
        d[0] = min(d[4], key=lambda s: (d[4][s], self.schemes.index(s)))
        d[1] += "; measured: " + ", ".join(f"{s} {t * 1e3:.3g} ms" for s, t in d[4].items()) + f" -> {d[0]}"
        if comm.rank == 0:
            log.info("auto reduce-scatter[%s] -> %s (measured): %s", dk[1] or f"numel {dk[2]}", d[0], d[1])

    def _profile(self, comm, grads, ranges, dkeys) -> None:
        n = comm.size
        facts, local = [], []
        for g, rs in zip(grads, ranges):
            sg, urs = as_units(g, rs)
            ends = torch.tensor([e for _, e in urs], dtype=torch.int64, device=sg.indices.device)
            local.append(torch.bincount(torch.searchsorted(ends, sg.indices, right=True), minlength=n)[:n])
            isz = torch.empty(0, dtype=index_dtype(sg.numel)).element_size()
            facts.append(([e - s for s, e in urs], isz, sg.values.element_size(), sg.row_width))
        mine = torch.stack(local).tolist()  # one host read for the group
        gathered = comm.all_gather_object(mine)
        net_bps, lat_s = self.bandwidth_gbps * 1e9 / 8, self.latency_us * 1e-6
        for i, ((lengths, isz, itemsize, width), dk) in enumerate(zip(facts, dkeys)):
            p = RSProfile(n, lengths, [gathered[j][i] for j in range(n)], isz, itemsize * width)
            preds = {s: predict(s, p, itemsize, width) for s in self.schemes}
            secs = {s: v["bytes"] / net_bps + v["msgs"] * lat_s for s, v in preds.items()}
            choice = min(self.schemes, key=lambda s: (secs[s], self.schemes.index(s)))
            why = "; ".join(f"{s} {preds[s]['bytes'] / 1e6:.3g} MB busiest rank, {preds[s]['rounds']} round(s), "
                            f"{secs[s] * 1e3:.3g} ms" for s in self.schemes)
            # Close candidates run twice each, interleaved, fastest predicted first (the second run counts).
            close = sorted((c for c in self.schemes if secs[c] <= EXPLORE_MARGIN * secs[choice]),
                           key=lambda c: (secs[c], self.schemes.index(c)))
            trials = close * 2 if len(close) > 1 else []
            with self._lock:
                self._decisions[dk] = [choice, why, 0, trials, {}]
            if comm.rank == 0:
                log.info("auto reduce-scatter[%s] -> %s: %s", dk[1] or f"numel {dk[2]}", choice, why)
