"""What ``auto`` adds per sync over the scheme it runs: bytes, messages, rounds and CPU per call in SimWorld.

The workload is the emulated cluster's ``synth_embedding`` (``benchmarks/cluster/bench_comm.py``: a Zipf
embedding gradient in row form, rows ``--row-width`` wide), at ``--ranks`` ranks in one process. Three
schemes, each settled before timing as ``bench_comm.py`` does (``auto`` profiled once, then run until its
choice is final): ``zen``; ``auto`` restricted to ``zen`` (``candidates=["zen"]``: what ``auto`` costs
around the same scheme); ``auto`` over every candidate at a fixed link (``--gbps``, 200 µs), which shows
what it settles on. Then ``--reps`` interleaved repeats (the order rotated each repeat). Per scheme:
every rank's CPU time of one call summed over the ranks (thread time: what the path costs) min/median,
rank 0's bytes, messages and rounds of one call (an extra collective would show there), and for
``auto`` its own bookkeeping per call and rank (``_choose`` and ``_learn``, timed alone).

SimWorld's wall times are not a network's (every rank shares this process's cores), so the choice of
the unrestricted ``auto`` here says only that it varies; the emulated cluster measures it
(``benchmarks/cluster/results/cluster_auto_rows16.md``).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_auto_overhead.py --ranks 16 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--row-width", type=int, default=256)
    ap.add_argument("--gbps", type=float, default=0.1, help="the fixed link the unrestricted auto plans for")
    args = ap.parse_args()
    import torch

    from zen_ext import SimWorld, build_scheme
    from zen_ext.analysis.workloads import zipf_embedding
    from zen_ext.planner.auto import MEASURED_RUNS, AutoScheme

    torch.set_num_threads(1)
    n = args.ranks
    grads = zipf_embedding(n, row_width=args.row_width, form="row", seed=0)
    link = dict(bandwidth_gbps=args.gbps, latency_us=200.0, profile_steps=1)
    schemes = [{"zen": build_scheme("zen"), "auto_zen": build_scheme("auto", candidates=["zen"], **link),
                "auto": build_scheme("auto", **link)} for _ in range(n)]
    outs = [torch.empty(g.dense_numel) for g in grads]
    world = SimWorld(n)

    def one(name, c, rec):
        before = c.stats.snapshot()
        t: dict = {}
        t0 = time.thread_time()
        with c.slot((name, "embedding")):  # one slot per scheme, as bench_comm.py and a Synchronizer's bucket
            schemes[c.rank][name].sync(c, grads[c.rank], key="embedding", timings=t, out=outs[c.rank])
        rec.append((time.thread_time() - t0, c.stats - before, t.get("scheme", name)))

    def run(name):
        recs = [[] for _ in range(n)]
        world.run(lambda c, _: one(name, c, recs[c.rank]), [None] * n)
        return recs

    # Settle: every scheme once, then auto until its choice is final (bench_comm.py's warm-up).
    for name in schemes[0]:
        run(name)
        if name != "zen":
            for _ in range((1 + MEASURED_RUNS) * len(schemes[0][name].candidates) + 1):
                if schemes[0][name].settled("embedding"):
                    break
                run(name)
    spent: dict[str, list[float]] = {"_choose": [], "_learn": []}
    for meth in spent:  # auto's own bookkeeping, timed alone from here on
        orig = getattr(AutoScheme, meth)

        def timed(self, *a, _orig=orig, _m=meth, **k):
            t0 = time.thread_time()
            r = _orig(self, *a, **k)
            spent[_m].append(time.thread_time() - t0)
            return r
        setattr(AutoScheme, meth, timed)
    names = list(schemes[0])
    res: dict[str, list] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            res[name].append(run(name))
    print(f"# {n} ranks, synth_embedding rows {args.row_width} wide, {args.reps} interleaved repeats")
    print("| scheme | runs | CPU per call, all ranks: min / median ms | × zen (median) | rank 0: bytes sent | messages | rounds |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(sum(r[0][0] for r in recs) for recs in res["zen"])
    for name in names:
        cpu = [sum(r[0][0] for r in recs) for recs in res[name]]
        _, st, ran = res[name][-1][0][0]
        print(f"| {name} | {ran} | {min(cpu) * 1e3:.1f} / {statistics.median(cpu) * 1e3:.1f} | "
              f"{statistics.median(cpu) / base:.3f} | {st.bytes_sent:,} | {st.msgs_sent} | {st.rounds} |")
    for m, v in spent.items():
        print(f"auto.{m}: median {statistics.median(v) * 1e6:.0f} us per call and rank (max {max(v) * 1e6:.0f} us, "
              f"{len(v)} calls)")


if __name__ == "__main__":
    main()
