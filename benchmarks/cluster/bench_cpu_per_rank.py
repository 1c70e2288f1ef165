"""One rank's CPU per sync phase, for a workload's step: what each scheme computes, without the network.

Usage::

    .venv/bin/python benchmarks/cluster/bench_cpu_per_rank.py --workload synth_dgc1=$WORK/synth_dgc1 \\
        --ranks 16 --schemes zen,agsparse

The ranks run in SimWorld one at a time (``max_active=1``, one torch thread), so a compute phase's
time (``hash_s``, ``aggregate_s``, ``decode_s``, ...) is one core's time, not shared with the other
ranks; phases that wait for peers (``push_s``, ``pull_s``, ``allgather_s``) include the other ranks'
turns and are not CPU. ``cpu_total_s`` is the rank's thread CPU time for the whole sync. Each scheme
syncs ``--syncs`` times in one slot (a bucket's steady state, counts in the payload); the last sync is
reported, median over ranks. The emulated cluster's 2 cores run 8-16 such ranks at once, so these
times times n / cores are the floor every sync pays there (``benchmarks/cluster/results/cluster_pull16.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench_comm import load_workload  # noqa: E402
from zen_ext.comm.simulated import SimWorld  # noqa: E402
from zen_ext.core.registry import build_scheme  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", required=True, help="label=path[@step] (bench_comm.py prepare writes them)")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--schemes", default="zen,agsparse")
    ap.add_argument("--syncs", type=int, default=4)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    label, _, step = load_workload(a.workload)
    for key, grads in step.slices.items():
        if len(grads) < a.ranks:
            raise SystemExit(f"--ranks ({a.ranks}) must be <= the workload's ranks ({len(grads)})")
        grads = grads[: a.ranks]
        for name in a.schemes.split(","):
            scheme = build_scheme(name)

            def one_rank(comm, g, scheme=scheme, name=name, key=key):
                out = torch.empty(g.dense_numel, dtype=g.values.dtype)
                t: dict = {}
                with comm.slot((name, key)):
                    for _ in range(a.syncs):
                        t = {}
                        t0 = time.thread_time()
                        scheme.sync(comm, g, key=key, timings=t, out=out)
                        t["cpu_total_s"] = time.thread_time() - t0
                return t

            per_rank = SimWorld(a.ranks, max_active=1).run(one_rank, grads)
            phases = [k for k, v in per_rank[0].items() if isinstance(v, float)]
            ms = {k: statistics.median(r[k] for r in per_rank) * 1e3 for k in phases}
            print(f"{label} {key} n={a.ranks} {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
