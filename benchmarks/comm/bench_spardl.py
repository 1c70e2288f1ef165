"""Bytes per rank of SparDL (``core/spardl.py``) against ZEN + DGC at equal density, in SimWorld.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_spardl.py [--numel 262144] [--worlds 8,16,128] \
        [--densities 0.01,0.05] [--out benchmarks/comm/results/spardl_bytes.md]

1. Gradients: the ``dgc`` workload (``zen_ext/analysis/workloads.py``: per-layer scales over two decades,
   half of each rank's variance shared, so the ranks' top-k sets overlap partially), real-valued. ZEN is
   given each rank's top-``density`` entries (what DGC hands it); SparDL the dense gradient (what DGC's
   hand-over gives it: it selects ``k/P`` per block itself).
2. One SimWorld run per (n, density): ZEN twice inside a Communicator slot (the second call is the
   steady state of training: counts in the payload), then SparDL (fixed-size rounds: the same every
   call). Reported per rank (mean over ranks, and the busiest): bytes sent, messages, rounds, and the
   elements the result carries (ZEN: the union of the ranks' top-k, all of it; SparDL: ``≤ k``).
3. What one step delivers of the true sum ``Σg`` of the dense gradients (first step, empty residuals):
   ``‖Σg − result‖ / ‖Σg‖`` for ZEN + DGC (the exact sum of the ranks' top-k) and for SparDL (its
   ``≤ k`` entries); the rest waits in the residuals of both (DGC's, SparDL's global ones).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from zen_ext.analysis.workloads import dgc_topk
from zen_ext.comm.simulated import SimWorld
from zen_ext.core.registry import build_scheme
from zen_ext.core.types import AccumulatedGrad


def measure(n: int, numel: int, density: float, seed: int = 0) -> dict:
    dense = [g.to_dense() for g in dgc_topk(n, numel=numel, density=1.0, integer_values=False, seed=seed)]
    topk = dgc_topk(n, numel=numel, density=density, integer_values=False, seed=seed)
    zen, spardl = build_scheme("zen"), build_scheme("spardl")

    def run(comm, r):
        with comm.slot("bucket"):
            zen.sync(comm, topk[r])
            before = comm.stats.snapshot()
            out_zen = zen.sync(comm, topk[r])
            z = comm.stats - before
        before = comm.stats.snapshot()
        out_sp = spardl.sync(comm, AccumulatedGrad.of(dense[r].clone(), density, torch.float32))
        s = comm.stats - before
        if r:
            return z, s, None, None
        return z, s, out_zen, out_sp

    t0 = time.perf_counter()
    got = SimWorld(n).run(run, list(range(n)))
    out_zen, out_sp = got[0][2], got[0][3]
    true = sum(dense)
    err = lambda out: float((true - out).norm() / true.norm())  # noqa: E731
    row = {"n": n, "density": density, "numel": numel, "seconds": time.perf_counter() - t0,
           "union_entries": int(out_zen.ne(0).sum()), "spardl_entries": int(out_sp.ne(0).sum()),
           "zen_rel_error": err(out_zen), "spardl_rel_error": err(out_sp)}
    for i, name in ((0, "zen"), (1, "spardl")):
        st = [g[i] for g in got]
        row[f"{name}_bytes_mean"] = sum(s.bytes_sent for s in st) / n
        row[f"{name}_bytes_max"] = max(max(s.bytes_sent, s.bytes_recv) for s in st)
        row[f"{name}_msgs"] = max(s.msgs_sent for s in st)
        row[f"{name}_rounds"] = max(s.rounds for s in st)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 18)
    ap.add_argument("--worlds", default="8,16,128")
    ap.add_argument("--densities", default="0.01,0.05")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for density in [float(x) for x in args.densities.split(",")]:
        for n in [int(x) for x in args.worlds.split(",")]:
            rows.append(measure(n, args.numel, density))
            print(rows[-1], flush=True)
    lines = ["| density | n | ZEN+DGC bytes/rank (mean / max) | SparDL bytes/rank (mean / max) | ZEN ÷ SparDL | "
             "msgs ZEN / SparDL | rounds ZEN / SparDL | result entries ZEN (union) / SparDL | ‖Σg − result‖ / ‖Σg‖ ZEN / SparDL |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['density']:.0%} | {r['n']} | {r['zen_bytes_mean'] / 1e3:,.1f} KB / {r['zen_bytes_max'] / 1e3:,.1f} KB | "
            f"{r['spardl_bytes_mean'] / 1e3:,.1f} KB / {r['spardl_bytes_max'] / 1e3:,.1f} KB | "
            f"{r['zen_bytes_mean'] / r['spardl_bytes_mean']:.2f}× | {r['zen_msgs']} / {r['spardl_msgs']} | "
            f"{r['zen_rounds']} / {r['spardl_rounds']} | {r['union_entries']:,} / {r['spardl_entries']:,} | "
            f"{r['zen_rel_error']:.3f} / {r['spardl_rel_error']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
