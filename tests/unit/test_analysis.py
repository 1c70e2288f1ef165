"""Sparsity analytics (paper Defs. 3–5, 8), calibrated workloads, and gradient traces."""

from __future__ import annotations

import os

import pytest
import torch

from zen_ext import SimWorld, SparseGrad, build_scheme
from zen_ext.analysis import metrics as M
from zen_ext.analysis import workloads as W
from zen_ext.analysis.traces import (
    TRACE_FORMAT, TraceRecorder, TraceStep, TracingScheme, load_step, load_trace, save_step, step_path, trace_files,
)


def sg(idx, numel=100, width=1):
    idx = torch.tensor(idx, dtype=torch.int64)
    vals = torch.ones(idx.numel()) if width == 1 else torch.ones(idx.numel(), width)
    return SparseGrad(idx, vals, numel)


# --- metrics ---------------------------------------------------------------------------------------
def test_density_counts_distinct_indices():
    assert M.density(sg([1, 1, 2, 99])) == 3 / 100
    assert M.density(sg([], numel=10)) == 0.0
    assert M.density(sg([0, 5], numel=10, width=4)) == 2 / 10  # rows in row form


def test_overlap_ratio_def3():
    assert M.overlap_ratio(sg([1, 2, 3, 4]), sg([3, 4, 5])) == pytest.approx(2 / 3)
    assert M.overlap_ratio(sg([1, 2]), sg([1, 2, 1])) == 1.0
    assert M.overlap_ratio(sg([1, 2]), sg([3])) == 0.0
    assert M.overlap_ratio(sg([]), sg([3])) == 0.0


def test_densification_def4():
    full = [sg([1, 2, 3])] * 4
    disjoint = [sg([i]) for i in range(4)]
    assert M.densification_ratio(full) == 1.0
    assert M.densification_ratio(disjoint) == 4.0
    assert M.union_density(disjoint) == 4 / 100
    assert M.densification_ratio([sg([]), sg([])]) == 1.0
    curve = M.densification_curve(disjoint + disjoint)  # ranks 4..7 repeat 0..3
    assert curve == {1: 1.0, 2: 2.0, 4: 4.0, 8: 4.0}
    assert M.densification_curve(disjoint[:3]) == {1: 1.0, 2: 2.0, 3: 3.0}
    with pytest.raises(ValueError, match=r"group size \(5\) must be in \[1, 4\]"):
        M.densification_curve(disjoint, [5])


def test_skewness_def5():
    # 100 indices, 4 ranges of 25: all 5 non-zeros in range 0 → density 5/25 vs 5/100 → 4.
    assert M.skewness(sg([0, 1, 2, 3, 4]), 100, 4) == pytest.approx(4.0)
    assert M.skewness(sg([0, 25, 50, 75]), 100, 4) == pytest.approx(1.0)
    assert M.skewness(sg([]), 100, 4) == 1.0
    # ranges of 4, 4 and a short last one of 2, measured against its own size: 1/2 vs 1/10
    assert M.skewness(sg([9]), 10, 3) == pytest.approx(5.0)


def test_imbalance_def8():
    part = M.partition_fn("sparse_ps", 100, 4)
    grads = [sg([0, 1, 2, 3]), sg([0, 30, 60, 90])]
    # rank 0 sends all 4 to server 0: 4·4/4 = 4; rank 1 is balanced
    assert M.push_imbalance(grads, part, 4) == pytest.approx(4.0)
    # union {0,1,2,3,30,60,90}: server 0 holds 4 of 7 → 4·4/7
    assert M.pull_imbalance(grads, part, 4) == pytest.approx(16 / 7)
    assert M.push_imbalance([sg([])], part, 4) == 1.0
    assert M.pull_imbalance([sg([])], part, 4) == 1.0
    assert M.partition_fn("agsparse", 100, 4) is None


def test_zen_hash_balances_what_contiguous_ranges_skew():
    grads = W.zipf_embedding(16, row_width=64)  # 20 k element non-zeros per rank
    numel = grads[0].numel
    zen, ps = M.partition_fn("zen", numel, 16), M.partition_fn("sparse_ps", numel, 16)
    assert M.push_imbalance(grads, zen, 16) <= 1.1
    assert M.pull_imbalance(grads, zen, 16) <= 1.1
    assert M.push_imbalance(grads, ps, 16) >= 3
    assert M.pull_imbalance(grads, ps, 16) >= 3


def test_block_ids_are_omnireduce_units():
    x = SparseGrad(torch.tensor([0, 1, 600]), torch.ones(3, 128), 1000)  # rows of 128: blocks 0, 300
    b = M.block_ids(x)
    assert b.indices.tolist() == [0, 300]
    assert b.numel == 1000 * 128 // 256
    part = M.partition_fn("omnireduce", 1000, 2, row_width=128)
    assert part(b.indices).tolist() == [0, 1]


# --- workloads -------------------------------------------------------------------------------------
def test_embedding_workload_is_calibrated_to_bert():
    grads = W.zipf_embedding(128, row_width=1)
    d1 = sum(M.density(g) for g in grads) / 128
    assert 0.0095 < d1 < 0.012  # thesis: 1.06 %
    assert 0.39 < M.union_density(grads) < 0.42  # thesis: 40.8 % at 128 GPUs
    gam = M.densification_curve(grads)
    assert all(gam[k] < gam[2 * k] < 2 * k for k in (1, 2, 4, 8, 16, 32, 64))  # grows, stays below n
    first_of_8 = (grads[0].indices < -(-30522 // 8)).float().mean().item()
    assert first_of_8 > 0.6  # paper §2.1 C3: > 60 % in the first of 8 ranges
    assert M.skewness(grads[0], 30522, 8) > 4


def test_embedding_forms_and_duplicates():
    el = W.zipf_embedding(2, row_width=3, seed=1)
    row = W.zipf_embedding(2, row_width=3, form="row", seed=1)
    dup = W.zipf_embedding(2, row_width=3, form="row", coalesce=False, seed=1)
    for e, r, d in zip(el, row, dup):
        assert e.numel == 30522 * 3 and r.numel == 30522 and r.row_width == 3
        assert torch.equal(e.to_dense(), r.to_dense())
        assert torch.equal(d.to_dense(), r.to_dense())  # same sums, duplicates kept
        assert d.nnz == 600 > r.nnz == torch.unique(r.indices).numel()
        assert torch.all(r.values >= 1)  # integer values 1..8, summed over duplicate tokens
    bf = W.zipf_embedding(1, row_width=2, dtype=torch.bfloat16, integer_values=False)[0]
    assert bf.dtype == torch.bfloat16


def test_workloads_are_nested_over_n():
    a, b = W.zipf_embedding(4, row_width=2), W.zipf_embedding(8, row_width=2)
    d1, d2 = W.dgc_topk(2, numel=4096), W.dgc_topk(3, numel=4096)
    for x, y in list(zip(a, b)) + list(zip(d1, d2)):
        assert torch.equal(x.indices, y.indices) and torch.equal(x.values, y.values)


def test_dgc_workload_partial_overlap():
    grads = W.dgc_topk(8, numel=1 << 16, density=0.02)
    assert all(g.nnz == round(0.02 * (1 << 16)) for g in grads)
    gam = M.densification_ratio(grads)
    assert 1.5 < gam < 6  # partial overlap: neither identical (1) nor disjoint (8)
    assert 0.1 < M.overlap_ratio(grads[0], grads[1]) < 0.9
    same = W.dgc_topk(3, numel=4096, shared_fraction=1.0)
    assert M.densification_ratio(same) == 1.0
    assert all(torch.all(g.values != 0) and torch.all(g.values.abs() <= 8) for g in grads)


def test_dgc_dense_is_what_dgc_topk_selects_from():
    """A rank's dense gradient alone (no other rank built): its top-k is dgc_topk's, with its values."""
    real = W.dgc_topk(5, numel=3000, density=0.03, integer_values=False, seed=2)
    ints = W.dgc_topk(5, numel=3000, density=0.03, seed=2)
    for r, dense in zip((4, 1), W.dgc_dense([4, 1], numel=3000, seed=2)):
        assert dense.dtype == torch.float32 and dense.shape == (3000,) and bool((dense != 0).all())
        top = torch.topk(dense.double().abs(), 90).indices.sort().values
        assert torch.equal(top, real[r].indices) and torch.equal(top, ints[r].indices)
        assert torch.equal(dense[top], real[r].values)


def test_workload_errors():
    with pytest.raises(ValueError, match=r"workload \('nope'\) must be one of \['dgc', 'embedding'\]"):
        W.build_workload("nope", 2)
    with pytest.raises(ValueError, match=r"workload.form \('col'\) must be one of \['element', 'row'\]"):
        W.zipf_embedding(2, form="col")
    with pytest.raises(ValueError, match=r"workload.density \(0\) must be in \(0, 1\]"):
        W.dgc_topk(2, density=0)


# --- traces ----------------------------------------------------------------------------------------
def test_trace_roundtrip_keeps_inputs_bit_for_bit(tmp_path):
    step = TraceStep(7, {
        "emb": [SparseGrad(torch.tensor([5, 5, 0]), torch.randn(3, 4).bfloat16(), 10),
                SparseGrad(torch.empty(0, dtype=torch.int64), torch.empty(0, 4).bfloat16(), 10)],
        "bucket": [SparseGrad(torch.tensor([9]), torch.tensor([1.5]), 10),
                   SparseGrad(torch.tensor([0, 9]), torch.tensor([2.0, -1.0]), 10)],
    })
    path = step_path(str(tmp_path), 7)
    save_step(path, step)
    assert os.path.basename(path) == "step_00000007.pt"
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == TRACE_FORMAT and raw["world_size"] == 2
    back = load_step(path)
    assert back.step == 7 and back.world_size == 2 and list(back.slices) == ["emb", "bucket"]
    for key in step.slices:
        for x, y in zip(step.slices[key], back.slices[key]):
            assert torch.equal(x.indices, y.indices) and torch.equal(x.values, y.values) and x.numel == y.numel


def test_trace_errors(tmp_path):
    bad = tmp_path / "step_00000000.pt"
    torch.save({"format": "other"}, bad)
    with pytest.raises(ValueError, match=r"format \('other'\) must be 'zen_ext.trace/1'"):
        load_step(str(bad))
    with pytest.raises(FileNotFoundError, match="must be a step file or a directory"):
        trace_files(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no step_"):
        trace_files(str(empty))
    with pytest.raises(ValueError, match="must have one gradient per rank"):
        save_step(str(tmp_path / "s.pt"), TraceStep(0, {"a": [sg([1])], "b": [sg([1]), sg([2])]}))


def test_recorder_in_simworld_writes_one_file_per_step_and_replays(tmp_path):
    n = 3
    grads = W.zipf_embedding(n, row_width=2, form="row")
    dense = sum(g.to_dense() for g in grads)

    def rank_fn(comm, g):
        rec = TraceRecorder(str(tmp_path), comm)
        scheme = TracingScheme(build_scheme("zen"), rec)
        outs = []
        for _ in range(2):
            outs.append(scheme.sync(comm, g, key="emb"))
            scheme.sync(comm, g)  # no key: recorded as slice1
            rec.end_step()
        return outs

    results = SimWorld(n).run(rank_fn, grads)
    assert all(torch.equal(o, dense) for outs in results for o in outs)
    files = trace_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["step_00000000.pt", "step_00000001.pt"]
    steps = list(load_trace(str(tmp_path)))
    assert [s.step for s in steps] == [0, 1]
    assert list(steps[0].slices) == ["emb", "slice1"]
    replay = steps[1].slices["emb"]
    for x, y in zip(grads, replay):
        assert torch.equal(x.indices, y.indices) and torch.equal(x.values, y.values)
    agsparse = build_scheme("agsparse")
    out = SimWorld(n).run(lambda c, x: agsparse.sync(c, x), replay)
    assert all(torch.equal(o, dense) for o in out)


def test_recorder_single_process_and_key_clash(tmp_path):
    rec = TraceRecorder(str(tmp_path), start_step=5)
    rec.add_all("a", [sg([1]), sg([2])])
    with pytest.raises(ValueError, match=r"trace slice key \('a'\) must be unique within step 5"):
        rec.add_all("a", [sg([1]), sg([2])])
    assert rec.end_step().endswith("step_00000005.pt")
    assert rec.end_step() is None  # nothing recorded: no file
