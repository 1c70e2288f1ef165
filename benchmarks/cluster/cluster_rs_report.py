"""Render ``benchmarks/cluster/bench_rs_cluster.py``'s JSON lines as ``benchmarks/cluster/results/cluster_rs.md``.

Usage::

    .venv/bin/python benchmarks/cluster/cluster_rs_report.py [--results benchmarks/cluster/results/cluster_rs.jsonl ...] \\
        [--out benchmarks/cluster/results/cluster_rs.md] [--command "launch/netlab/launch.sh ..."] [--note "..."]

Not a measurement: it reads the lines a lab run appended (one per workload × scheme). A *run* is the
consecutive lines of one (tag, hosts, rate, workload) until a scheme repeats; the summary table takes
each (tag, hosts, rate, workload)'s last run, and every run gets its own table below with min / median
/ max ms per reduce-scatter, the busiest rank's logical bytes against ``dense``'s, the interface bytes,
the link bound and time / bound, the byte/round model's prediction, rounds, the exact check against
``dense``, and the machine's CPU; ``auto``'s line gives its choice, the model's pick, and its predicted
time against the measured one. ``benchmarks/cluster/bench_e2e.py``'s ZeRO-3 lines (``--e2e``, default
``benchmarks/cluster/results/cluster_e2e_zero3.jsonl`` where it exists) get a section of tokens/s against dense ZeRO-3.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import read_jsonl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOAD_NAMES = {"dgc1": "DGC 1 %", "dgc5": "DGC 5 %", "text_rows": "text rows (skewed embedding)"}
DEFAULT_COMMANDS = [  # as root, from the repository root, WORK a scratch folder (run_cluster_report.sh: /tmp/zen_cluster)
    "launch/netlab/launch.sh -n 8 -r 250mbit --timeout 590 -- benchmarks/cluster/bench_rs_cluster.py run --quiet-wait 45 "
    "--out benchmarks/cluster/results/cluster_rs.jsonl",
    "launch/netlab/launch.sh -n 16 -r 100mbit --timeout 590 -- benchmarks/cluster/bench_rs_cluster.py run --quiet-wait 45 "
    "--out benchmarks/cluster/results/cluster_rs.jsonl",
    ".venv/bin/python benchmarks/cluster/bench_e2e.py --hosts 8 --rate 250mbit --model benchmarks/cluster/configs/llama-lab16.json "
    "--configs dense_z3,zen_dgc1_z3 --reps 3 --steps 8 --quiet-wait 45 --work \"$WORK\"/e2e8_z3 "
    "--out benchmarks/cluster/results/cluster_e2e_zero3.jsonl",
    ".venv/bin/python benchmarks/cluster/cluster_rs_report.py",
]


def group_runs(recs: list[dict]) -> list[list[dict]]:
    """Consecutive lines of one (tag, n, rate, workload) until a scheme repeats: one run each."""
    runs: list[list[dict]] = []
    for r in recs:
        key = (r.get("tag", ""), r["n"], r["rate"], r["workload"])
        cur = runs[-1] if runs else None
        if cur and _key(cur[0]) == key and r["scheme"] not in {x["scheme"] for x in cur}:
            cur.append(r)
        else:
            runs.append([r])
    return runs


def _key(r: dict) -> tuple:
    return (r.get("tag", ""), r["n"], r["rate"], r["workload"])


def _ms(x) -> str:
    return "" if x is None or x != x else f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _mb(x) -> str:
    return f"{x / 1e6:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else ""


def _name(r: dict) -> str:
    return f"auto → {','.join(r['chosen'])}" if r["scheme"] == "auto" and r.get("chosen") else r["scheme"]


def summary_table(runs: list[list[dict]]) -> list[str]:
    """One row per (tag, hosts, rate, workload): each scheme's median, zen against dense and direct."""
    last: dict[tuple, list[dict]] = {}
    for run in runs:
        last[_key(run[0])] = run
    lines = ["| hosts | link | workload | dense ms | direct ms | zen ms | auto ms (chose) | zen vs dense | "
             "zen vs direct | zen time / bound | every scheme = dense |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for key in sorted(last, key=lambda k: (k[1], k[0], list(WORKLOAD_NAMES).index(k[3]) if k[3] in WORKLOAD_NAMES else 9)):
        by = {r["scheme"]: r for r in last[key]}
        med = {s: by[s]["t_med"] if s in by else None for s in ("dense", "direct", "zen", "auto")}
        auto = by.get("auto")
        auto_cell = f"{_ms(med['auto'])} ({','.join(auto['chosen'])})" if auto else ""
        zen = by.get("zen")
        tob = f"{zen['time_over_bound']:.1f}" if zen and zen.get("time_over_bound") else ""
        ok = "yes" if all(r["check_equal"] for r in by.values()) else "**no**"
        lines.append(f"| {key[1]} | {key[2]} | {WORKLOAD_NAMES.get(key[3], key[3])} | {_ms(med['dense'])} | "
                     f"{_ms(med['direct'])} | **{_ms(med['zen'])}** | {auto_cell} | "
                     f"{_ratio(med['dense'], med['zen'])} | {_ratio(med['direct'], med['zen'])} | {tob} | {ok} |")
    return lines


def run_table(run: list[dict]) -> list[str]:
    """Every scheme of one run, then auto's line."""
    r0 = run[0]
    dense = next((r for r in run if r["scheme"] == "dense"), None)
    head = (f"### {r0['n']} hosts, {r0['rate']}, {WORKLOAD_NAMES.get(r0['workload'], r0['workload'])}"
            + (f" ({r0['tag']})" if r0.get("tag") else ""))
    lines = [head, "",
             f"{r0.get('utc', '?')}, commit {r0.get('commit') or '?'}, {r0['reps']} interleaved repeats, "
             f"{r0['numel']:,} elements (row width {r0['row_width']}, {r0['dtype']}), mean density "
             f"{r0['density']:.2%}, entries per rank {min(r0['nnz']):,}–{max(r0['nnz']):,}; load average "
             f"{' '.join(r0['loadavg'])} ({r0['ncpu']} cores)", "",
             "| scheme | ms min | ms median | ms max | vs dense | busiest rank MB | dense / this (bytes) | "
             "wire MB (max sent) | link bound ms | time / bound | predicted ms | rounds | max msgs sent | "
             "= dense | CPU busy / foreign |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in run:
        tob = f"{r['time_over_bound']:.1f}" if r.get("time_over_bound") else ""
        eq = "yes" if r["check_equal"] else f"**no** (max err {r['check_max_abs_err']:.3g})"
        lines.append(
            f"| {_name(r)} | {_ms(r['t_min'])} | **{_ms(r['t_med'])}** | {_ms(r['t_max'])} | "
            f"{_ratio(dense['t_med'], r['t_med']) if dense else ''} | {_mb(r['busiest_bytes'])} | "
            f"{_ratio(dense['busiest_bytes'], r['busiest_bytes']) if dense else ''} | {_mb(max(r['wire_tx']))} | "
            f"{_ms(r['bound_s'])} | {tob} | {_ms(r.get('predicted_s'))} | {r['rounds']} | {max(r['msgs_sent'])} | "
            f"{eq} | {r['cpu_all']:.2f} / {r['foreign']:.2f} |")
    if dense and dense["busiest_bytes"] and max(dense["wire_tx"]) > 1.3 * dense["busiest_bytes"]:
        # The ring count is what NCCL's reduce-scatter sends; gloo's may send more (headers are ~5 %).
        lines += ["", f"dense's interface sent {max(dense['wire_tx']) / dense['busiest_bytes']:.2f}× its logical "
                      "(ring reduce-scatter) bytes: the collective underneath sends more than a ring, so its time "
                      "over the logical bound overstates what a ring reduce-scatter would take."]
    auto = next((r for r in run if r["scheme"] == "auto"), None)
    fixed = [r for r in run if r["scheme"] != "auto"]
    if auto and fixed:
        fastest = min(fixed, key=lambda r: r["t_med"])
        pred = auto.get("predicted_s")
        err = f" (error {100 * (pred / auto['t_med'] - 1):+.0f} %)" if pred and auto["t_med"] else ""
        agree = ("the model's pick too" if auto.get("model_choice") in auto["chosen"]
                 else f"the model picks {auto.get('model_choice')}")
        lines += ["", f"auto chose {','.join(auto['chosen'])} ({agree}): measured {_ms(auto['t_med'])} ms, "
                      f"predicted {_ms(pred)} ms{err}; fastest fixed scheme {fastest['scheme']} "
                      f"{_ms(fastest['t_med'])} ms, auto = {auto['t_med'] / fastest['t_med']:.2f}× it. "
                      f"Its reasons: {auto.get('why') or '?'}"]
    return lines + [""]


def e2e_table(rows: list[dict]) -> list[str]:
    """``benchmarks/cluster/bench_e2e.py``'s ZeRO-3 lines: tokens/s against the dense configuration of the same
    ZeRO settings (``baseline``), the latest line per (hosts, rate, config)."""
    last = {}
    for r in rows:
        last[(r["n"], r["rate"], r["config"])] = r
    lines = ["| hosts | link | config | what | runs × steps timed | tokens/s (min / med / max) | vs its dense | "
             "step s (median) | ZEN's reduction s | MB sent per step (ZEN) | dense MB per step | final loss |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (n, rate, config), r in sorted(last.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1].get("zen") is not None,
                                                                     kv[0][2])):
        vs = f"{r['vs_baseline']:.2f}× {r.get('baseline')}" if r.get("vs_baseline") else ""
        sync = f"{r['sync_s_med']:.3f}" if r.get("sync_s_med") is not None else ""
        sent = _mb(r["bytes_sent_per_step"]) if r.get("bytes_sent_per_step") and r.get("zen") else ""
        dense = _mb(r["dense_bytes_per_step"]) if r.get("dense_bytes_per_step") else ""
        lines.append(f"| {n} | {rate} | {config} | {r.get('describe', '')} | {r['reps']} × "
                     f"{r['steps_timed'] // max(1, r['reps'])} | {r['tokens_per_s_min']:.0f} / "
                     f"**{r['tokens_per_s_med']:.0f}** / {r['tokens_per_s_max']:.0f} | {vs} | {r['step_s_med']:.3f} | "
                     f"{sync} | {sent} | {dense} | {r['losses'][-1]:.4f} |")
    return lines


def render(recs: list[dict], commands: list[str] | None = None, notes: list[str] | None = None,
           e2e: list[dict] | None = None) -> str:
    """The markdown report of ``recs`` (bench_rs_cluster.py's lines, in file order) and, where given,
    ``e2e`` (bench_e2e.py's ZeRO-3 lines)."""
    runs = group_runs(recs)
    utcs = sorted(r.get("utc", "") for r in recs if r.get("utc"))
    commits = sorted({r.get("commit") for r in recs if r.get("commit")})
    loads = [float(r["loadavg"][0]) for r in recs if r.get("loadavg")]
    foreign = [r["foreign"] for r in recs]
    lines = [
        "# Sparse reduce-scatter: wall time in the emulated cluster",
        "",
        f"Measured {utcs[0] if utcs else '?'} – {utcs[-1] if utcs else '?'} (commit {', '.join(commits) or '?'}) with "
        "`benchmarks/cluster/bench_rs_cluster.py` in `launch/netlab` (one network namespace per host, tbf-shaped links, "
        f"gloo over TCP) on a {recs[0]['ncpu']}-core machine; load average at the lines' ends "
        f"{min(loads):.1f}–{max(loads):.1f}, foreign CPU share (median per scheme) "
        f"{min(foreign):.2f}–{max(foreign):.2f}. Commands:" if loads else "Commands:",
        "",
        "```bash",
        *(commands or DEFAULT_COMMANDS),
        "```",
        "",
        "One reduce-scatter of one bucket per measurement: every rank's gradient over the bucket, owner ranges "
        "even (FSDP2's chunks), the result into a preallocated `out=` shard; `dense` gets its gradient already "
        "dense. Time: first rank's start to the last rank's end, min / **median** / max over interleaved "
        "repeats. Bytes: the Communicator's logical count of the busiest rank (max of sent and received); "
        "link bound: that over the TCP goodput of one host's link; wire: the interface's own count (headers "
        "included). Predicted: `zen_ext/core/rs_auto.py`'s byte and round model on the lab's rate "
        f"(α {recs[0].get('latency_us', 50):g} µs). "
        "`= dense`: the shard equals the dense reduce-scatter's exactly on every rank (integer-valued inputs). "
        "Workloads as `benchmarks/comm/bench_reduce_scatter.py` (its bytes in SimWorld: "
        "[reduce_scatter.md](../../comm/results/reduce_scatter.md)).",
        "",
        *[p + "\n" for p in (notes or [])],
        "## Summary (median ms per reduce-scatter)",
        "",
        *summary_table(runs),
        "",
        "## Every run",
        "",
    ]
    for run in runs:
        lines += run_table(run)
    if e2e:
        lines += ["## ZeRO-3 end to end (tokens/s)", "",
                  "`benchmarks/cluster/bench_e2e.py`: `recipes/finetune_llm.py` on the lab, the ZeRO-3 configurations "
                  "(`configs/demo_ds_zero3.json`'s `zero_optimization`); tokens/s from rank 0's step times after "
                  "the warm-up steps, the median per run, min / **median** / max over interleaved runs. "
                  "MB per step: ZEN's statistics (its reduce-scatter's bytes sent, and the dense reduce-scatter's "
                  "for the same buckets); parameter all-gathers are DeepSpeed's and not counted.", "",
                  *e2e_table(e2e), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", nargs="+", default=[os.path.join(ROOT, "benchmarks/cluster/results/cluster_rs.jsonl")])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/cluster/results/cluster_rs.md"))
    p.add_argument("--e2e", nargs="*", default=[os.path.join(ROOT, "benchmarks/cluster/results/cluster_e2e_zero3.jsonl")],
                   help="bench_e2e.py JSON lines whose ZeRO-3 lines get their own section (missing files: none)")
    p.add_argument("--command", action="append", help="a command that made the lines (repeatable; shown verbatim)")
    p.add_argument("--note", action="append", help="a paragraph about the run, e.g. the machine's load (repeatable)")
    a = p.parse_args(argv)
    recs = [r for path in a.results for r in read_jsonl(path) if r.get("bench") == "rs"]
    if not recs:
        raise SystemExit(f"--results ({a.results}) holds no benchmarks/cluster/bench_rs_cluster.py lines")
    with open(a.out, "w") as f:
        e2e = [r for path in a.e2e for r in read_jsonl(path) if r.get("bench") == "e2e"
               and (r.get("ds_config") or {}).get("zero_optimization", {}).get("stage") == 3]
        f.write(render(recs, a.command, a.note, e2e))
    print(f"wrote {a.out} ({len(recs)} lines, {len(group_runs(recs))} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
