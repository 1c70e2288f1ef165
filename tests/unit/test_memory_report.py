"""recipes/memory_report.py (the recipe's ``--memory_report``) and benchmarks/memory/bench_peak_memory.py's configs
and arithmetic, without launching a run."""

import os
import sys

import pytest
import torch

from recipes import memory_report
from zen_ext import SimWorld
from zen_ext.reduction.plan import GradSlice
from zen_ext.reduction.synchronizer import Synchronizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "memory"))
import bench_peak_memory  # noqa: E402


def test_state_bytes_counts_each_storage_once():
    flat = torch.zeros(1000)
    views = {"a": {"residual": flat[:600]}, "b": {"residual": flat[600:]}}
    assert memory_report.state_bytes(views) == 4000  # one buffer under both views
    other = torch.zeros(10, dtype=torch.uint8)
    assert memory_report.state_bytes([views, (other, 3, "x"), {"n": None}]) == 4010
    assert memory_report.state_bytes({}) == 0


class _Zen:
    def __init__(self, sync):
        self.sync = sync


def _sync_after_one_step(residual_dtype: str, numel: int = 4096) -> Synchronizer:
    slices = [GradSlice("w", 0, numel, (64, numel // 64))]

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"w": "dgc"},
                            dgc={"enabled": True, "density": 0.05, "residual_dtype": residual_dtype, "warmup_steps": 0,
                                 "threshold": "sampled"})
        flat = (torch.arange(numel, dtype=torch.float32) % 7 - 3.0) * (comm.rank + 1)
        sync.sync_flat(flat, slices, "mean", out=flat)
        sync.end_step()
        return sync

    return SimWorld(2).run(fn)[0]


@pytest.mark.parametrize("dtype,per_element", [("float32", 4.0), ("int4", 0.5 + 8 / 256)])
def test_report_measures_the_dgc_residual(dtype, per_element):
    numel = 4096
    sync = _sync_after_one_step(dtype, numel)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.zeros(64, 64))
    module.b = torch.nn.Parameter(torch.zeros(10))
    rep = memory_report.MemoryReport()
    rep.at_init()
    assert rep.rec["init_rss_mib"] > 0 and rep.rec["init_peak_mib"] >= rep.rec["init_rss_mib"] - 1
    blob = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched after init: the training peak sees it
    touched_mib = memory_report._rss_kib() / 1024  # (freed pages a long-lived worker reuses need not raise it)
    rep.at_train_end(_Zen(sync), module)
    del blob
    r = rep.rec
    assert r["params"] == numel + 10 and r["dgc_params"] == numel
    # the residual (or its codes and scales) plus a few bytes of thresholds
    assert per_element * numel <= r["zen_state_bytes"] <= per_element * numel + 64, r
    assert r["peak_rss_mib"] == max(r["train_peak_mib"], r["init_peak_mib"])
    if r["peak_reset"]:
        assert r["train_peak_mib"] >= touched_mib - 1, r
    assert r["end_rss_mib"] > 0


def test_report_without_zen():
    rep = memory_report.MemoryReport()
    rep.at_init()
    rep.at_train_end(None, torch.nn.Linear(3, 2))
    assert rep.rec["zen_state_bytes"] == 0 and rep.rec["dgc_params"] == 0 and rep.rec["params"] == 8


def test_bench_configs_differ_only_where_the_table_says():
    dense, flat, node = (bench_peak_memory.ds_config(n, 2) for n in ("dense", "flat_fp32", "node_int4"))
    assert "zen" not in dense and dense["zero_optimization"]["stage"] == 3
    assert dense["train_micro_batch_size_per_gpu"] == 2
    assert (flat["zen"]["hierarchical"], flat["zen"]["dgc"]["residual_dtype"]) == (False, "float32")
    assert (node["zen"]["hierarchical"], node["zen"]["dgc"]["residual_dtype"]) == (True, "int4")
    assert flat["zen"]["dgc"]["density"] == node["zen"]["dgc"]["density"] == 0.05
    flat["zen"].pop("hierarchical"), node["zen"].pop("hierarchical")
    flat["zen"]["dgc"].pop("residual_dtype"), node["zen"]["dgc"].pop("residual_dtype")
    assert flat == node and {k: v for k, v in flat.items() if k != "zen"} == dense
    with pytest.raises(ValueError, match="must be one of"):
        bench_peak_memory.ds_config("node_fp32", 2)


def test_bench_formula():
    assert bench_peak_memory.formula("flat_fp32", 1 << 20)[1] == 4 << 20
    assert bench_peak_memory.formula("node_int4", 1 << 20)[1] == (0.5 + 8 / 256) * (1 << 20) / 2
    assert bench_peak_memory.formula("dense", 1 << 20)[1] == 0


def test_bench_report_rows_against_dense_and_the_formula():
    import argparse

    def mem(train, state, dgc):
        return {"init_rss_mib": 700.0, "init_peak_mib": 700.0, "train_peak_mib": train, "peak_rss_mib": train,
                "end_rss_mib": 1500.0,
                "zen_state_bytes": state, "params": 1000, "dgc_params": dgc, "peak_reset": True}

    dgc = 1 << 20
    results = [{"name": "dense", "memory": [mem(2000.0, 0, 0), mem(2100.0, 0, 0)], "step_s": [1.0]},
               {"name": "flat_fp32", "memory": [mem(2300.0, 4 * dgc, dgc), mem(2150.0, 4 * dgc, dgc)],
                "step_s": [2.0]},
               {"name": "node_int4", "memory": [mem(2050.0, 278528, dgc)] * 2, "step_s": [3.0]}]
    a = argparse.Namespace(model="m.json", micro_batch=2, seq_len=128, steps=4, dgc_warmup_steps=0)
    text = bench_peak_memory.report(results, a, "cmd")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["dense"][3:5] == ["2,100", "+0"]
    assert rows["flat_fp32"][3:5] == ["2,300", "+200"] and rows["flat_fp32"][8] == "4.00 MiB"
    assert rows["flat_fp32"][10] == "1.000" and rows["node_int4"][10] == "1.000"  # 0.53125·P/2 = 278528
    assert rows["node_int4"][4] == "-50" and "P_dgc = 1,048,576" in text
