"""Bytes per rank of ``zen`` vs ``dense`` at several densities (SimWorld, real scheme code).

Usage: ``python benchmarks/comm/bench_bytes.py [--ranks 4,16] [--numel 1000000] [--out benchmarks/comm/results/bytes.md]``

Indices are uniform (every rank draws ``density·numel`` distinct indices independently), values fp32.
Reports max and mean bytes sent per rank, the pull format chosen, and the ratio to dense all-reduce.
Byte counts are deterministic, so one repeat suffices; wall time is not reported here (see
benchmarks/comm/bench_exchange.py and the emulated-cluster benchmarks for time).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from zen_ext import SimWorld, SparseGrad, build_scheme  # noqa: E402


def measure(scheme: str, n: int, numel: int, density: float, seed: int = 0, **opts) -> dict:
    g = torch.Generator().manual_seed(seed)
    k = int(density * numel)
    inputs = [SparseGrad(torch.randperm(numel, generator=g)[:k].clone(), torch.randn(k, generator=g), numel)
              for _ in range(n)]
    s = build_scheme(scheme, **opts)
    fmt: dict = {}
    world = SimWorld(n)
    world.run(lambda c, x: s.sync(c, x, timings=fmt if c.rank == 0 else None), inputs)
    sent = [st.bytes_sent for st in world.stats]
    return dict(max_sent=max(sent), mean_sent=sum(sent) / n, fmt=fmt.get("pull_format", "-"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="4,16")
    p.add_argument("--numel", type=int, default=1_000_000)
    p.add_argument("--densities", default="0.001,0.01,0.05,0.1,0.3,0.6,1.0")
    p.add_argument("--out", default="benchmarks/comm/results/bytes.md")
    a = p.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    densities = [float(x) for x in a.densities.split(",")]
    rows = []
    for n in ranks:
        for d in tqdm(densities, desc=f"n={n}"):
            dense = measure("dense", n, a.numel, d)
            for name, opts in (("zen", {}), ("zen (COO pull)", {"pull_format": "coo"})):
                r = measure("zen", n, a.numel, d, **opts)
                rows.append((n, d, name, r["max_sent"], r["mean_sent"], r["fmt"], dense["max_sent"] / r["max_sent"]))
            rows.append((n, d, "dense", dense["max_sent"], dense["mean_sent"], "-", 1.0))
    lines = [
        f"# Bytes per rank: zen vs dense all-reduce ({a.numel:,} fp32 elements, uniform indices)",
        "",
        "Regenerate: `.venv/bin/python benchmarks/comm/bench_bytes.py`. Bytes sent per rank per sync, counted by",
        "the Communicator's logical model (identical in SimWorld and on gloo). 'dense / scheme' > 1 means fewer",
        "bytes than the ring all-reduce; 'pull' is the encoding rank 0 chose for its partition.",
        "",
        "| ranks | density per rank | scheme | max sent (MB) | mean sent (MB) | pull | dense / scheme |",
        "|---:|---:|---|---:|---:|---|---:|",
    ]
    for n, d, name, mx, mean, fmt, ratio in rows:
        lines.append(f"| {n} | {d:.1%} | {name} | {mx / 1e6:.3f} | {mean / 1e6:.3f} | {fmt} | {ratio:.2f}× |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
