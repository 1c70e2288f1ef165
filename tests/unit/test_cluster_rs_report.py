"""The reduce-scatter lab benchmark's parts that run without a lab: the markdown writer on canned JSON
lines (``benchmarks/cluster/cluster_rs_report.py``), the model predictions against ``auto``'s own
(``benchmarks/cluster/bench_rs_cluster.py``), and ``bench_e2e.py``'s ZeRO-3 configurations."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "cluster"))

import bench_e2e  # noqa: E402
import cluster_rs_report as report  # noqa: E402


def _line(scheme: str, t_med: float, busiest: int, equal: bool = True, **kw) -> dict:
    rec = dict(bench="rs", rate="250mbit", ncpu=2, loadavg=["3.00", "2.00", "1.00"], n=8, workload="dgc1",
               numel=1 << 21, row_width=1, dtype="torch.float32", nnz=[20972] * 8, density=0.01, scheme=scheme,
               reps=7, t_min=t_med * 0.9, t_med=t_med, t_max=t_med * 1.2, busiest_bytes=busiest,
               msgs_sent=[7] * 8, rounds=1, wire_tx=[busiest * 1.05] * 8, bound_s=busiest / 30e6,
               time_over_bound=t_med / (busiest / 30e6), predicted_s=None, chosen=[scheme], model_choice="zen",
               why=None, check_equal=equal, check_max_abs_err=0.0 if equal else 2.0, cpu_all=0.9, foreign=0.1,
               tag="", commit="abc1234", utc="2026-11-27T23:00:00Z")
    rec.update(kw)
    return rec


def test_markdown_writer_on_canned_lines():
    lines = [_line("dense", 0.400, 7_340_032), _line("direct", 0.150, 1_000_000), _line("zen", 0.100, 500_000),
             _line("auto", 0.110, 500_000, chosen=["zen"], predicted_s=0.088, why="dense 7.34 MB; zen 0.5 MB")]
    text = report.render(lines)
    summary = next(x for x in text.splitlines() if x.startswith("| 8 | 250mbit | DGC 1 %"))
    # dense 400 ms / zen 100 ms, direct 150 / zen 100; every scheme equal to dense.
    assert "| 400 | 150 | **100** | 110 (zen) | 4.00× | 1.50× |" in summary and summary.endswith("| yes |")
    assert "| auto → zen | 99.0 | **110** | 132 | 3.64× | 0.50 | 14.68× |" in text
    assert ("auto chose zen (the model's pick too): measured 110 ms, predicted 88.0 ms (error -20 %); fastest "
            "fixed scheme zen 100 ms, auto = 1.10× it.") in text
    assert "commit abc1234" in text and "/tmp" not in text and "interface sent" not in text
    # gloo's dense reduce-scatter moving more than a ring's bytes is flagged.
    doubled = report.render([_line("dense", 0.4, 7_340_032, wire_tx=[14_680_064] * 8)] + lines[1:])
    assert "dense's interface sent 2.00× its logical (ring reduce-scatter) bytes" in doubled
    # A wrong result shows in both tables; a repeated scheme starts a new run.
    bad = report.render(lines[:2] + [_line("zen", 0.1, 500_000, equal=False)])
    assert "| **no** |" in bad and "**no** (max err 2)" in bad
    assert [len(run) for run in report.group_runs(lines + lines[:2])] == [4, 2]


def test_markdown_writer_e2e_section():
    base = dict(bench="e2e", n=8, rate="250mbit", reps=2, steps_timed=12, tokens_per_s_min=900.0,
                tokens_per_s_max=1100.0, step_s_med=1.0, losses=[9.0, 8.5], ds_config={"zero_optimization": {"stage": 3}})
    dense = dict(base, config="dense_z3", describe="dense", zen=None, tokens_per_s_med=1000.0, baseline="dense_z3",
                 vs_baseline=None, bytes_sent_per_step=8e6, dense_bytes_per_step=None)
    zen = dict(base, config="zen_dgc1_z3", describe="zen", zen={"scheme": "zen"}, tokens_per_s_med=1500.0,
               baseline="dense_z3", vs_baseline=1.5, sync_s_med=0.2, bytes_sent_per_step=4e5, dense_bytes_per_step=8e6)
    text = report.render([_line("dense", 0.4, 7_340_032)], e2e=[zen, dense])
    rows = [x for x in text.splitlines() if x.startswith("| 8 | 250mbit | ")]
    assert rows[-2].startswith("| 8 | 250mbit | dense_z3 |") and "**1000**" in rows[-2]
    assert "| 1.50× dense_z3 | 1.000 | 0.200 | 0.40 | 8.00 | 8.5000 |" in rows[-1]


def test_predictions_match_auto_reduce_scatter():
    """The benchmark's per-candidate model equals what ``auto`` computes from its own gathered profile."""
    import bench_rs_cluster

    from zen_ext import SimWorld
    from zen_ext.analysis.workloads import dgc_topk
    from zen_ext.core.reduce_scatter import build_reduce_scatter
    from zen_ext.core.rs_base import even_ranges

    n = 4
    grads = dgc_topk(n, numel=1 << 12, density=0.05, seed=3)
    ranges = even_ranges(1 << 12, n)
    preds = bench_rs_cluster.predictions(grads, ranges, bandwidth_gbps=0.25, latency_us=50.0)
    auto = build_reduce_scatter("auto", bandwidth_gbps=0.25, latency_us=50.0)
    seen = {}

    def fn(comm, x):
        t = {}
        auto.reduce_scatter(comm, x, ranges, timings=t, key="b")
        seen[comm.rank] = (t["scheme"], t["why"])

    SimWorld(n).run(fn, grads)
    choice, why = seen[0]
    assert choice == min(preds, key=lambda s: preds[s]["seconds"])
    for s, p in preds.items():
        assert f"{s} {p['bytes'] / 1e6:.3g} MB busiest rank, {p['rounds']} round(s), {p['seconds'] * 1e3:.3g} ms" in why


def test_e2e_zero3_configs():
    class A:
        micro_batch, lr = 2, 3e-4

    cfg = bench_e2e.ds_config("zen_dgc1_z3", A)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_optimization"]["reduce_scatter"] is True
    assert cfg["zen"]["dgc"] == {"enabled": True, "density": 0.01, "warmup_steps": 0}
    assert cfg["gradient_accumulation_steps"] == 1  # DGC under ZeRO-3 reduces every micro-batch
    assert "zen" not in bench_e2e.ds_config("dense_z3", A)
    assert bench_e2e.ds_config("dense_z3", A)["zero_optimization"] == cfg["zero_optimization"]
    assert {k: bench_e2e.baseline_of(k) for k in ("zen_dgc1_z3", "zen_natural_z3", "dense_z3", "zen_dgc1")} == {
        "zen_dgc1_z3": "dense_z3", "zen_natural_z3": "dense_z3", "dense_z3": "dense_z3", "zen_dgc1": "dense"}
    assert bench_e2e.baseline_of("zen_dgc1_z2") is None  # no dense ZeRO-2 configuration
