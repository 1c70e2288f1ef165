"""The engine-neutral reduction path's own cost per bucket, for A/B runs of two trees (benchmarks/cluster/results/overhead.md).

What an engine calls per bucket — ``BucketReducer.reduce_`` → ``Synchronizer`` (routing, the
sparsifiers, one scheme call) — on an LLM-shaped bucket: one embedding (natural rows), ``--layers``
decoder layers of DGC matrices (q/o 640×640, k/v 160×640, gate/up/down 1728×640) and their 1-D norms
(dense) at width ``--hidden``, in SimWorld at ``--ranks`` ranks (every rank's work runs on this process, one thread). The
scheme is ``zen``; DGC at 1 %, default settings. The figures, after a warm-up step (the layout's
agreement), min/median/max over ``--reps``: the CPU time of one reduce summed over the ranks (each
rank's thread time: what the path costs, whatever the ranks' threads overlap) and its wall time (the
slowest rank's).

A/B: run it from two trees with the same compiled ops, interleaved, e.g.::

    OLD=<a folder outside the repo>; git worktree add "$OLD" <commit> && cp zen_ext/_C*.so "$OLD"/zen_ext/
    for i in 1 2 3; do
      OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_sync_path.py --tree "$OLD" --label old
      OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_sync_path.py --tree . --label new
    done
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=".", help="the source tree whose zen_ext is measured")
    ap.add_argument("--label", default="", help="a name for this run in the output")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=640,
                    help="the layers' width; small widths with many --layers make the per-slice Python work show")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    import torch

    from zen_ext import SimWorld
    from zen_ext.reduction.reducer import BucketReducer
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    torch.set_num_threads(1)
    # Step 1: the bucket layout.
    shapes = [("embed", (8000, 64), "natural")]
    for layer in range(args.layers):
        h, kv, ff = args.hidden, args.hidden // 4, args.hidden * 27 // 10
        for name, shape in (("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)),
                            ("gate", (ff, h)), ("up", (ff, h)), ("down", (h, ff))):
            shapes.append((f"l{layer}.{name}", shape, "dgc"))
        shapes += [(f"l{layer}.norm1", (h,), "dense"), (f"l{layer}.norm2", (h,), "dense")]
    slices, kinds, at = [], {}, 0
    for name, shape, kind in shapes:
        numel = 1
        for d in shape:
            numel *= d
        slices.append(GradSlice(name, at, numel, shape))
        kinds[name] = kind
        at += numel
    numel = at
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for _ in range(args.ranks):
        x = torch.randn(numel, generator=gen)
        emb = torch.zeros(8000, 64)
        emb[torch.randint(0, 8000, (512,), generator=gen)] = 1.0
        x[: 8000 * 64] = emb.reshape(-1)
        inputs.append(x)

    # Step 2: one Synchronizer and reducer per rank; every rep reduces every rank's bucket.
    dgc = {"enabled": True, "density": 0.01, "min_numel": 0}

    def fn(comm, x):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=kinds, dgc=dgc, natural={})
        red = BucketReducer(sync, cap_bytes=numel * 4, dp_size=comm.size)
        times = []
        for rep in range(args.reps + 1):
            flat = x.clone()
            c0, w0 = time.thread_time(), time.perf_counter()
            red.reduce_(flat, slices, "mean")
            red.pop_stats()
            sync.end_step()
            times.append((time.thread_time() - c0, time.perf_counter() - w0))
        return times[1:]

    # Step 3: per rep, CPU summed over the ranks' threads and wall of the slowest rank.
    per_rank = SimWorld(args.ranks).run(fn, inputs)
    cpu_ms = [1e3 * sum(r[i][0] for r in per_rank) for i in range(args.reps)]
    wall_ms = [1e3 * max(r[i][1] for r in per_rank) for i in range(args.reps)]

    def mmm(v):
        return [round(min(v), 1), round(statistics.median(v), 1), round(max(v), 1)]

    print(json.dumps({"label": args.label, "ranks": args.ranks, "numel": numel, "slices": len(slices),
                      "cpu_ms_min_med_max": mmm(cpu_ms), "wall_ms_min_med_max": mmm(wall_ms)}))


if __name__ == "__main__":
    main()
