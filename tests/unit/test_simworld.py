"""SimWorld: same semantics as a process group, exact accounting, and failures that never hang."""

import pytest
import torch

from zen_ext import SimWorld
from zen_ext.comm.base import CommStats


def test_exchange_and_all_gather_deliver_by_rank():
    def body(comm):
        send = [torch.full((comm.rank + j,), float(10 * comm.rank + j)) for j in range(comm.size)]
        recv = comm.exchange_v(send)
        gathered = comm.all_gather_v(torch.full((comm.rank,), float(comm.rank)))
        return recv, gathered

    out = SimWorld(3).run(body)
    for r, (recv, gathered) in enumerate(out):
        for j in range(3):
            assert torch.equal(recv[j], torch.full((j + r,), float(10 * j + r)))
            assert torch.equal(gathered[j], torch.full((j,), float(j)))


def test_byte_accounting_of_exchange():
    world = SimWorld(3)
    # rank r sends 4 float32 to each peer: payload 16 B × 2 peers + 8 B counts × 2 peers.
    world.run(lambda c: c.exchange_v([torch.ones(4) for _ in range(3)]))
    for s in world.stats:
        assert s == CommStats(bytes_sent=48, bytes_recv=48, msgs_sent=4, msgs_recv=4, rounds=2)


@pytest.mark.parametrize("impl", ["direct", "ring", "bruck"])
def test_byte_accounting_of_all_gather_rounds(impl):
    # 5 ranks, rank r sends r float32 (rank 0 nothing). Counts: one round, 8 B to each of the 4 peers.
    world = SimWorld(5, gather_impl=impl)
    world.run(lambda c: c.all_gather_v(torch.ones(c.rank)))
    payload = {"direct": [0, 16, 32, 48, 64],  # own block to the 4 others
               "ring": [4 * (10 - (r + 1) % 5) for r in range(5)],  # every block but the successor's
               "bruck": []}[impl]
    if impl == "bruck":  # rounds send blocks r, r..r+1, r..r (distances 1, 2, 4 with 1, 2, 1 blocks)
        payload = [4 * (2 * r + (r + 1) % 5 + r) for r in range(5)]
    rounds = {"direct": 1, "ring": 4, "bruck": 3}[impl]
    for r, s in enumerate(world.stats):
        assert s.bytes_sent == 4 * 8 + payload[r]
        assert s.rounds == 1 + rounds
    assert sum(s.bytes_sent for s in world.stats) == sum(s.bytes_recv for s in world.stats)
    assert sum(s.msgs_sent for s in world.stats) == sum(s.msgs_recv for s in world.stats)


def test_auto_gather_is_bruck_at_scale_and_direct_for_three():
    from zen_ext.comm import gather

    assert gather.choose("auto", [1000.0] * 16, gather.GatherCosts()) == "bruck"
    assert gather.choose("auto", [1000.0] * 3, gather.GatherCosts()) == "direct"
    assert gather.choose("auto", [0.0] * 2, gather.GatherCosts()) == "direct"
    with pytest.raises(ValueError, match=r"gather_impl \('tree'\) must be one of"):
        gather.choose("tree", [1.0] * 4, gather.GatherCosts())


def test_all_reduce_and_broadcast():
    def body(comm):
        t = torch.full((7,), float(comm.rank + 1))
        comm.all_reduce(t)
        b = torch.full((2,), float(comm.rank))
        comm.broadcast(b, src=2)
        m = torch.tensor([float(comm.rank)])
        comm.all_reduce(m, op="max")
        return t, b, m

    for t, b, m in SimWorld(4).run(body):
        assert torch.equal(t, torch.full((7,), 10.0))
        assert torch.equal(b, torch.full((2,), 2.0))
        assert torch.equal(m, torch.tensor([3.0]))


def test_a_failing_rank_fails_the_run_without_hanging():
    def body(comm):
        if comm.rank == 2:
            raise ValueError("boom on rank 2")
        comm.all_gather_v(torch.ones(1))

    with pytest.raises(RuntimeError, match="rank 2 failed.*boom"):
        SimWorld(4, timeout_s=30).run(body)


def test_mismatched_collectives_time_out_loudly():
    def body(comm):
        if comm.rank == 0:
            comm.all_gather_v(torch.ones(1))  # the others never join

    with pytest.raises(RuntimeError, match="failed"):
        SimWorld(2, timeout_s=1).run(body)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"SimWorld n \(0\) must be an int >= 1"):
        SimWorld(0)
    with pytest.raises(ValueError, match="needs 2 inputs"):
        SimWorld(2).run(lambda c, x: x, [1])
    with pytest.raises(RuntimeError, match="one tensor per rank"):
        SimWorld(2).run(lambda c: c.exchange_v([torch.ones(1)]))


def test_communicators_driven_by_own_threads():
    import threading

    comms = SimWorld(2).communicators()
    out = [None, None]

    def body(c):
        out[c.rank] = c.all_gather_v(torch.tensor([float(c.rank)]))

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [torch.cat(o).tolist() for o in out] == [[0.0, 1.0], [0.0, 1.0]]


@pytest.mark.parametrize("n", [1, 3])
def test_reduce_scatter_into_out_equals_the_returned_sum_and_checks_out(n):
    def body(comm):
        t = torch.arange(4 * n, dtype=torch.float32) * (comm.rank + 1)
        got = comm.reduce_scatter(t.clone())
        buf = torch.full((6,), float("nan"))  # out a view inside a larger tensor, as Step A's windows are
        res = comm.reduce_scatter(t.clone(), out=buf[1:5])
        with pytest.raises(ValueError, match="reduce_scatter out"):
            comm.reduce_scatter(t.clone(), out=torch.empty(5))
        return got, res, buf

    scale = n * (n + 1) / 2
    for r, (got, res, buf) in enumerate(SimWorld(n).run(body)):
        want = torch.arange(4 * r, 4 * r + 4, dtype=torch.float32) * scale
        assert torch.equal(got, want) and torch.equal(res, want) and torch.equal(buf[1:5], want)
        assert buf[0].isnan() and buf[5].isnan()


@pytest.mark.parametrize("rows, cols", [(2, 3), (3, 2), (1, 1)])
def test_run_grid_gives_every_cell_its_row_and_column_worlds(rows, cols):
    """Each cell sums its id over its row world and its column world: the sums are exactly its row's and
    its column's cells, and a permuted column order makes the cell that rank of its column."""
    from zen_ext.comm.simulated import run_grid

    def order(k, l):
        return (k + l) % rows

    def fn(k, l, row, col):
        r, c = torch.tensor([10.0 * k + l]), torch.tensor([10.0 * k + l])
        row.all_reduce(r)
        col.all_reduce(c)
        return row.rank, row.size, col.rank, col.size, r.item(), c.item()

    out = run_grid(rows, cols, fn, col_rank=order)
    for k in range(rows):
        for l in range(cols):
            assert out[k * cols + l] == (l, cols, order(k, l), rows, sum(10.0 * k + j for j in range(cols)),
                                         sum(10.0 * i + l for i in range(rows)))


def test_run_grid_raises_the_failing_cells_error_without_waiting_out_the_timeout():
    import time

    from zen_ext.comm.simulated import run_grid

    def fn(k, l, row, col):
        if (k, l) == (1, 0):
            raise KeyError("cell 1,0")
        row.all_reduce(torch.zeros(1))
        col.all_reduce(torch.zeros(1))

    t0 = time.perf_counter()
    with pytest.raises(KeyError, match="cell 1,0"):
        run_grid(2, 2, fn, timeout_s=60)
    assert time.perf_counter() - t0 < 30
    with pytest.raises(ValueError, match=r"run_grid rows \(0\) and cols \(2\) must be >= 1"):
        run_grid(0, 2, fn)
