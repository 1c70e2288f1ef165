"""The reduce-scatter schemes on real gloo processes: each rank's range equals
``torch.distributed.reduce_scatter_tensor`` of the same densified inputs (uneven ranges padded to equal
blocks), and the bytes counted equal SimWorld's."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext import SimWorld, SparseGrad
from zen_ext.core.reduce_scatter import build_reduce_scatter, even_ranges

SCHEMES = ["dense", "direct", "zen", "auto"]


def _inputs(n: int, rows: int, width: int, dtype, seed: int, hot: bool = False) -> list[SparseGrad]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        k = 0 if r == 1 else 40  # rank 1 sends nothing
        idx = torch.randint(0, 5 if hot else rows, (k,), generator=g)
        if r == 0:
            idx[0], idx[1], idx[2] = 0, rows - 1, 0  # first and last index, a duplicate
        shape = (k,) if width == 1 else (k, width)
        out.append(SparseGrad(idx, torch.randint(-4, 5, shape, generator=g).to(dtype), rows))
    return out


def _cases(n: int) -> list:
    uneven = {2: [(0, 0), (0, 300)], 3: [(0, 7), (7, 7), (7, 300)], 4: [(0, 100), (100, 101), (101, 300), (300, 300)]}
    cut = [(min(600, r * 151), min(600, (r + 1) * 151)) for r in range(n - 1)] + [(min(600, (n - 1) * 151), 600)]
    cases = []
    for i, name in enumerate(SCHEMES):
        cases.append((name, _inputs(n, 300, 1, torch.float32, seed=i), even_ranges(300, n), "mean"))
        cases.append((name, _inputs(n, 300, 1, torch.bfloat16, seed=10 + i, hot=True), uneven[n], "sum"))
        cases.append((name, _inputs(n, 200, 3, torch.float16, seed=20 + i), cut, "sum"))
    return cases


def _worker(rank, world_size, cases):
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator

    results = []
    for name, inputs, ranges, op in cases:
        comm = TorchCommunicator()
        mine = build_reduce_scatter(name).reduce_scatter(comm, inputs[rank], ranges, op=op)
        # torch's own reduce-scatter of the same densified inputs, uneven ranges padded to equal blocks.
        dense = inputs[rank].to_dense()
        block = max(e - s for s, e in ranges)
        buf = torch.zeros(world_size * block, dtype=dense.dtype)
        for r, (s, e) in enumerate(ranges):
            buf[r * block : r * block + e - s] = dense[s:e]
        ref = torch.empty(block, dtype=dense.dtype)
        dist.reduce_scatter_tensor(ref, buf)
        ref = ref[: ranges[rank][1] - ranges[rank][0]]
        if op == "mean":
            ref = ref / world_size
        results.append((mine, ref, comm.stats.as_dict()))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_on_gloo_equals_torch_reduce_scatter(world_size):
    cases = _cases(world_size)
    got = run_workers(_worker, world_size, cases)
    for c, (name, inputs, ranges, op) in enumerate(cases):
        world = SimWorld(world_size)
        world.run(lambda comm, x: build_reduce_scatter(name).reduce_scatter(comm, x, ranges, op=op), inputs)
        for r in range(world_size):
            mine, ref, stats = got[r][c]
            assert torch.equal(mine, ref), (name, r, ranges, mine, ref)
            assert stats == world.stats[r].as_dict(), (name, r)


def _group_worker(rank, world_size, grads, ranges):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    mine = build_reduce_scatter("zen").reduce_scatter_group(comm, [g[rank] for g in grads], ranges, op="sum")
    want = build_reduce_scatter("dense").reduce_scatter_group(comm, [g[rank] for g in grads], ranges, op="sum")
    return mine, want


def test_zen_group_in_packed_exchanges_on_gloo():
    n = 3
    grads = [_inputs(n, 300, 1, torch.float32, seed=40), _inputs(n, 200, 3, torch.bfloat16, seed=41),
             _inputs(n, 300, 1, torch.float32, seed=42, hot=True)]
    grads[1] = [SparseGrad(g.indices, g.values.float(), g.numel) for g in grads[1]]  # one dtype per bucket
    ranges = [even_ranges(300, n), [(0, 100), (100, 100), (100, 600)], [(0, 3), (3, 3), (3, 300)]]
    for r, (mine, want) in enumerate(run_workers(_group_worker, n, grads, ranges)):
        for a, b in zip(mine, want):
            assert torch.equal(a, b), r
