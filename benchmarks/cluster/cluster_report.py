"""Render the emulated-cluster report (markdown + plots) from the benchmarks' JSON lines.

Usage: ``.venv/bin/python benchmarks/cluster/cluster_report.py --results benchmarks/cluster/results`` (the last step of
``benchmarks/cluster/run_cluster_report.sh``). Reads ``cluster_comm.jsonl`` (bench_comm), ``cluster_e2e.jsonl``
(bench_e2e), ``cluster_overhead.jsonl`` (bench_overhead) and ``cluster_run.json`` (how the run went:
duration, load), writes ``cluster_report.md``, ``cluster_comm.png``, ``cluster_model.png`` and
``cluster_e2e_loss.png``. Any input that is missing leaves its section saying so.

Definitions used throughout: speedup = dense median / scheme median (ratios within one run);
"best baseline" = the fastest of the non-ZEN schemes (dense, agsparse, sparcml, omnireduce,
sparse_ps) on that workload and rate; model error = (modeled − measured) / measured of the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import read_jsonl  # noqa: E402

ZEN = ("zen", "zen_coo")
BASELINES = ("dense", "agsparse", "sparcml", "omnireduce", "sparse_ps")
FIXED = BASELINES + ZEN
ORDER = FIXED + ("auto",)
WORKLOAD_NAMES = {
    "trace_dgc1": "recorded, DGC 1 %", "trace_dgc5": "recorded, DGC 5 %", "trace_natural": "recorded, embedding rows",
    "synth_dgc1": "synthetic DGC 1 %", "synth_dgc5": "synthetic DGC 5 %", "synth_embedding": "synthetic embedding (Zipf)",
}
TARGETS = dict(comm_dgc1_vs_dense=8.0, comm_vs_best_baseline=1.5, e2e_vs_dense=2.5, hash_over_saved=0.05)
# The cluster targets: the cost model's error, auto vs the best fixed scheme, ZEN past 4 hosts, end to end.
TARGETS_13 = dict(model_median_abs_err=0.25, auto_over_best_fixed=1.10, zen_vs_best_8=1.3, zen_vs_best_16=1.5,
                  e2e_dgc1_vs_dense_4=1.8)


def _rate_gbps(rate: str) -> str:
    from cluster_common import rate_bps

    return f"{rate_bps(rate) / 1e9:g} Gbit/s"


def _latest(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Keep the last row per key (a re-run appends; the newest wins)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        out[tuple(r.get(k) for k in keys)] = r
    return list(out.values())


# --- communication ----------------------------------------------------------------------------------
def _rate_key(rate: str) -> float:
    from cluster_common import rate_bps

    return rate_bps(rate)


def comm_tables(rows: list[dict]) -> tuple[list[str], dict]:
    rows = _latest(rows, ("n", "rate", "workload", "scheme"))
    lines, summary = [], {}
    labs = sorted({(r["n"], r["rate"]) for r in rows}, key=lambda x: (x[0], _rate_key(x[1])))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for n_hosts, rate in labs:
        lines += [f"### {_rate_gbps(rate)} per host, {n_hosts} hosts", ""]
        for w in workloads:
            rs = {r["scheme"]: r for r in rows if r["rate"] == rate and r["n"] == n_hosts and r["workload"] == w}
            if not rs:
                continue
            any_r = next(iter(rs.values()))
            nnz = [sum(s["nnz"][k] for s in any_r["slices"]) for k in range(any_r["n"])]
            numel = sum(s["numel"] * s["row_width"] for s in any_r["slices"])
            lines.append(f"**{WORKLOAD_NAMES.get(w, w)}** (`{w}`): {len(any_r['slices'])} slice(s), "
                         f"{numel / 1e6:.1f} M elements, entries per rank {min(nnz):,}–{max(nnz):,} "
                         f"(density {100 * any_r['density']:.2f} % of the index space)")
            lines.append("")
            lines.append("| scheme | t_min s | t_med s | t_max s | vs dense | vs best baseline | max MB sent | "
                         "wire MB | link eff. | modeled s | model err | predicted s | cpu / foreign | max err |")
            lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            dense = rs.get("dense")
            base = [rs[b] for b in BASELINES if b in rs]
            best = min(base, key=lambda r: r["t_med"]) if base else None
            for name in ORDER:
                r = rs.get(name)
                if r is None:
                    continue
                vs_dense = dense["t_med"] / r["t_med"] if dense else float("nan")
                vs_best = best["t_med"] / r["t_med"] if best else float("nan")
                mod, pred = r.get("modeled_s"), r.get("predicted_s")
                err = (mod - r["t_med"]) / r["t_med"] if mod is not None else float("nan")
                eff = f"{100 * r['eff']:.0f} %" if r.get("eff") else "–"
                label = name if name != "auto" else f"auto → {'/'.join(r.get('chosen') or ['?'])}"
                lines.append(
                    f"| {label} | {r['t_min']:.4f} | {r['t_med']:.4f} | {r['t_max']:.4f} | {vs_dense:.1f}× | "
                    f"{vs_best:.2f}×{' (' + best['scheme'] + ')' if name in ZEN and best else ''} | "
                    f"{max(r['bytes_sent']) / 1e6:.2f} | {max(r['wire_tx']) / 1e6:.2f} | {eff} | "
                    f"{'–' if mod is None else f'{mod:.4f}'} | {100 * err:+.0f} % | "
                    f"{'–' if pred is None else f'{pred:.4f}'} | {r['cpu_all']:.2f} / {r['foreign']:.2f} | "
                    f"{r['check_max_abs_err']:.1g} |")
                if name in ZEN and dense and best:
                    summary[(n_hosts, rate, w, name)] = dict(
                        vs_dense=vs_dense, vs_best=vs_best, best=best["scheme"], t_med=r["t_med"],
                        phases=r.get("phases", {}), dense_t=dense["t_med"], bound=r["bound_s"])
            fixed = [rs[s] for s in FIXED if s in rs]
            if "auto" in rs and fixed:
                best_fixed = min(fixed, key=lambda r: r["t_med"])
                summary[(n_hosts, rate, w, "auto")] = dict(
                    over_best=rs["auto"]["t_med"] / best_fixed["t_med"], best=best_fixed["scheme"],
                    chosen=rs["auto"].get("chosen") or [])
            if rs.get("auto", {}).get("explain"):
                lines += ["", "auto's reasons (rank 0): " + rs["auto"]["explain"].replace("\n", "; ")]
            if "zen" in rs:
                ph = rs["zen"].get("phases", {})
                if ph:
                    lines += ["", "zen phases in the lab (median over repeats of the slowest rank): " + ", ".join(
                        f"{k[:-2]} {1e3 * v:.1f} ms" for k, v in ph.items() if k.endswith("_s"))
                        + f"; link-rate bound of its bytes {1e3 * rs['zen']['bound_s']:.1f} ms."]
            lines.append("")
    return lines, summary


def comm_plots(rows: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _latest(rows, ("n", "rate", "workload", "scheme"))
    labs = sorted({(r["n"], r["rate"]) for r in rows}, key=lambda x: (x[0], _rate_key(x[1])))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(labs), 1, figsize=(11, 3.6 * len(labs)), squeeze=False)
    width = 0.8 / len(ORDER)
    for ax, (n_hosts, rate) in zip(axes[:, 0], labs):
        for i, name in enumerate(ORDER):
            xs, ys, lo, hi = [], [], [], []
            for j, w in enumerate(workloads):
                r = next((r for r in rows if r["rate"] == rate and r["n"] == n_hosts and r["workload"] == w
                          and r["scheme"] == name), None)
                if r:
                    xs.append(j + (i - len(ORDER) / 2 + 0.5) * width)
                    ys.append(r["t_med"])
                    lo.append(r["t_med"] - r["t_min"])
                    hi.append(r["t_max"] - r["t_med"])
            ax.bar(xs, ys, width, yerr=[lo, hi], label=name, capsize=1.5,
                   hatch="//" if name in ZEN else None, edgecolor="black", linewidth=0.3)
        ax.set_yscale("log")
        ax.set_xticks(range(len(workloads)), [WORKLOAD_NAMES.get(w, w) for w in workloads], fontsize=8)
        ax.set_ylabel("time per sync (s)")
        ax.set_title(f"{n_hosts} emulated hosts, {_rate_gbps(rate)} per host: median, min–max over repeats")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=len(ORDER), fontsize=7, loc="upper left", bbox_to_anchor=(0, 1.25))
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "cluster_comm.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 5))
    pts = [(r["modeled_s"], r["t_med"], r["scheme"]) for r in rows if r.get("modeled_s")]
    for name in ORDER:
        p = [(m, t) for m, t, s in pts if s == name]
        if p:
            ax.scatter([m for m, _ in p], [t for _, t in p], label=name, s=18)
    if pts:
        lo, hi = min(min(m, t) for m, t, _ in pts), max(max(m, t) for m, t, _ in pts)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = modeled")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("α–β model of the measured traffic (s)")
    ax.set_ylabel("measured median (s)")
    ax.set_title("cost model vs emulated cluster")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "cluster_model.png"), dpi=110)
    plt.close(fig)
    return ["cluster_comm.png", "cluster_model.png"]


def model_error_summary(rows: list[dict]) -> list[str]:
    rows = [r for r in _latest(rows, ("n", "rate", "workload", "scheme")) if r.get("modeled_s")]
    if not rows:
        return []
    dense = [r for r in rows if r["scheme"] == "dense"]
    sparse = [r for r in rows if r["scheme"] != "dense"]
    out = []
    for label, rs in (("dense all-reduce (bandwidth-dominated)", dense), ("sparse schemes", sparse)):
        if rs:
            errs = [abs(r["modeled_s"] - r["t_med"]) / r["t_med"] for r in rs]
            out.append(f"- {label}: {len(rs)} points, median |error| {100 * statistics.median(errs):.0f} %, "
                       f"max {100 * max(errs):.0f} %")
    # What α would make the model fit: the time beyond the bandwidth term, per message of the busiest rank.
    alphas = []
    for r in rows:
        if r["scheme"] != "dense" and r.get("goodput_Bps"):
            bw = max(max(s, v) for s, v in zip(r["bytes_sent"], r["bytes_recv"])) / r["goodput_Bps"]
            msgs = max(max(s, v) for s, v in zip(r["msgs_sent"], r["msgs_recv"]))
            if msgs:
                alphas.append((r["t_med"] - bw) / msgs)
    if alphas:
        out.append(f"- the sparse schemes' time beyond their bandwidth term is {1e3 * statistics.median(alphas):.2f} ms "
                   f"per message (median; α of the model: {rows[0].get('latency_us', 50):g} µs): CPU work and "
                   f"scheduling of 4 ranks on {rows[0].get('ncpu', '?')} cores, which the α–β model does not "
                   f"describe (section 3)")
    return out


def scale_section(rows: list[dict]) -> list[str]:
    """Bytes of the busiest rank at more hosts (cost model), and zen's ratio to dense and the best baseline."""
    rows = _latest(rows, ("workload", "n"))
    if not rows:
        return ["No scaling rows (cluster_scale.jsonl missing)."]
    lines = ["| workload | hosts | γⁿ | " + " | ".join(ORDER) + " | dense / zen | best baseline / zen |",
             "|---|---:|---:|" + "---:|" * len(ORDER) + "---:|---:|"]
    for r in rows:
        b = r["max_bytes_sent"]
        base = min((b[s], s) for s in BASELINES if s in b)
        lines.append(f"| {WORKLOAD_NAMES.get(r['workload'], r['workload'])} | {r['n']} | {r['gamma_n']:.2f} | "
                     + " | ".join(f"{b[s] / 1e6:.2f}" if s in b else "–" for s in ORDER)
                     + f" | {b['dense'] / b['zen']:.1f}× | {base[0] / b['zen']:.2f}× ({base[1]}) |")
    return lines


# --- end to end --------------------------------------------------------------------------------------
def _e2e_reading(rows: list[dict]) -> list[str]:
    """Per lab size, what bounds ZEN's end-to-end ratio: the rest of the step caps it at
    dense step / rest, and ZEN's own sync (DGC included) against the link-rate time of its bytes."""
    out = []
    for r in rows:
        if r["config"] != "zen_dgc1" or r.get("sync_s_med") is None:
            continue
        dense = next((d for d in rows if d["config"] == "dense" and d["rate"] == r["rate"]
                      and d.get("n", 4) == r.get("n", 4)), None)
        if dense is None:
            continue
        rest = r["step_s_med"] - r["sync_s_med"]
        # The link rate as dense's own: its all-reduce bound over the bytes it sends per step.
        link_s = (r["bytes_sent_per_step"] * dense["dense_allreduce_bound_s"] / dense["bytes_sent_per_step"]
                  if r.get("bytes_sent_per_step") and dense.get("dense_allreduce_bound_s")
                  and dense.get("bytes_sent_per_step") else None)
        dgc = r.get("compress_s_med")
        out.append(
            f"- {r.get('n', 4)} hosts, `zen_dgc1`: {dense['step_s_med'] / r['step_s_med']:.2f}× dense. The rest of "
            f"the step ({rest:.3f} s, the ranks' own compute on shared cores) alone caps the ratio at "
            f"{dense['step_s_med'] / rest:.2f}×; ZEN's sync is {r['sync_s_med']:.3f} s"
            + (f", of which DGC {dgc:.3f} s" if dgc is not None else "")
            + (f", against {1e3 * link_s:.0f} ms for its bytes at the link rate" if link_s else "")
            + " (CPU-bound: the sync's computation runs on the same shared cores).")
    return [""] + out if out else []


def e2e_section(rows: list[dict], out_dir: str) -> tuple[list[str], dict]:
    rows = _latest(rows, ("n", "rate", "config"))
    if not rows:
        return ["No end-to-end results (cluster_e2e.jsonl missing)."], {}
    lines = ["| hosts | config | gradient sync | runs × steps timed | tokens/s (min / med / max over runs) | vs dense | "
             "step s | gradient sync s | of which DGC s | rest of the step s | MB sent per step | final loss |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = {}
    for n_hosts, rate in sorted({(r.get("n", 4), r["rate"]) for r in rows}, key=lambda x: (x[0], _rate_key(x[1]))):
        rs = [r for r in rows if r["rate"] == rate and r.get("n", 4) == n_hosts]
        dense = next((r for r in rs if r["config"] == "dense"), None)
        for r in rs:
            vs = r["tokens_per_s_med"] / dense["tokens_per_s_med"] if dense else None
            summary[(n_hosts, rate, r["config"])] = dict(vs_dense=vs, tokens_per_s_med=r["tokens_per_s_med"],
                                                         step_s_med=r["step_s_med"])
            # ZEN's reduction time is measured; dense's all-reduce is taken at its link-rate bound.
            sync = r.get("sync_s_med") if r["config"] != "dense" else r.get("dense_allreduce_bound_s")
            rest = r["step_s_med"] - sync if sync is not None else None
            mb = r.get("bytes_sent_per_step")
            dgc = r.get("compress_s_med") if (r.get("zen") or {}).get("dgc", {}).get("enabled") else None
            lines.append(
                f"| {n_hosts} | {r['config']} | {r.get('describe', '')} | {r['reps']} × {r['steps_timed'] // max(1, r['reps'])} | "
                f"{r['tokens_per_s_min']:.0f} / {r['tokens_per_s_med']:.0f} / {r['tokens_per_s_max']:.0f} | "
                f"{'–' if vs is None else f'{vs:.2f}×'} | {r['step_s_med']:.3f} | "
                f"{'–' if sync is None else f'{sync:.3f}'}{' (bound)' if r['config'] == 'dense' and sync else ''} | "
                f"{'–' if dgc is None else f'{dgc:.3f}'} | {'–' if rest is None else f'{rest:.3f}'} | "
                f"{'–' if mb is None else f'{mb / 1e6:.2f}'} | {r['losses'][-1]:.4f} |")
    lines += ["", "`step s` = tokens per step / median tokens/s; `gradient sync s`: ZEN's time inside DeepSpeed's "
              "gradient reduction (its own statistics: DGC compression, hashing and all communication), for dense "
              "the link-rate bound of DeepSpeed's ring all-reduce; `rest of the step` = step − sync: forward, "
              "backward and optimizer, with 4 ranks sharing the machine's cores."]
    lines += _e2e_reading(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        styles = ["-o", "--s", ":^", "-.v", "-x"]
        for i, r in enumerate(rows):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], styles[i % len(styles)], markersize=4,
                    label=f"{r['config']} ({r.get('n', 4)} hosts, {_rate_gbps(r['rate'])})")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean over ranks)")
        ax.set_title("Fine-tuning on emulated hosts: same steps, same data")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "cluster_e2e_loss.png"), dpi=110)
        plt.close(fig)
        lines += ["", "![loss curves](cluster_e2e_loss.png)"]
    except ImportError:
        pass
    return lines, summary


# --- overhead -------------------------------------------------------------------------------------------
def overhead_section(rows: list[dict]) -> tuple[list[str], dict]:
    rows = _latest(rows, ("workload", "scheme"))
    if not rows:
        return ["No overhead results (cluster_overhead.jsonl missing)."], {}
    lines = ["| workload | scheme | hash ms | encode ms | aggregate ms | decode ms | total ms | "
             "time saved vs dense (rate: ms) | hash / saved | total / saved |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    summary = {}
    for r in rows:
        saved = "; ".join(f"{_rate_gbps(k)}: {round(1e3 * v['saved_s']):d}" for k, v in r["vs_lab"].items())
        hs = " / ".join(f"{100 * v['hash_over_saved']:.2f} %" for v in r["vs_lab"].values()
                        if v["hash_over_saved"] is not None) or "–"
        ts = " / ".join(f"{100 * v['overhead_over_saved']:.1f} %" for v in r["vs_lab"].values()
                        if v["overhead_over_saved"] is not None) or "–"
        lines.append(f"| {WORKLOAD_NAMES.get(r['workload'], r['workload'])} | {r['scheme']} | {1e3 * r['hash_s']:.2f} | "
                     f"{1e3 * r['encode_s']:.2f} | {1e3 * r['aggregate_s']:.2f} | {1e3 * r['decode_s']:.2f} | "
                     f"{1e3 * r['compute_s']:.2f} | {saved or '–'} | {hs} | {ts} |")
        for rate, v in r["vs_lab"].items():
            summary[(rate, r["workload"], r["scheme"])] = v
    dps = {r["workload"]: r["decode_profile"] for r in rows if "dense_result_s" in (r.get("decode_profile") or {})}
    if dps:
        lines += ["", "zen's decode, piece by piece (one rank, one core; the same building blocks zen uses):", "",
                  "| workload | union / index space | dense result ms | hash bitmaps ms | P⁻¹ of the union ms "
                  "(Feistel domain / numel) | scatter ms | P⁻¹ as a gather from an inverse table ms (table MiB) |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for w, d in dps.items():
            lines.append(f"| {WORKLOAD_NAMES.get(w, w)} | {d['union']:,} / {d['numel']:,} | {1e3 * d['dense_result_s']:.1f} | "
                         f"{1e3 * d['bitmap_decode_s']:.1f} | {1e3 * d['unpermute_s']:.1f} ({d['cycle_walk_domain']:.2f}) | "
                         f"{1e3 * d['scatter_s']:.1f} | {1e3 * d['table_gather_s']:.1f} ({d['table_bytes'] / 2**20:.0f}) |")
    return lines, summary


def breakdown_section(comm_rows: list[dict], over_rows: list[dict]) -> list[str]:
    """Where zen's time goes, per workload and rate: wire bound, compute alone, compute in the lab."""
    # bench_overhead replays the 4-host workloads: compare with the 4-host lab only.
    comm_rows = _latest([r for r in comm_rows if r["n"] == 4], ("rate", "workload", "scheme"))
    over = {(r["workload"], r["scheme"]): r for r in _latest(over_rows, ("workload", "scheme"))}
    lines = ["| rate | workload | dense s | zen s | measured speedup | bytes dense / zen | zen wire bound ms | "
             "zen compute in the lab ms | zen compute alone ms | estimate: one core per host | estimate: free compute |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in comm_rows:
        if r["scheme"] != "zen":
            continue
        dense = next((d for d in comm_rows if d["scheme"] == "dense" and d["rate"] == r["rate"]
                      and d["workload"] == r["workload"]), None)
        o = over.get((r["workload"], "zen"))
        if dense is None or not r.get("bound_s"):
            continue
        ph = r.get("phases", {})
        lab_compute = sum(ph.get(k, 0.0) for k in ("hash_s", "aggregate_s", "decode_s"))
        alone = o["compute_s"] if o else None
        one_core = dense["t_med"] / (alone + r["bound_s"]) if alone is not None else None
        lines.append(
            f"| {_rate_gbps(r['rate'])} | {WORKLOAD_NAMES.get(r['workload'], r['workload'])} | {dense['t_med']:.3f} | "
            f"{r['t_med']:.3f} | {dense['t_med'] / r['t_med']:.1f}× | {max(dense['bytes_sent']) / max(r['bytes_sent']):.0f}× | "
            f"{1e3 * r['bound_s']:.1f} | {1e3 * lab_compute:.1f} (+ push/pull) | "
            f"{'–' if alone is None else f'{1e3 * alone:.1f}'} | {'–' if one_core is None else f'{one_core:.1f}×'} | "
            f"{dense['t_med'] / r['bound_s']:.0f}× |")
    lines += ["", "`zen compute in the lab`: hash + aggregate + decode phases of the slowest rank while 4 ranks "
              "share the cores (push/pull also hold packing and waiting); `alone`: the same sync replayed on one "
              "core with the network removed (section 3, all phases). The two estimates are models, not "
              "measurements: `one core per host` = dense median / (compute alone + zen's wire bound), what "
              "dedicated CPU hosts would see; `free compute` = dense median / wire bound, the ceiling when hashing "
              "and decoding cost nothing (a GPU does the 214 M-element hashing in ~6 ms in the paper)."]
    return lines


# --- targets ---------------------------------------------------------------------------------------------
def targets_13_section(comm: dict, e2e: dict, model: dict) -> list[str]:
    """The cluster targets, each with met/missed and the measured ratio to the target."""
    lines = ["| target | measured | met? | measured / target |", "|---|---|---|---:|"]

    def row(name, got, target, detail, larger_is_better=True):
        if got is None:
            lines.append(f"| {name} | not measured | – | – |")
            return
        ok = got >= target if larger_is_better else got <= target
        lines.append(f"| {name} | {detail} | {'met' if ok else 'missed'} | {got / target:.2f} |")

    err = (model.get("median_abs_err") or {}).get("refined")
    row(f"cost model median abs. error ≤ {TARGETS_13['model_median_abs_err']:.0%}, sparse runs "
        f"({model.get('runs', 0)} runs; α–β alone "
        f"{(model.get('median_abs_err') or {}).get('alpha_beta') or float('nan'):.0%})",
        err, TARGETS_13["model_median_abs_err"], "–" if err is None else f"{err:.0%}", larger_is_better=False)
    for (n, rate, w, name), v in sorted(comm.items(), key=lambda kv: (kv[0][0], _rate_key(kv[0][1]), kv[0][2])):
        if name == "auto":
            row(f"`auto` within 10 % of the best fixed scheme, {n} hosts, {_rate_gbps(rate)}, `{w}`",
                v["over_best"], TARGETS_13["auto_over_best_fixed"],
                f"{v['over_best']:.2f}× the time of {v['best']} (ran {'/'.join(v['chosen']) or '?'})",
                larger_is_better=False)
    for (n, rate, w, name), v in sorted(comm.items(), key=lambda kv: (kv[0][0], _rate_key(kv[0][1]), kv[0][2])):
        if name == "zen" and n in (8, 16) and w in ("trace_dgc1", "synth_dgc1"):
            t = TARGETS_13["zen_vs_best_8" if n == 8 else "zen_vs_best_16"]
            row(f"ZEN ≥ {t:g}× the best baseline, DGC 1 %, {n} hosts, {_rate_gbps(rate)}, `{w}`", v["vs_best"], t,
                f"{v['vs_best']:.2f}× (best: {v['best']})")
    for (n, rate, cfg), v in sorted(e2e.items()):
        if cfg == "zen_dgc1" and v.get("vs_dense"):
            if n == 4 and rate == "1gbit":
                row(f"end to end, ZEN DGC 1 % ≥ {TARGETS_13['e2e_dgc1_vs_dense_4']:g}× dense tokens/s, 4 hosts, 1 Gbit/s",
                    v["vs_dense"], TARGETS_13["e2e_dgc1_vs_dense_4"], f"{v['vs_dense']:.2f}×")
            else:
                lines.append(f"| end to end, ZEN DGC 1 % vs dense, {n} hosts, {_rate_gbps(rate)} (reported) | "
                             f"{v['vs_dense']:.2f}× | – | – |")
    return lines


def targets_section(comm: dict, e2e: dict, over: dict) -> list[str]:
    lines = ["| target | measured | met? |", "|---|---|---|"]

    def row(name, target, got, detail):
        if got is None:
            lines.append(f"| {name} (≥ {target}) | not measured | – |")
            return
        ok = got >= target
        gap = "" if ok else f" — short by {100 * (1 - got / target):.0f} %"
        lines.append(f"| {name} | {detail} | {'yes' if ok else 'no' + gap} |")

    # The original targets are stated for 4 hosts (the scaling targets are the first table's).
    four = {k[1:]: v for k, v in comm.items() if k[0] == 4}
    for rate in sorted({k[0] for k in four}, key=_rate_key):
        for w in ("trace_dgc1", "synth_dgc1"):
            c = four.get((rate, w, "zen"))
            if c:
                row(f"comm. speedup over dense ≥ {TARGETS['comm_dgc1_vs_dense']:g}×, DGC 1 %, {_rate_gbps(rate)}, `{w}`",
                    TARGETS["comm_dgc1_vs_dense"], c["vs_dense"], f"{c['vs_dense']:.1f}×")
        for w in dict.fromkeys(k[1] for k in four if k[0] == rate):
            c = four.get((rate, w, "zen"))
            if c:
                row(f"≥ {TARGETS['comm_vs_best_baseline']:g}× over the best baseline, {_rate_gbps(rate)}, `{w}`",
                    TARGETS["comm_vs_best_baseline"], c["vs_best"], f"{c['vs_best']:.2f}× (best: {c['best']})")
    for (n, rate, cfg), v in sorted(e2e.items()):
        if n == 4 and cfg != "dense" and v.get("vs_dense"):
            row(f"end-to-end ≥ {TARGETS['e2e_vs_dense']:g}× over dense, `{cfg}`, {_rate_gbps(rate)}",
                TARGETS["e2e_vs_dense"], v["vs_dense"], f"{v['vs_dense']:.2f}×")
    for (rate, w, scheme), v in sorted(over.items()):
        if scheme == "zen" and v.get("hash_over_saved") is None:
            lines.append(f"| hashing ≤ 5 % of the time saved, `{w}`, {_rate_gbps(rate)} | no time saved: zen "
                         f"{1e3 * v['scheme_s']:.0f} ms vs dense {1e3 * v['dense_s']:.0f} ms | no |")
        elif scheme == "zen":
            # "≥" rows compare larger-is-better; the overhead target is an upper bound.
            ok = v["hash_over_saved"] <= TARGETS["hash_over_saved"]
            lines.append(f"| hashing ≤ 5 % of the time saved, `{w}`, {_rate_gbps(rate)} | "
                         f"{100 * v['hash_over_saved']:.2f} % (all compute: {100 * v['overhead_over_saved']:.1f} %) | "
                         f"{'yes' if ok else 'no'} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)
    d = a.results
    comm_rows = read_jsonl(os.path.join(d, "cluster_comm.jsonl"))
    e2e_rows = read_jsonl(os.path.join(d, "cluster_e2e.jsonl"))
    over_rows = read_jsonl(os.path.join(d, "cluster_overhead.jsonl"))
    run_path = os.path.join(d, "cluster_run.json")
    run = json.load(open(run_path)) if os.path.isfile(run_path) else {}

    comm_lines, comm_sum = comm_tables(comm_rows) if comm_rows else (["No communication results."], {})
    e2e_lines, e2e_sum = e2e_section(e2e_rows, d)
    over_lines, over_sum = overhead_section(over_rows)
    plots = comm_plots(comm_rows, d) if comm_rows else []

    out = ["# Emulated-cluster benchmarks: ZEN vs dense and the sparse baselines", "",
           "Generated by `bash benchmarks/cluster/run_cluster_report.sh` (needs root: network namespaces); "
           "do not edit by hand. Method, caveats and the analysis of every missed target: "
           "[docs/benchmarks.md](../../../docs/benchmarks.md).", ""]
    if run:
        out += [f"- Machine: {run.get('machine', '?')}. Lab: {run.get('lab', '?')}.",
                "- Stages (1-min load average of the 2-core machine sampled every 15 s in each; other jobs share "
                "the cores): " + "; ".join(
                    f"`{name}` {st['started']}, {st['duration_s'] / 60:.0f} min, commit `{st['commit']}`, load "
                    f"{st['loadavg_summary']}" for name, st in run.get("stages", {}).items()) + ".",
                "- Columns `cpu / foreign`: the machine's busy fraction during a measurement, and the part of it "
                "not used by the benchmark's ranks (other programs, kernel work charged elsewhere).", ""]
    model_path = os.path.join(d, "cluster_model_eval.json")
    model = json.load(open(model_path)) if os.path.isfile(model_path) else {}
    out += ["## Targets", ""] + targets_13_section(comm_sum, e2e_sum, model) + [""]
    out += targets_section(comm_sum, e2e_sum, over_sum) + [""]
    out += ["## 1. Communication: time per sync and bytes per rank", "",
            "Each row: one sync of every slice of the workload's step through the scheme, one rank per host; "
            "min/median/max over interleaved repeats; `max MB sent`: the Communicator's logical bytes of the "
            "busiest rank; `wire MB`: what its interface really sent (TCP/IP headers, gloo control); "
            "`link eff.`: link-rate bound of those logical bytes / median; `modeled`: the α–β cost model "
            "(α = 50 µs) on the measured traffic; `predicted`: the planner's prediction from a sparsity "
            "profile; `max err`: max |result − dense result| (0 for exact sums).", ""]
    out += comm_lines
    scale_rows = read_jsonl(os.path.join(d, "cluster_scale.jsonl"))
    out += ["**Bytes per rank at more hosts** (MB sent by the busiest rank, predicted by the cost model on the "
            "synthetic workloads — the model matches the lab's logical bytes at 4 hosts; rank r's gradient is the "
            "same at every n):", ""] + scale_section(scale_rows) + [""]
    out += ["**Where zen's time goes**", ""] + breakdown_section(comm_rows, over_rows) + [""]
    out += ["**Cost model error** (α–β modeled vs measured median):", ""] + model_error_summary(comm_rows) + [""]
    if model:
        out += ["**Compute-aware cost model** ([cluster_model_eval.md](cluster_model_eval.md), "
                "`benchmarks/cluster/cluster_model_eval.py`): median |error| on the sparse runs "
                + ", ".join(f"{k} {v:.0%}" for k, v in model["median_abs_err"].items() if v is not None)
                + " (refined: per-scheme, per-phase fits learned from the other workloads' measured phase times).",
                ""]
    out += [f"![time per sync]({p})" for p in plots] + [""]
    out += ["## 2. End to end: tokens/s of the fine-tuning recipe", ""] + e2e_lines + [""]
    over_rows_ddp = read_jsonl(os.path.join(d, "cluster_overlap.jsonl"))
    if over_rows_ddp:
        out += ["**Asynchronous DDP hook** (`benchmarks/cluster/bench_overlap.py`: a DDP model of Linear layers, one "
                "bucket each, ZEN with DGC; step time with `zen.async_sync` off / on, interleaved repeats):", ""]
        for r in over_rows_ddp:
            lo, med, hi = min(r["ratio"]), statistics.median(r["ratio"]), max(r["ratio"])
            out.append(f"- {r['n']} hosts at {r['rate']}, {r['layers']} × Linear({r['width']}), DGC {r['density']:g}: "
                       f"blocking / async step time min {lo:.2f}, median {med:.2f}, max {hi:.2f} "
                       f"({len(r['ratio'])} repeats; > 1: the overlap saves time)")
        out.append("")
    out += ["## 3. Overhead: hashing, encoding, aggregation vs the time saved", "",
            "Pure compute of one rank (replayed alone on one core, no network; slowest rank, median of the "
            "repeats) against the time the scheme saved over dense in the lab at that rate.", ""] + over_lines + [""]
    out += ["## 4. Kernel", "", "No GPU in this run: the CUDA hashing kernel (Algorithm 1) is built and "
            "tested for compilation only; the GPU measurement (214 M elements at 5.2 %, the paper's 6 ms V100 "
            "point) is pending. CPU op throughput: [hashing.md](../../comm/results/hashing.md) (`benchmarks/comm/bench_hashing.py`); "
            "the `hash ms` column above is the same C++ op on the workloads' gradients.", ""]
    with open(os.path.join(d, "cluster_report.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
