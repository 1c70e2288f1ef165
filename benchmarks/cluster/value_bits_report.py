"""Sync time with ``zen.dgc.value_bits`` (8 / 4 bits) against fp32 values, on the emulated cluster.

Usage (root: the lab; the traces as ``run_cluster_report.sh``'s ``traces`` stage records them)::

    # 1. per lab size: ZEN with fp32, 8-bit and 4-bit values (and dense) on the same replayed gradients
    launch/netlab/launch.sh -n 16 -r 100mbit -- benchmarks/cluster/bench_comm.py run \
        --workload trace_dgc1=$WORK/traces16/dgc1 --workload trace_dgc5=$WORK/traces16/dgc5 \
        --schemes dense,zen,zen_v8,zen_v4 --reps 5 --tag value_bits_b16 \
        --out benchmarks/cluster/results/cluster_value_bits.jsonl
    launch/netlab/launch.sh -n 8 -r 250mbit -- ...   # the same at 8 hosts
    # 2. end to end: the recipe's tokens/s, fp32 against 4-bit values, at each size
    .venv/bin/python benchmarks/cluster/bench_e2e.py --hosts 8 --rate 250mbit \
        --model benchmarks/cluster/configs/llama-lab16.json --configs dense,zen_dgc1,zen_dgc1_v4 --reps 3 --steps 8 \
        --out benchmarks/cluster/results/cluster_value_bits_e2e.jsonl
    .venv/bin/python benchmarks/cluster/bench_e2e.py --hosts 16 --rate 100mbit ...   # the same at 16 hosts
    # 3. the report (``--e2e`` adds step 2's tables): every rank's compute replayed alone, then the tables
    .venv/bin/python benchmarks/cluster/value_bits_report.py --comm benchmarks/cluster/results/cluster_value_bits.jsonl \
        --tag value_bits_b16 --workload trace_dgc1=$WORK/traces16/dgc1 --workload trace_dgc5=$WORK/traces16/dgc5 \
        --e2e benchmarks/cluster/results/cluster_value_bits_e2e.jsonl --out benchmarks/cluster/results/value_bits_time.md

(The records tagged ``value_bits`` are the first measurement, 4-bit blocks of 128 and the pull in hash order:
``docs/results/value_bits_history/value_bits_time_b128.md``.)

The lab puts 8–16 ranks on this machine's 2 cores, so a lab sync also waits for the other ranks'
compute: the 4-bit variant's quantize and decode run on shared cores. Three figures per row, so that
neither hides the other:

1. **lab**: the measured sync (first rank's start to last rank's end), min/median/max over the repeats,
   with the machine's CPU busy fraction and the share of other programs during it;
2. **link bound**: the busiest rank's bytes on the wire over the link's goodput (what the sync costs
   where compute is free);
3. **per host**: link bound + the slowest rank's compute of one sync replayed alone
   (``bench_overhead.measure``: its CPU time, median over repeats), as it would run with a core of its
   own: a sequential model (no overlap of decode with the wire), so it charges fp32 ZEN for the decode
   it overlaps in practice.

Ratios are fp32 ZEN's figure over the row's (above 1: faster than fp32 values). Target (the issue's
"done when"): ≥ 1.8× faster sync with 4 bits at 16 hosts × 100 Mbit/s, or the link-bound ratio that caps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_comm import LOW_BIT, load_workload  # noqa: E402
from bench_overhead import measure  # noqa: E402
from cluster_common import read_jsonl  # noqa: E402

VARIANTS = ("zen", *LOW_BIT)
LABEL = {"dense": "dense all-reduce", "zen": "ZEN, fp32 values", "zen_v8": "ZEN, 8-bit values",
         "zen_v4": "ZEN, 4-bit values"}


def compute_alone(specs: list[str], sizes: list[int], reps: int) -> dict:
    """(workload, n, variant) → the slowest rank's CPU seconds of one sync replayed alone (median)."""
    out = {}
    for spec in specs:
        label, _, step = load_workload(spec)
        for n in sizes:
            for v in VARIANTS:
                t0 = time.perf_counter()
                ph = measure(v, step, n, reps, use_out=True)
                out[(label, n, v)] = ph["cpu_total_s"][1]
                print(f"compute alone: {label} n={n} {v}: {1e3 * out[(label, n, v)]:.1f} ms CPU "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return out


def e2e_lines(recs: list[dict]) -> list[str]:
    """End to end: the fine-tuning recipe's tokens/s on the lab (``bench_e2e.py``), 4-bit values against fp32;
    a table per lab size (hosts, rate) in the records."""
    recs = [r for r in recs if r.get("bench") == "e2e"]
    out = []
    for lab in dict.fromkeys((r["n"], r["rate"]) for r in recs):
        out += _e2e_table([r for r in recs if (r["n"], r["rate"]) == lab])
    return out


def _e2e_table(recs: list[dict]) -> list[str]:
    r0 = recs[0]
    by = {r["config"]: r for r in recs}
    out = [f"## End to end: the DeepSpeed recipe on {r0['n']} hosts × {r0['rate']}", "",
           f"`benchmarks/cluster/bench_e2e.py --hosts {r0['n']} --rate {r0['rate']} --model "
           f"{r0['model']} --configs {','.join(by)} --reps {r0['reps']} --steps {r0['steps']}` (ZeRO-0, DGC 1 % "
           "without warm-up, one rank per host, all of them on this machine's 2 cores: the ranks' forward, "
           "backward and optimizer queue on the cores, so the step is compute-bound here and the sync's "
           "share of it small).", "",
           "| configuration | tokens/s (min/median/max of runs) | × dense | × fp32 values | sync s per step (median) | "
           "bytes sent per step | CPU busy / others |", "|---|---|---|---|---|---|---|"]
    dense, fp32 = by.get("dense"), by.get("zen_dgc1")
    for name, r in by.items():
        x_d = r["tokens_per_s_med"] / dense["tokens_per_s_med"] if dense else float("nan")
        x_f = r["tokens_per_s_med"] / fp32["tokens_per_s_med"] if fp32 else float("nan")
        sent = r.get("bytes_sent_per_step") or r.get("dense_bytes_per_step") or 0
        out.append(f"| {r['describe']} | {r['tokens_per_s_min']:.0f} / {r['tokens_per_s_med']:.0f} / "
                   f"{r['tokens_per_s_max']:.0f} | {x_d:.2f} | {x_f:.2f} | "
                   f"{r['sync_s_med'] if 'sync_s_med' in r else float('nan'):.3f} | {sent / 1e6:.3f} MB | "
                   f"{statistics.median(r['cpu_all_runs']):.2f} / {statistics.median(r['foreign_runs']):.2f} |")
    return out + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comm", required=True, help="bench_comm JSON lines with dense, zen, zen_v8, zen_v4")
    p.add_argument("--workload", action="append", required=True, help="label=path[@step], as the lab replayed")
    p.add_argument("--reps", type=int, default=5, help="repeats of the compute replay")
    p.add_argument("--tag", default="value_bits", help="the lab records' tag")
    p.add_argument("--e2e", default=None, help="bench_e2e JSON lines with zen_dgc1 and zen_dgc1_v4 (and dense)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for r in read_jsonl(a.comm) if r.get("bench") == "comm" and r.get("tag") == a.tag]
    labels = [s.split("=", 1)[0] for s in a.workload]
    rows = [r for r in rows if r["workload"] in labels]
    sizes = sorted({r["n"] for r in rows})
    cpu = compute_alone(a.workload, sizes, a.reps)

    lines = ["# Sync time with 8- and 4-bit DGC values on the emulated cluster", "",
             f"Generated by `benchmarks/cluster/value_bits_report.py` ({time.strftime('%Y-%m-%d')}; method and "
             "commands in its docstring) from the lab records in "
             f"`{os.path.relpath(a.comm)}` (`benchmarks/cluster/bench_comm.py`, schemes `zen_v8` / `zen_v4`: the "
             "replayed gradients' values and the owners' sums in 8 / 4 bits, an fp32 scale per 128 / a bf16 scale per 16 values, the owner "
             "residual kept across repeats). Per row: the busiest rank's bytes sent; **lab** = measured sync "
             "min/median/max over the repeats (the machine's CPU busy fraction and other programs' share during "
             "it: up to 16 ranks share 2 cores, so compute queues); **link bound** = those bytes over the "
             "goodput; **per host** = link bound + the slowest rank's compute of one sync replayed alone (CPU "
             f"time, median of {a.reps}), a rank per core. × fp32 = fp32 ZEN's figure over the row's.", ""]
    summary = []
    for n in sizes:
        for rate in sorted({r["rate"] for r in rows if r["n"] == n}):
            for label in labels:
                got = {r["scheme"]: r for r in rows if r["n"] == n and r["rate"] == rate and r["workload"] == label}
                if "zen" not in got:
                    continue
                z = got["zen"]
                z_host = z["bound_s"] + cpu[(label, n, "zen")]
                lines += [f"## {n} hosts × {rate}, `{label}` ({z['slices'][0]['numel']:,} elements, "
                          f"{100 * z['density']:.2f} % per rank, {z['reps']} repeats)", "",
                          "| scheme | MB sent | × fp32 | lab ms (min/median/max) | CPU busy / others | × fp32 (lab) | "
                          "link bound ms | × fp32 (bound) | compute alone ms | per host ms | × fp32 (per host) |",
                          "|---|---|---|---|---|---|---|---|---|---|---|"]
                for s in ("dense", *VARIANTS):
                    r = got.get(s)
                    if r is None:
                        continue
                    c = cpu.get((label, n, s))
                    host = r["bound_s"] + c if c is not None else None
                    mb = max(r["bytes_sent"]) / 1e6
                    lines.append(
                        f"| {LABEL[s]} | {mb:.3f} | {max(z['bytes_sent']) / 1e6 / mb:.2f} | "
                        f"{1e3 * r['t_min']:.1f} / {1e3 * r['t_med']:.1f} / {1e3 * r['t_max']:.1f} | "
                        f"{r['cpu_all']:.2f} / {r['foreign']:.2f} | {z['t_med'] / r['t_med']:.2f} | "
                        f"{1e3 * r['bound_s']:.1f} | {z['bound_s'] / r['bound_s']:.2f} | "
                        + (f"{1e3 * c:.1f} | {1e3 * host:.1f} | {z_host / host:.2f} |" if c is not None else "– | – | – |"))
                    if s == "zen_v4":
                        summary.append((n, rate, label, z["t_med"] / r["t_med"], z["bound_s"] / r["bound_s"],
                                        z_host / host))
                lines.append("")
    lines += ["## Summary: 4-bit values against fp32 values", "",
              "| lab | workload | × fp32 (lab, 2 shared cores) | × fp32 (link bound) | × fp32 (per host) |",
              "|---|---|---|---|---|"]
    for n, rate, label, lab, bound, host in summary:
        lines.append(f"| {n} × {rate} | `{label}` | {lab:.2f} | {bound:.2f} | {host:.2f} |")
    med = statistics.median(h for *_, h in summary) if summary else float("nan")
    lines += ["", f"Median per-host ratio over the rows: {med:.2f}×.", ""]
    if a.e2e:
        lines += e2e_lines(read_jsonl(a.e2e))
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
