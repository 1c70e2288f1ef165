#!/usr/bin/env python3
"""Summarize the emulated-cluster benchmarks' JSON lines as a markdown table (quick look at a run).

    python3 launch/netlab/summarize.py FILE.jsonl [more.jsonl ...] [--max-foreign F] [--bench comm|e2e]

Reads the lines ``benchmarks/cluster/bench_comm.py`` and ``benchmarks/cluster/bench_e2e.py`` append (one per
workload × scheme, or per e2e config, each with its repetitions in ``records``): min / median / max
time, the link-rate bound and its efficiency, bytes of the busiest rank (logical and on the wire),
and the machine's CPU (all = busy fraction of every core, foreign = busy minus our ranks).

``--max-foreign F`` recomputes every row from only the repetitions during which the foreign load
was <= F (on a shared machine: keep the clean repetitions); rows with none left are dropped.
The full report with speedups and plots: ``benchmarks/cluster/cluster_report.py``.
"""
import argparse
import json
import signal
import statistics

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head


def _filtered(d, max_foreign):
    recs = d.get("records") or []
    if max_foreign is not None:
        recs = [x for x in recs if x.get("foreign", 0.0) <= max_foreign]
        if not recs:
            return None
    if not recs:
        return dict(times=d.get("times", []), cpu_all=d.get("cpu_all", float("nan")),
                    foreign=d.get("foreign", float("nan")))
    return dict(times=[x.get("span", x.get("step_s")) for x in recs],
                cpu_all=statistics.median(x["cpu_all"] for x in recs),
                foreign=statistics.median(x["foreign"] for x in recs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--max-foreign", type=float, default=None)
    ap.add_argument("--bench", default=None, help="only lines of this benchmark (comm, e2e)")
    a = ap.parse_args()
    rows = []
    for p in a.files:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    rows = [d for d in rows if d.get("bench") in ("comm", "e2e") and (a.bench is None or d["bench"] == a.bench)]
    print("| bench | what | scheme | rate | n | reps | t_min s | t_med s | t_max s | bound s | eff % | "
          "MB sent | wire MB | cpu all | foreign |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in rows:
        f = _filtered(d, a.max_foreign)
        if f is None or not f["times"]:
            continue
        ts = sorted(f["times"])
        tmed = statistics.median(ts)
        bound = d.get("bound_s")
        eff = f"{100 * bound / tmed:.1f}" if bound and bound == bound else "–"
        sent = max(d["bytes_sent"]) / 1e6 if d.get("bytes_sent") else float("nan")
        wire = max(d["wire_tx"]) / 1e6 if d.get("wire_tx") else float("nan")
        what = d.get("workload") or d.get("config", "")
        print(f"| {d['bench']} | {what} | {d.get('scheme', '')} | {d.get('rate', '')} | {d.get('n', '')} | {len(ts)} | "
              f"{ts[0]:.4f} | {tmed:.4f} | {ts[-1]:.4f} | {'–' if not bound else f'{bound:.4f}'} | {eff} | "
              f"{sent:.2f} | {wire:.2f} | {f['cpu_all']:.2f} | {f['foreign']:.2f} |")


if __name__ == "__main__":
    main()
