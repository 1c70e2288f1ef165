"""The node-level reduce-scatter (``reduction/node_scatter.py``) in SimWorld: across-node bytes per rank
of DGC 1 % against the dense hierarchical reduce-scatter, and the DGC state a rank holds, flat vs
node-level.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_node_rs.py [--nodes 16 --local 8 --numel 1048576]
[--out benchmarks/comm/results/node_level_rs.md]``

Set-up: ``N × L`` ranks (threads; every rank its intra-node and inter-node SimWorld Communicator), one
fp32 bucket of ``numel`` elements, one 2-D parameter, owner ranges even (FSDP2's chunks), every rank's
gradient standard normal (its own seed), ``--steps`` steps. Rows:

* ``dense hierarchical``: the same node-level path with the parameter routed dense and the ``dense``
  reduce-scatter across nodes (a dense reduce-scatter inside the node, then across nodes);
* ``node-level DGC 1 % (zen)``: the parameter routed to DGC (density 1 %, no warm-up), the ``zen``
  reduce-scatter across nodes: DGC selects 1 % of the node's sum of the rank's shard.

Bytes are the Communicators' logical counts (the same on gloo), of the last step (DGC's memory is
warm), deterministic. "busiest" is the rank that sent the most. Wall time per step (the slowest
rank's, min/median/max over the steps after the first) is SimWorld's on this machine's shared cores:
a sanity figure, not a network time. The DGC state is every tensor of the Synchronizer's
``state_dict()`` (residual, thresholds) summed per rank, flat (one SimWorld of ``n`` ranks) against
node-level, at ``L = --local`` and at ``L = 2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from zen_ext import SimWorld  # noqa: E402
from zen_ext.comm.simulated import run_grid  # noqa: E402
from zen_ext.core.rs_base import even_ranges  # noqa: E402
from zen_ext.reduction import BucketReducer, NodeShardedReduce  # noqa: E402
from zen_ext.reduction.hierarchy import owner_order  # noqa: E402
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer  # noqa: E402

WIDTH = 256
DGC = {"enabled": True, "density": 0.01, "min_numel": 0, "momentum_correction": False, "warmup_steps": 0}


def grid(N: int, L: int, fn):
    """``fn(rank, node, inter)`` on ``N × L`` threads (rank = node·L + l); results by rank."""
    nodes = [[k * L + l for l in range(L)] for k in range(N)]
    owners = owner_order(nodes, list(range(N * L)))
    return run_grid(N, L, lambda k, l, intra, inter: fn(k * L + l, NodeShardedReduce(intra, l, L, owners=owners),
                                                         inter), timeout_s=1800)


def grad(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(7919 * step + rank))


def state_bytes(sync: Synchronizer) -> int:
    return sum(t.numel() * t.element_size() for e in sync.state_dict()["sparsifiers"]["params"].values()
               for t in e.values())


def node_run(N: int, L: int, numel: int, steps: int, kind: str, rs: str, dgc: dict = DGC) -> list[dict]:
    n = N * L
    slices = [GradSlice("w", 0, numel, (numel // WIDTH, WIDTH))]
    ranges = even_ranges(numel, n)

    def fn(rank, node, inter):
        sync = Synchronizer(dp_comm=inter, scheme="zen", param_kinds={"w": kind}, dgc=dgc if kind == "dgc" else None,
                            reduce_scatter=rs)
        red = BucketReducer(sync, cap_bytes=64 << 20, dp_size=n, node=node)
        lo, hi = ranges[rank]
        out, times = torch.empty(hi - lo), []
        for s in range(steps):
            x = grad(rank, s, numel)
            red.pop_stats()
            t0 = time.perf_counter()
            red.reduce_scatter_(x, slices, ranges, "sum", out)
            times.append(time.perf_counter() - t0)
            sync.end_step()
        st = red.pop_stats()  # the last step's
        return {"inter_sent": st["dp_bytes_sent"], "inter_recv": st["dp_bytes_recv"],
                "intra_sent": st["intra_bytes_sent"], "times": times, "state": state_bytes(sync)}

    return grid(N, L, fn)


def flat_state(n: int, numel: int, steps: int, dgc: dict = DGC) -> list[int]:
    slices = [GradSlice("w", 0, numel, (numel // WIDTH, WIDTH))]
    ranges = even_ranges(numel, n)

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"w": "dgc"}, dgc=dgc, reduce_scatter="zen")
        red = BucketReducer(sync, cap_bytes=64 << 20, dp_size=n)
        lo, hi = ranges[comm.rank]
        for s in range(steps):
            red.reduce_scatter_(grad(comm.rank, s, numel), slices, ranges, "sum", torch.empty(hi - lo))
            sync.end_step()
        return state_bytes(sync)

    return SimWorld(n, timeout_s=1800).run(fn)


def fmt(b: float) -> str:
    return f"{b / 2**20:,.3f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--local", type=int, default=8)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    N, L, numel = a.nodes, a.local, a.numel - a.numel % (a.nodes * a.local * WIDTH)
    lines = [f"Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_node_rs.py --nodes {N} --local {L} "
             f"--numel {a.numel} --steps {a.steps}`", "",
             f"{N} nodes × {L} ranks (n = {N * L}), one fp32 bucket of {numel:,} elements "
             f"({fmt(4 * numel)}), even owner ranges; bytes of step {a.steps} per rank.", "",
             "| path | across-node sent, busiest | across-node sent, mean | across-node recv, busiest "
             "| intra-node sent, mean | step s (min/median/max) | DGC state per rank (max) |",
             "|---|---|---|---|---|---|---|"]
    rows = {}
    for label, kind, rs in (("dense hierarchical", "dense", "dense"), ("node-level DGC 1 % (zen)", "dgc", "zen")):
        res = node_run(N, L, numel, a.steps, kind, rs)
        per_step = [max(r["times"][s] for r in res) for s in range(1, a.steps)] or [max(r["times"][0] for r in res)]
        sent = [r["inter_sent"] for r in res]
        rows[label] = (max(sent), statistics.mean(sent))
        lines.append(f"| {label} | {fmt(max(sent))} | {fmt(statistics.mean(sent))} | "
                     f"{fmt(max(r['inter_recv'] for r in res))} | {fmt(statistics.mean(r['intra_sent'] for r in res))} | "
                     f"{min(per_step):.3f} / {statistics.median(per_step):.3f} / {max(per_step):.3f} | "
                     f"{fmt(max(r['state'] for r in res)) if kind == 'dgc' else '—'} |")
        print(lines[-1], flush=True)
    (d_max, d_mean), (z_max, z_mean) = rows.values()
    lines += ["", f"Across-node bytes, dense hierarchical / node-level DGC 1 %: busiest rank **{d_max / z_max:.1f}×**, "
                  f"mean **{d_mean / z_mean:.1f}×** fewer (target ≥ 20×).", ""]
    # DGC state per rank: flat vs node-level, at L = --local and L = 2 (same n).
    lines += ["DGC state per rank (every tensor of the Synchronizer's state_dict), "
              f"bucket of P = {numel:,} DGC elements:", "",
              "| n | L | flat, per rank (max) | node-level, per rank (max) | flat / node | bytes per element of P, node |",
              "|---|---|---|---|---|---|"]
    for n_nodes, l_size in sorted({(N, L), (N * L // 2, 2)}):
        n = n_nodes * l_size
        flat = max(flat_state(n, numel, 2))
        node = max(r["state"] for r in node_run(n_nodes, l_size, numel, 2, "dgc", "zen"))
        lines.append(f"| {n} | {l_size} | {fmt(flat)} ({flat / numel:.2f} B/elem) | {fmt(node)} | {flat / node:.2f}× | "
                     f"{node / numel:.3f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# Node-level reduce-scatter: across-node bytes and DGC state (SimWorld)\n\n"
                    + "\n\n".join(__doc__.split("\n\n")[2:5]) + "\n\n" + text)


if __name__ == "__main__":
    main()
