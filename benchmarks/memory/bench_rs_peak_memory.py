"""Transient memory of one sharded gradient reduction per rank, zen_ext's reduce-scatter alone (no
DeepSpeed): flat and node-level DGC, each with the fp32 and the 4-bit residual, and a dense all-reduce
for scale, on 4 gloo processes (2 emulated nodes × 2 ranks for the node-level path).

Set-up: one fp32 bucket of ``--numel`` elements (a 2-D parameter of width 768, routed to DGC 5 %, no
warm-up), even owner ranges (ZeRO-3's partitions), ``zen.bucket_cap_mb`` 128 as in
``configs/demo_ds_zero3.json``, every rank's gradient standard normal. Per step the kernel's peak
resident set is reset (``/proc/self/clear_refs``) with the gradient and the output shard already
allocated, and the peak's rise over the resident set before the call is what the reduction itself
touched: its buffers, the sparsifier's temporaries and, on the first step, its state. The table gives the
largest rank's, first step and the largest later one. It attributes the training-peak differences of
``benchmarks/memory/results/peak_memory_zero3.md`` between DeepSpeed and zen_ext.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_rs_peak_memory.py --numel 57409536 \\
        --out benchmarks/memory/results/rs_peak_memory.md
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

WIDTH = 768
MODES = ("dense_allreduce", "flat_fp32", "flat_int4", "node_fp32", "node_int4")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _bench(rank: int, world: int, mode: str, numel: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.core.rs_base import even_ranges
    from zen_ext.reduction import BucketReducer
    from zen_ext.reduction.hierarchy import build_node_sharding
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    # Step 1: the reducer of the mode (node groups: intra {0,1},{2,3}; inter {0,2},{1,3}).
    dgc = {"enabled": True, "density": 0.05, "min_numel": 0, "momentum_correction": False, "warmup_steps": 0,
           "residual_dtype": "int4" if mode.endswith("int4") else "float32"}
    node, comm = None, TorchCommunicator(None)
    if mode.startswith("node"):
        node, inter = build_node_sharding(range(world), [range(world)], 2, rank, required=True)
        comm = TorchCommunicator(inter)
    slices = [GradSlice("w", 0, numel, (numel // WIDTH, WIDTH))]
    ranges = even_ranges(numel, world)
    red = None
    if mode != "dense_allreduce":
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"w": "dgc"}, dgc=dgc, reduce_scatter="zen")
        red = BucketReducer(sync, cap_bytes=128 << 20, dp_size=world, node=node)
    lo, hi = ranges[rank]
    out = torch.empty(hi - lo)
    rises, state = [], 0
    for step in range(steps):
        # Step 2: this step's gradient, then a fresh peak, then the reduction alone.
        g = torch.randn(numel, generator=torch.Generator().manual_seed(7919 * step + rank))
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss_kib()
        if red is None:
            dist.all_reduce(g)
            out.copy_(g[lo:hi])
        else:
            red.reduce_scatter_(g, slices, ranges, "sum", out=out)
            sync.end_step()
        rises.append(max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
        del g
    if red is not None:
        sys.path.insert(0, ROOT)
        from recipes.memory_report import state_bytes

        state = state_bytes(sync.state_dict())
    return {"rises": rises, "state": state}


def main() -> None:
    from zen_ext.comm.local import run_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=57409536, help="P_dgc of configs/models/llama-h768-l8.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    numel = a.numel - a.numel % (4 * WIDTH)
    mib, bucket = 2**20, 4 * numel
    lines = [f"Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_rs_peak_memory.py --numel {a.numel} "
             f"--steps {a.steps}`", "",
             f"n = 4 gloo processes, P_dgc = {numel:,} fp32 elements ({bucket / mib:,.1f} MiB: `4·P`), "
             f"DGC 5 %, {a.steps} steps. Peak rise = the peak resident set during the call minus the resident "
             "set before it (largest rank), in MiB and in units of the gradient's size `4·P`.", "",
             "| mode | state per rank | peak rise, step 1 | peak rise, later steps (max) | later / 4·P |",
             "|---|---|---|---|---|"]
    for mode in a.modes:
        res = run_workers(_bench, 4, mode, numel, a.steps, timeout_s=1800)
        first = max(r["rises"][0] for r in res)
        later = max(max(r["rises"][1:]) for r in res) if a.steps > 1 else float("nan")
        state = max(r["state"] for r in res)
        lines.append(f"| {mode} | {state / mib:,.2f} MiB | {first / mib:,.0f} | {later / mib:,.0f} | "
                     f"{later / bucket:.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# Transient memory of one sharded reduction per rank: flat vs node-level DGC, fp32 vs int4\n\n"
                    + "\n\n".join(__doc__.split("\n\n")[1:2]) + "\n\n" + text)


if __name__ == "__main__":
    main()
