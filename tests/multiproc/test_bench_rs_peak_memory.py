"""benchmarks/memory/bench_rs_peak_memory.py's worker on 4 gloo processes at a small size: the state it reports is
the residual's arithmetic (``4·P`` fp32 and ``0.53·P`` int4 flat, divided by L = 2 node-level; none for
the dense all-reduce), and a non-negative peak rise per step."""

import os
import sys

import pytest

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "memory"))
import bench_rs_peak_memory as bench  # noqa: E402

NUMEL = 4 * bench.WIDTH * 64


@pytest.mark.parametrize("mode,state", [("flat_fp32", 4 * NUMEL), ("node_int4", (0.5 + 8 / 256) * NUMEL / 2),
                                        ("flat_int4", (0.5 + 8 / 256) * NUMEL), ("node_fp32", 4 * NUMEL / 2),
                                        ("dense_allreduce", 0)])
def test_bench_worker_state_and_rises(mode, state):
    res = run_workers(bench._bench, 4, mode, NUMEL, 2)
    for r in res:
        assert len(r["rises"]) == 2 and all(x >= 0 for x in r["rises"]), r
        assert state <= r["state"] <= state + 64, (mode, r["state"], state)  # + a few bytes of thresholds
