"""Bytes zen_ext itself holds per rank for DGC under the sparse reduce-scatter, flat against node-level,
by ``zen.dgc.residual_dtype`` (float32, bfloat16, int4), and the formula they confirm (SimWorld).

The set-up of ``bench_node_rs.py`` (its ``node_run`` and ``flat_state``): ``n = N × L`` ranks as threads,
one fp32 bucket of ``P`` elements routed to DGC (1 %, no warm-up), even owner ranges (FSDP2's chunks,
ZeRO-3's partitions), the ``zen`` reduce-scatter, two steps. The state is every tensor of the
Synchronizer's ``state_dict()`` (the residual or its 4-bit codes and block scales, the thresholds), summed
by storage, per rank; the table gives the largest rank's.

Formula, per rank: ``c · P`` flat and ``c · P / L`` node-level (DGC compresses the node's sum of the
rank's ``1/L`` of the bucket), with ``c`` = 4 (float32), 2 (bfloat16), 0.53125 (int4: half a byte a code
plus a float32 min and max per 256 elements), plus a few bytes of thresholds.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_state_memory.py --out benchmarks/memory/results/state_memory.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.comm.bench_node_rs import DGC, WIDTH, flat_state, fmt, node_run  # noqa: E402

PER_ELEMENT = {"float32": 4.0, "bfloat16": 2.0, "int4": 0.5 + 8 / 256}
"""``c`` of the formula: bytes of residual state per compressed element."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="n = N × L (the node-level rows use L = 2 and 4)")
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n = a.ranks
    numel = a.numel - a.numel % (n * WIDTH)
    lines = [f"Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_state_memory.py --ranks {n} "
             f"--numel {a.numel}`", "",
             f"n = {n} ranks, one fp32 bucket of P = {numel:,} DGC elements; DGC state per rank (largest rank).", "",
             "| residual_dtype | path | L | state per rank | bytes per element of P | formula | measured / formula |",
             "|---|---|---|---|---|---|---|"]
    for rd, c in PER_ELEMENT.items():
        dgc = {**DGC, "residual_dtype": rd}
        rows = [("flat", 1, max(flat_state(n, numel, 2, dgc)))]
        for L in (2, 4):
            if n % L == 0 and n // L > 1:
                rows.append(("node-level", L, max(r["state"] for r in node_run(n // L, L, numel, 2, "dgc", "zen", dgc))))
        for path, L, got in rows:
            want = c * numel / L
            lines.append(f"| {rd} | {path} | {L} | {fmt(got)} | {got / numel:.4f} | {c:g}·P/{L} = {fmt(want)} | "
                         f"{got / want:.4f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# DGC state per rank: flat vs node-level reduce-scatter, by residual dtype (SimWorld)\n\n"
                    + "\n\n".join(__doc__.split("\n\n")[1:3]) + "\n\n" + text)


if __name__ == "__main__":
    main()
