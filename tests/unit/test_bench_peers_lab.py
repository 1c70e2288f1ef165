"""The emulated-cluster peers benchmark's bookkeeping (``benchmarks/cluster/bench_peers_lab.py``): the timed
window of each method, the time per step from a run's log, the qgZ shape check and the report."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "cluster"))

import bench_peers_lab  # noqa: E402


def _log(path, recs):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "train_log.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def test_window_holds_one_outer_sync_for_the_diloco_family():
    a = SimpleNamespace(steps=5, warmup=2)
    assert bench_peers_lab.window("dense", a) == 5
    assert bench_peers_lab.window("diloco_h50", a) == 50 and bench_peers_lab.window("sparseloco_h15", a) == 15
    # The window, steps warmup + 1 .. warmup + H, holds step H (the outer synchronization) exactly once.
    h = bench_peers_lab.window("diloco_h50", a)
    assert sum(1 for s in range(a.warmup + 1, a.warmup + h + 1) if s % 50 == 0) == 1


def test_delay1_window_starts_one_round_later():
    a = SimpleNamespace(steps=5, warmup=2)
    m = "zen_outer_d25_4bit_delay1"
    skip, h = bench_peers_lab.untimed(m, a), bench_peers_lab.window(m, a)
    assert (skip, h) == (17, 15) and bench_peers_lab.untimed("zen_outer_d25_4bit", a) == 2
    # The first outer step (15, nothing in flight) is untimed; the window holds step 30, which waits for
    # round 1's sum and launches round 2's.
    assert [s for s in range(1, skip + 1) if s % 15 == 0] == [15]
    assert [s for s in range(skip + 1, skip + h + 1) if s % 15 == 0] == [30]


def test_timed_uses_elapsed_span_after_warmup(tmp_path):
    a = SimpleNamespace(steps=3, warmup=2)
    # Step times 5, 5 (warm-up), then 1, 2, 3 s: the window is 6 s over 3 steps; bytes 10 per timed step.
    _log(tmp_path / "dense", [{"step": i + 1, "loss": 1.0, "step_s": 0.0, "elapsed_s": e, "bytes_sent": b}
                              for i, (e, b) in enumerate([(5, 100), (10, 200), (11, 210), (13, 220), (16, 230)])])
    r = bench_peers_lab.timed("dense", str(tmp_path / "dense"), a)
    assert r["step_s"] == pytest.approx(2.0) and r["bytes_per_step"] == pytest.approx(10.0)
    with pytest.raises(SystemExit, match="logged 5 of 4"):
        bench_peers_lab.timed("dense", str(tmp_path / "dense"), SimpleNamespace(steps=2, warmup=2))


def test_timed_deepspeed_sums_step_times_and_checks_qgz_path(tmp_path):
    a = SimpleNamespace(steps=2, warmup=2)
    _log(tmp_path / "qgz_z3", [{"step": i + 1, "loss": 1.0, "step_s": s} for i, s in enumerate([9, 9, 1.0, 3.0])])
    with open(tmp_path / "qgz_z3" / "qgz_stats.json", "w") as f:
        json.dump({"calls": 4, "quantized_tensors": 0, "fallback_tensors": 8, "bytes_sent": 0}, f)
    with pytest.raises(SystemExit, match="no tensor through qgZ"):
        bench_peers_lab.timed("qgz_z3", str(tmp_path / "qgz_z3"), a)
    with open(tmp_path / "qgz_z3" / "qgz_stats.json", "w") as f:
        json.dump({"calls": 4, "quantized_tensors": 12, "fallback_tensors": 8, "bytes_sent": 400}, f)
    r = bench_peers_lab.timed("qgz_z3", str(tmp_path / "qgz_z3"), a)
    assert r["step_s"] == pytest.approx(2.0) and r["bytes_per_step"] == pytest.approx(100.0)


def test_qgz_refusal_names_the_shape_the_kernel_cannot_cover():
    assert bench_peers_lab.qgz_refusal(bench_peers_lab.MODEL, 8192, 8) is None
    why = bench_peers_lab.qgz_refusal(bench_peers_lab.MODEL, 8192, 16)
    assert "(344, 128)" in why and "multiple of the world size (16)" in why


def test_render_reports_ratio_to_dense_and_skips():
    base = dict(bench="peers_lab", stamp="t1", n=8, rate="250mbit", model="m.json", micro_batch=2, seq_len=64,
                tokens_per_step=1024, warmup=2, timed_steps=5, reps=3, cpus=2, cpu_all_runs=[1.0],
                cpu_ours_runs=[0.5], foreign_runs=[0.5], bytes_per_step_med=2048.0)
    recs = [dict(base, method="dense", describe="d", tokens_per_s_min=90, tokens_per_s_med=100, tokens_per_s_max=110,
                 step_s_med=10.24, vs_dense=1.0),
            dict(base, method="zen_dgc1", describe="z", tokens_per_s_min=180, tokens_per_s_med=200,
                 tokens_per_s_max=210, step_s_med=5.12, vs_dense=2.0),
            dict(base, stamp="t0", method="zen_dgc5", describe="old", tokens_per_s_min=1, tokens_per_s_med=1,
                 tokens_per_s_max=1, step_s_med=1.0, vs_dense=0.01),
            dict(bench="peers_lab", stamp="t1", n=8, rate="250mbit", method="qgz_z3", describe="q", skipped="why")]
    text = bench_peers_lab.render(recs)
    assert "| zen_dgc1: z | 5 × 3 | 180 / 200 / 210 | 5.120 | **2.00×** | 2.0 KiB |" in text
    assert "old" not in text and "Not run: qgz_z3 (q): why." in text
