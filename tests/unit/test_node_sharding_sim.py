"""Node-sharded (hierarchical) reduction through Communicators, in SimWorld: ``NodeShardedReduce``
no longer calls ``torch.distributed`` itself, so N nodes of L ranks run in one process, and the
Communicator's ``reduce_scatter`` / ``all_gather`` are checked on their own."""

from __future__ import annotations

import pytest
import torch

from zen_ext import SimWorld
from zen_ext.comm.simulated import run_grid
from zen_ext.reduction import BucketReducer, NodeShardedReduce
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_reduce_scatter_and_all_gather(n):
    W = 7
    inputs = [torch.arange(n * W, dtype=torch.float32) * (r + 1) for r in range(n)]
    total = sum(inputs)

    def fn(comm, t):
        before = comm.stats.snapshot()
        mine = comm.reduce_scatter(t)
        back = comm.all_gather(mine)
        return mine, back, (comm.stats - before).bytes_sent

    for r, (mine, back, sent) in enumerate(SimWorld(n).run(fn, inputs)):
        assert torch.equal(mine, total[r * W:(r + 1) * W])
        assert torch.equal(back, total)
        assert sent == 2 * (n - 1) * W * 4  # ring accounting, both collectives
    with pytest.raises(RuntimeError, match="multiple of 2 elements"):  # SimWorld wraps the rank's error
        SimWorld(2).run(lambda c: c.reduce_scatter(torch.zeros(3)))


def _grid(nodes: int, local: int, fn):
    """Run ``fn(rank, intra, inter)`` for ``nodes × local`` ranks, rank = node·local + l, on threads."""
    return run_grid(nodes, local, lambda k, l, intra, inter: fn(k * local + l, intra, inter), timeout_s=60)


@pytest.mark.parametrize("nodes, local", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_node_sharded_bucket_equals_the_dense_reduction(nodes, local, op):
    """A bucket with embedding rows (natural, zen across nodes) and a dense tensor: every rank ends with
    the sum (or mean) over all ranks, exactly for integer values; the intra-node bytes are counted."""
    world = nodes * local
    rows, width, dn = 10, 4, 23
    slices = [GradSlice("e", 0, rows * width, (rows, width)), GradSlice("w", rows * width, dn, (dn,))]

    def grad(r):
        g = torch.Generator().manual_seed(r)
        emb = torch.zeros(rows, width)
        emb[torch.randint(0, rows, (3,), generator=g)] = torch.randint(-4, 5, (3, width), generator=g).float()
        emb[0] += 1  # index 0 on every rank
        return torch.cat([emb.reshape(-1), torch.randint(-8, 9, (dn,), generator=g).float()])

    want = sum(grad(r) for r in range(world))
    if op == "mean":
        want = want / world

    def fn(rank, intra, inter):
        sync = Synchronizer(dp_comm=inter, scheme="zen", param_kinds={"e": "natural", "w": "dense"}, natural={})
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=world, node=NodeShardedReduce(intra))
        flat = grad(rank)
        red.reduce_(flat, slices, op)
        return flat, red.pop_stats()

    for flat, stats in _grid(nodes, local, fn):
        assert torch.equal(flat, want) if op == "sum" else torch.allclose(flat, want, rtol=0, atol=1e-6)
        assert stats["intra_bytes_sent"] > 0
