"""``zen.dgc.selection_chunk``: the exact top ``density`` of every run of ``chunk`` elements of each
tensor (issue 21's finer-unit experiment): every run sends exactly its own top-k (a tensor's shorter last
run its own share), zeros never travel, error feedback stays exact, and the unsupported combinations
raise before anything runs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_dgc import _ops_of_second_step, compress, check_conservation
from zen_ext.compress import DGCConfig, DGCSparsifier


@pytest.mark.parametrize("sizes", [[4096, 1000, 33], [4096, 1024, 256]])  # ragged (a loop); whole runs (one top-k)
@pytest.mark.parametrize("chunk", [1, 7, 64, 256, 5000])
def test_every_run_sends_its_own_top_k(chunk, sizes):
    gen = torch.Generator().manual_seed(chunk)
    grads = [torch.randn(n, generator=gen) * (10.0 ** i) for i, n in enumerate(sizes)]
    grads[1][:300] = 0.0  # zeros never travel, even where a run keeps more than its non-zeros
    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, threshold="exact", selection_chunk=chunk,
                                 momentum_correction=False))
    got = compress(sp, *grads).indices
    want, at = [], 0
    for g in grads:
        n = g.numel()
        for s in range(0, n, chunk):
            run = g[s:s + chunk].abs()
            k = max(1, math.ceil(0.05 * run.numel()))
            t = run.topk(k).values[-1]
            want.append(at + s + ((run >= t) & (run > 0)).nonzero().flatten())
        at += n
    assert torch.equal(got, torch.cat(want))
    for i, g in enumerate(grads):  # the state records each tensor's smallest run threshold
        n = g.numel()
        runs = [g[s:s + chunk].abs() for s in range(0, n, chunk)]
        low = min(r.topk(max(1, math.ceil(0.05 * r.numel()))).values[-1].clamp(min=1e-45) for r in runs)
        assert torch.equal(sp.state.get(f"p{i}", "threshold"), low), i


def test_whole_runs_cost_the_same_ops_for_4_and_64_tensors():
    """Where every tensor holds whole runs, the selection is one top-k over the bucket's runs."""
    counts = _ops_of_second_step(torch.float32, dict(density=0.05, threshold="exact", selection_chunk=256,
                                                     momentum_correction=False), seed=21)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum_correction", [False, True])
def test_conservation_is_exact(wire, momentum_correction):
    gen = torch.Generator().manual_seed(7)
    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, threshold="exact", selection_chunk=256,
                                 momentum_correction=momentum_correction))
    shapes = [(64, 64), (1000,)]
    for step in range(4):
        grads = [torch.randn(s, generator=gen).to(wire) for s in shapes]
        check_conservation(sp, grads, momentum_correction)
        sp.state.step += 1


def test_bad_values_raise():
    with pytest.raises(ValueError, match=r'zen.dgc.selection_chunk \(256\) must be 0 or, with zen.dgc.threshold "exact" '
                                         r"\(got 'sampled'\), a positive number of elements"):
        DGCConfig(selection_chunk=256)
    with pytest.raises(ValueError, match=r"zen.dgc.selection_chunk \(-1\) must be 0 or"):
        DGCConfig(selection_chunk=-1, threshold="exact")


def test_tensor_parallelism_raises():
    class _TP:
        size = 2

    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, threshold="exact", selection_chunk=64,
                                 momentum_correction=False))
    with pytest.raises(ValueError, match=r"zen.dgc.selection_chunk \(64\) must be 0 under tensor parallelism"):
        compress(sp, torch.randn(4096), tp_comm=_TP())
