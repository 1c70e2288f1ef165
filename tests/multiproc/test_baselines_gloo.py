"""The baselines and ``auto`` on real gloo processes: equal to dense, and the same bytes as SimWorld."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext import SimWorld, SparseGrad, build_scheme

SCHEMES = ["agsparse", "sparcml", "omnireduce", "sparse_ps"]


def _inputs(world_size: int, numel: int, nnz: int, width: int = 1, seed: int = 0) -> list[SparseGrad]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world_size):
        k = 0 if r == 1 else nnz  # rank 1 has no non-zeros: nothing empty may reach gloo
        idx = torch.randint(0, numel, (k,), generator=g)
        if r == 0 and k:
            idx[0], idx[1], idx[2] = 0, numel - 1, 0  # first and last index, and a duplicate
        shape = (k,) if width == 1 else (k, width)
        out.append(SparseGrad(idx, torch.randint(-8, 9, shape, generator=g).float(), numel))
    return out


def _worker(rank, world_size, cases, exchange_impl):
    from zen_ext.comm.torch_dist import TorchCommunicator

    results = []
    for name, inputs in cases:
        comm = TorchCommunicator(exchange_impl=exchange_impl)
        out = build_scheme(name).sync(comm, inputs[rank])
        results.append((out, comm.stats.as_dict()))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_baselines_on_gloo_match_dense_and_simworld(world_size):
    cases = [(name, _inputs(world_size, numel=3001, nnz=200, seed=i)) for i, name in enumerate(SCHEMES)]
    cases += [(name, _inputs(world_size, numel=257, nnz=40, width=3, seed=9)) for name in SCHEMES]
    cases.append(("sparcml", [SparseGrad.from_dense(torch.ones(500)) for _ in range(world_size)]))  # dense rounds
    got = run_workers(_worker, world_size, cases, "p2p")
    for c, (name, inputs) in enumerate(cases):
        world = SimWorld(world_size)
        world.run(lambda comm, x: build_scheme(name).sync(comm, x), inputs)
        expected = sum(x.to_dense() for x in inputs)
        for r in range(world_size):
            out, stats = got[r][c]
            assert torch.equal(out, expected), (name, r)
            assert stats == world.stats[r].as_dict(), (name, r)


def test_sparcml_folding_on_three_gloo_ranks_with_a2a_exchange():
    cases = [("sparcml", _inputs(3, numel=1000, nnz=100, seed=4)), ("omnireduce", _inputs(3, 1000, 100, seed=5))]
    got = run_workers(_worker, 3, cases, "a2a")
    for c, (_, inputs) in enumerate(cases):
        expected = sum(x.to_dense() for x in inputs)
        assert all(torch.equal(got[r][c][0], expected) for r in range(3))


def _auto_worker(rank, world_size, inputs, bandwidths):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    auto = build_scheme("auto", profile_steps=2, bandwidth_gbps=bandwidths[rank])
    outs = [auto.sync(comm, inputs[rank], key="emb") for _ in range(3)]
    # 100k elements: large enough that bytes, not fixed per-call costs, decide (at 1000 elements the
    # candidates' predictions are within 20 % of each other and a loaded machine can flip the choice).
    dense = auto.sync(comm, torch.full((100_000,), float(rank + 1)), key="dense")
    return outs, auto.last_choice("emb"), auto.last_choice("dense")[0], dense


def test_auto_on_gloo_agrees_and_is_exact():
    from zen_ext.analysis.workloads import zipf_embedding

    inputs = zipf_embedding(4, row_width=4)
    got = run_workers(_auto_worker, 4, inputs, [10.0] * 4)
    expected = sum(x.to_dense() for x in inputs)
    assert len({g[1] for g in got}) == 1  # same choice and reason on every rank
    for outs, _, dense_choice, dense in got:
        assert all(torch.equal(o, expected) for o in outs)
        assert dense_choice == "dense" and torch.equal(dense, torch.full((100_000,), 10.0))


def test_auto_on_gloo_with_mismatched_options_raises_instead_of_hanging():
    from zen_ext.analysis.workloads import zipf_embedding

    with pytest.raises(AssertionError, match=r"auto: rank \d decided .* but rank \d decided .*must use the same options"):
        run_workers(_auto_worker, 2, zipf_embedding(2, row_width=2), [10.0, 1.0], timeout_s=120)
