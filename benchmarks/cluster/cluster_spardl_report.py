"""Render ``bench_rs_cluster.py``'s SparDL lines (``--schemes dense,zen,spardl,dgc_select``) as markdown tables.

Usage::

    .venv/bin/python benchmarks/cluster/cluster_spardl_report.py benchmarks/cluster/results/cluster_spardl.jsonl

Not a measurement: it reads the lines the lab runs appended. Per (collective, hosts, rate, workload) the
last run (the consecutive lines until a scheme repeats) gives one summary row: median ms of dense, ZEN +
DGC (``zen`` on the DGC entries), DGC's selection alone (``dgc_select``) and SparDL, and SparDL's speed
against ZEN + DGC (without and with DGC's selection, which SparDL's own time includes) and against dense;
then one table per run with min / median / max, the busiest rank's logical bytes, rounds, SparDL's
phases and the machine's CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import rate_bps, read_jsonl  # noqa: E402

NAMES = {"dgc1": "DGC 1 %", "dgc5": "DGC 5 %"}
ORDER = ("dense", "zen", "dgc_select", "spardl")


def runs_of(lines: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(collective, n, rate, workload) → {scheme: line} of its last run."""
    out: dict[tuple, dict[str, dict]] = {}
    current: dict[tuple, dict[str, dict]] = {}
    for r in lines:
        if r.get("workload") not in NAMES:
            continue
        key = (r.get("collective", "reduce_scatter"), r["n"], r["rate"], r["workload"])
        run = current.setdefault(key, {})
        if r["scheme"] in run:  # a scheme repeats: a new run of this key starts
            run = current[key] = {}
        run[r["scheme"]] = r
        out[key] = run
    return out


def _order(item) -> tuple:
    """Rows by collective, hosts, link rate (as a number: 100mbit before 250mbit), workload."""
    (coll, n, rate, wl), _ = item
    return coll, n, rate_bps(rate), wl


def ms(x: float) -> str:
    return f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def summary(runs: dict) -> list[str]:
    lines = ["| collective | hosts | link | workload | dense ms | ZEN + DGC ms | DGC select ms | SparDL ms | "
             "ZEN + DGC ÷ SparDL | (ZEN + select) ÷ SparDL | dense ÷ SparDL | dense ÷ ZEN + DGC | "
             "busiest-rank MB ZEN / SparDL | CPU busy / foreign |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for (coll, n, rate, wl), run in sorted(runs.items(), key=_order):
        if not all(s in run for s in ORDER):
            continue
        t = {s: run[s]["t_med"] for s in ORDER}
        cpu = [run[s]["cpu_all"] for s in ORDER]
        fgn = [run[s]["foreign"] for s in ORDER]
        lines.append(
            f"| {coll.replace('_', '-')} | {n} | {rate} | {NAMES[wl]} | {ms(t['dense'])} | {ms(t['zen'])} | "
            f"{ms(t['dgc_select'])} | {ms(t['spardl'])} | **{t['zen'] / t['spardl']:.2f}×** | "
            f"{(t['zen'] + t['dgc_select']) / t['spardl']:.2f}× | {t['dense'] / t['spardl']:.2f}× | "
            f"{t['dense'] / t['zen']:.2f}× | {run['zen']['busiest_bytes'] / 1e6:.3f} / "
            f"{run['spardl']['busiest_bytes'] / 1e6:.3f} | {min(cpu):.2f}–{max(cpu):.2f} / "
            f"{min(fgn):.2f}–{max(fgn):.2f} |")
    return lines


def details(runs: dict) -> list[str]:
    out = []
    for (coll, n, rate, wl), run in sorted(runs.items(), key=_order):
        first = next(iter(run.values()))
        out += ["", f"### {coll.replace('_', '-')}, {n} hosts, {rate}, {NAMES[wl]}", "",
                f"{first.get('utc', '?')}, commit {first.get('commit', '?')}, {first['reps']} interleaved repeats, "
                f"{first['numel']:,} elements fp32, load average {' '.join(first['loadavg'])}", "",
                "| scheme | ms min | ms median | ms max | vs dense | vs ZEN + DGC | busiest rank MB | rounds | "
                "= dense | phases (median of the slowest rank, ms) | CPU busy / foreign |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
        for s in [x for x in ORDER if x in run]:
            r = run[s]
            phases = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in sorted(r["phases"].items()))
            eq = {True: "yes", False: "**no**", None: "lossy / n.a."}[r["check_equal"]]
            vz = f"{run['zen']['t_med'] / r['t_med']:.2f}×" if "zen" in run else ""
            out.append(f"| {s} | {ms(r['t_min'])} | **{ms(r['t_med'])}** | {ms(r['t_max'])} | "
                       f"{run['dense']['t_med'] / r['t_med']:.2f}× | {vz} | {r['busiest_bytes'] / 1e6:.3f} | "
                       f"{r['rounds']} | {eq} | {phases} | {r['cpu_all']:.2f} / {r['foreign']:.2f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="JSON lines of bench_rs_cluster.py")
    a = p.parse_args(argv)
    runs = runs_of([r for path in a.results for r in read_jsonl(path)])
    print("\n".join(summary(runs) + details(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
