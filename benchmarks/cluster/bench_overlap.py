"""Does the asynchronous DDP hook hide synchronization behind the backward pass? Step time, async vs blocking.

Usage (one process per emulated host)::

    launch/netlab/launch.sh -n 2 -r 100mbit -- benchmarks/cluster/bench_overlap.py --steps 12 --reps 3

A DDP model of ``--layers`` Linear(``--width``) layers (one bucket per layer), the ZEN hook with DGC
(``--density``), ``zen.async_sync`` true and false interleaved per repeat (same process, same model
size, same inputs), ``--steps`` timed steps each (after 2 untimed). Prints the median step time of
each mode per repeat and the ratio blocking / async (> 1: overlap helps). Rank 0 appends a JSON line to
``--out``. Timings on a shared machine are noisy: compare ratios within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(a) -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp import register_zen_hook

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a.width, a.width) for _ in range(a.layers)]
    results = {False: [], True: []}
    for rep in range(a.reps):
        for async_sync in ((False, True) if rep % 2 == 0 else (True, False)):
            model = torch.nn.Sequential(*[torch.nn.Sequential(l, torch.nn.Tanh()) for l in layers])
            ddp = DDP(model, bucket_cap_mb=a.width * a.width * 4 / 2**20 * 1.01)
            state = register_zen_hook(ddp, {"async_sync": async_sync, "stats": {"summary": False},
                                            "dgc": {"enabled": True, "density": a.density, "min_numel": 1024,
                                                    "warmup_steps": 0}})  # steady state: no ramp
            x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(rank))
            times = []
            for step in range(a.steps + 2):
                dist.barrier()
                t0 = time.perf_counter()
                ddp(x).square().mean().backward()
                times.append(time.perf_counter() - t0)
                ddp.zero_grad()
            state.close()
            results[async_sync].append(statistics.median(times[2:]))
    if rank == 0:
        ratio = [b / s for b, s in zip(results[False], results[True])]
        print(f"blocking step s {results[False]}\nasync step s    {results[True]}\nblocking / async {ratio}")
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(dict(bench="overlap", n=dist.get_world_size(), rate=os.environ.get("NETLAB_RATE"),
                                        layers=a.layers, width=a.width, density=a.density, batch=a.batch,
                                        blocking_s=results[False], async_s=results[True], ratio=ratio)) + "\n")
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
