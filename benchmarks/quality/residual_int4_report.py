"""The 4-bit residual against the fp32 residual, per seed, from ``bench_quality.py``'s cached runs
(benchmarks/quality/results/residual_int4.md).

For each seed: the eval loss of DGC 5 % with the fp32 residual (``dgc5``) and with the 4-bit one
(``dgc5_int4``: round to nearest; ``dgc5_int4_sr``: stochastic rounding) at equal steps, the gap in %, and
the steps a 4-bit run needs to reach the fp32 run's final eval loss (linear between evaluations; the fp32
run needs all of its steps by definition; "–": not reached), and the steps the fp32 run needs to reach the
4-bit run's final loss over the 4-bit run's steps (1.00×: equal; 0.97×: fp32 got there 3 % sooner).

Usage::

    .venv/bin/python benchmarks/quality/residual_int4_report.py --runs runs/quality --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quality_report import steps_to  # noqa: E402

VARIANTS = ("dgc5_int4", "dgc5_int4_sr")


def load(runs: str, variant: str, seed: int) -> list[list[float]] | None:
    path = os.path.join(runs, "scratch", variant, f"seed{seed}", "result.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["eval"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="runs/quality")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = ap.parse_args()
    gaps = {v: [] for v in VARIANTS}
    print("| seed | variant | eval @ 75 | eval @ 150 | eval @ 225 | eval @ 300 | gap to fp32 @ 75 / 150 / 225 / 300 "
          "| steps to fp32's final loss | fp32's steps to this run's final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        base = load(args.runs, "dgc5", seed)
        if base is None:
            continue
        at = {int(s): loss for s, loss in base}
        marks = [m for m in (75, 150, 225, 300) if m in at]
        print(f"| {seed} | dgc5 (fp32) | " + " | ".join(f"{at[m]:.4f}" for m in marks) + " | – | "
              f"{int(base[-1][0])} | – |")
        for v in VARIANTS:
            ev = load(args.runs, v, seed)
            if ev is None:
                continue
            got = {int(s): loss for s, loss in ev}
            gap = [100 * (got[m] / at[m] - 1) for m in marks]
            gaps[v].append(gap[-1])
            reach = steps_to(ev, base[-1][1])
            fp32_reach = steps_to(base, ev[-1][1])
            ratio = "–" if fp32_reach is None else f"{fp32_reach:.0f} ({fp32_reach / ev[-1][0]:.2f}×)"
            print(f"| {seed} | {v} | " + " | ".join(f"{got[m]:.4f}" for m in marks) + " | "
                  + " / ".join(f"{g:+.2f} %" for g in gap) + f" | {'–' if reach is None else f'{reach:.0f}'} | "
                  f"{ratio} |")
    print()
    for v, g in gaps.items():
        if g:
            print(f"* {v}: gap to fp32 at the last step, mean {statistics.mean(g):+.2f} %, median "
                  f"{statistics.median(g):+.2f} % [{min(g):+.2f} – {max(g):+.2f}] over {len(g)} seeds")


if __name__ == "__main__":
    main()
