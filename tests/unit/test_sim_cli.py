"""``python -m zen_ext sim``: argument parsing, outputs, traces, and the simulator's acceptance checks on the
calibrated embedding workload (small n here; n = 128 in one test and in benchmarks/comm/sim_report.py)."""

from __future__ import annotations

import json

import pytest

from zen_ext.analysis import sim_cli
from zen_ext.analysis.traces import TraceStep, save_step, step_path
from zen_ext.analysis.workloads import zipf_embedding

LOSSLESS = ["zen", "zen_coo", "sparcml", "agsparse", "omnireduce", "sparse_ps"]


def rows_by(report, n):
    return {r["scheme"]: r for r in report["results"] if r["n"] == n}


def test_parse_ranks():
    assert sim_cli.parse_ranks("2,4,...,128") == [2, 4, 8, 16, 32, 64, 128]
    assert sim_cli.parse_ranks("2,4,...,100") == [2, 4, 8, 16, 32, 64, 100]
    assert sim_cli.parse_ranks("3,6,...,12") == [3, 6, 12]
    assert sim_cli.parse_ranks("1,3,...,9") == [1, 3, 5, 7, 9]
    assert sim_cli.parse_ranks("8, 2,2") == [2, 8]
    for bad in ["", "2,...", "a,b", "0,2", "4,2,...,8"]:
        with pytest.raises(ValueError, match=r"sim.ranks \(.*\) must be"):
            sim_cli.parse_ranks(bad)


def test_resolve_schemes():
    assert sim_cli.resolve_schemes("all")[:3] == ["dense", "zen", "sparcml"]  # the registry's order
    assert "auto" in sim_cli.resolve_schemes("all")
    assert sim_cli.resolve_schemes("zen") == ["dense", "zen"]
    with pytest.raises(ValueError, match=r"sim.schemes \('zen,ring'\) must be 'all' or names .*unknown: \['ring'\]"):
        sim_cli.resolve_schemes("zen,ring")


def test_main_writes_table_json_and_plot(tmp_path, capsys):
    out_json, out_png, out_md = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.md"
    code = sim_cli.main(["--ranks", "2,3", "--row-width", "4", "--schemes", "all", "--json", str(out_json),
                         "--plot", str(out_png), "--markdown", str(out_md), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "### n = 3" in printed and "| zen |" in printed and "auto → " in printed
    report = json.loads(out_json.read_text())
    assert report["config"]["ranks"] == [2, 3]
    assert {r["scheme"] for r in report["results"]} == {"dense", "auto", *LOSSLESS}
    for r in report["results"]:
        assert r["max_abs_err"] == 0.0 and r["tolerance"] == 0.0
        assert r["bytes_max"] == max(r["bytes_sent_max"], r["bytes_recv_max"])
        assert r["modeled_time_s"] > 0
    dense = rows_by(report, 3)["dense"]
    assert dense["speedup_vs_dense"] == 1.0
    assert dense["bytes_sent_max"] == 2 * 2 * (30522 * 4 * 4) // 3  # ring: 2(n−1)/n of the buffer
    a = report["analytics"][1]
    assert a["n"] == 3 and "eq1_s" in a and a["eq2_s"] is None  # Eq. 2 needs a power of two
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"
    assert out_md.read_text().startswith("Source: `embedding`")


def test_main_reports_errors_cleanly(capsys):
    assert sim_cli.main(["--ranks", "0", "--no-progress"]) == 2
    assert "sim.ranks ('0') must be rank counts >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_cli.main(["--workload", "nope"])


def test_trace_replay_matches_the_workload(tmp_path):
    grads = zipf_embedding(4, row_width=4, form="row", integer_values=False)
    save_step(step_path(str(tmp_path), 0), TraceStep(0, {"emb": grads}))
    base = ["--ranks", "2,4", "--schemes", "zen,agsparse", "--no-progress", "--json"]
    assert sim_cli.main(base + [str(tmp_path / "t.json"), "--trace", str(tmp_path)]) == 0
    assert sim_cli.main(base + [str(tmp_path / "w.json"), "--row-width", "4", "--form", "row"]) == 0
    t, w = (json.loads((tmp_path / f).read_text()) for f in ("t.json", "w.json"))
    for rt, rw in zip(t["results"], w["results"]):
        assert rt["bytes_sent_max"] == rw["bytes_sent_max"]  # same index pattern, same bytes
        assert rt["max_abs_err"] <= rt["tolerance"]  # real-valued trace: summation order only
    assert sim_cli.main(["--trace", str(tmp_path), "--ranks", "8", "--no-progress"]) == 2


def test_acceptance_on_the_calibrated_embedding_small_n():
    """The simulator's acceptance checks (results/sim_summary.md), at n = 8 and 16: every lossless scheme
    equals dense; zen has the lowest max-per-rank bytes; zen's Push/Pull imbalance <= 1.1 while sparse_ps' is >= 3; auto is exact."""
    args = sim_cli.build_parser().parse_args(["--ranks", "8,16", "--no-progress"])
    report = sim_cli.simulate(args)
    for n in (8, 16):
        rows = rows_by(report, n)
        assert all(r["max_abs_err"] == 0.0 for r in rows.values())
        zen = rows["zen"]["bytes_max"]
        assert all(zen < rows[s]["bytes_max"] for s in LOSSLESS if s != "zen"), n
        assert zen < rows["dense"]["bytes_max"]
        assert rows["zen"]["push_imbalance"] <= 1.1 and rows["zen"]["pull_imbalance"] <= 1.1
        assert rows["sparse_ps"]["push_imbalance"] >= 3 and rows["sparse_ps"]["pull_imbalance"] >= 3
        assert rows["omnireduce"]["push_imbalance"] >= 3


def test_acceptance_at_128_ranks():
    """n = 128 (row width 16 to stay under a minute): exact, zen lowest bytes, agsparse above dense."""
    args = sim_cli.build_parser().parse_args(
        ["--ranks", "128", "--row-width", "16", "--no-progress",
         "--schemes", "dense,zen,zen_coo,sparcml,agsparse,omnireduce,sparse_ps"])
    rows = rows_by(sim_cli.simulate(args), 128)
    assert all(r["max_abs_err"] == 0.0 for r in rows.values())
    assert all(rows["zen"]["bytes_max"] < rows[s]["bytes_max"] for s in LOSSLESS if s != "zen")
    assert rows["agsparse"]["bytes_max"] > rows["dense"]["bytes_max"]
    assert rows["sparse_ps"]["push_imbalance"] >= 3
    assert rows["zen"]["pull_imbalance"] <= 1.1
    a = rows["zen"]
    # Push: counts + payloads to every peer; pull: counts to every peer, then 7 Bruck rounds of one
    # message (comm/gather.py).
    assert a["msgs_max"] == 2 * 127 + 127 + 7


def test_entry_point_is_wired():
    from zen_ext.__main__ import main

    assert main(["sim", "--ranks", "2", "--row-width", "1", "--schemes", "zen", "--no-progress"]) == 0
