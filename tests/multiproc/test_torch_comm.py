"""TorchCommunicator on real gloo processes gives the same results and byte counts as SimWorld."""

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext import SimWorld, SparseGrad, build_scheme


def _inputs(world_size: int, numel: int, nnz: int, seed: int = 0) -> list[SparseGrad]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world_size):
        k = 0 if r == 1 else nnz  # rank 1 has no non-zeros at all
        idx = torch.randint(0, numel, (k,), generator=g)
        if r == 0 and k:
            idx[0], idx[-1] = 0, numel - 1  # first and last index
        out.append(SparseGrad(idx, torch.randint(-8, 8, (k,), generator=g).float(), numel))
    return out


def _sync_worker(rank, world_size, scheme_name, options, exchange_impl, inputs):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator(exchange_impl=exchange_impl)
    out = build_scheme(scheme_name, **options).sync(comm, inputs[rank])
    return out, comm.stats.as_dict()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("exchange_impl", ["p2p", "a2a"])
def test_zen_on_gloo_matches_simworld(world_size, exchange_impl):
    inputs = _inputs(world_size, numel=5003, nnz=300)
    got = run_workers(_sync_worker, world_size, "zen", {}, exchange_impl, inputs)
    world = SimWorld(world_size)
    sim = world.run(lambda c, x: build_scheme("zen").sync(c, x), inputs)
    expected = sum(x.to_dense() for x in inputs)
    for r in range(world_size):
        out, stats = got[r]
        assert torch.equal(out, expected)  # integer-valued: exact
        assert torch.equal(sim[r], expected)
        assert stats == world.stats[r].as_dict()


def test_dense_on_gloo_matches_simworld_bytes():
    inputs = _inputs(3, numel=1000, nnz=50)
    got = run_workers(_sync_worker, 3, "dense", {}, "p2p", inputs)
    world = SimWorld(3)
    world.run(lambda c, x: build_scheme("dense").sync(c, x), inputs)
    expected = sum(x.to_dense() for x in inputs)
    for r in range(3):
        assert torch.equal(got[r][0], expected)
        assert got[r][1] == world.stats[r].as_dict()


def _gather_start_worker(rank, world_size):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    mine = torch.arange(rank * 3, dtype=torch.int64) + 100 * rank  # rank 0 sends nothing
    blocking = comm.all_gather_v(mine)
    order, msgs = [], {}
    for j, buf in comm.all_gather_v_start(mine).as_completed():
        order.append(j)
        msgs[j] = buf.clone()
    # A consumer that stops after its own message still leaves no request behind: the next
    # collectives on the group run normally.
    handle = comm.all_gather_v_start(mine)
    next(iter(handle.as_completed()))
    del handle
    again = comm.all_gather_v(mine)
    return order, msgs, blocking, again


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_v_start_yields_each_message_once_own_first(world_size):
    got = run_workers(_gather_start_worker, world_size)
    for r, (order, msgs, blocking, again) in enumerate(got):
        assert order[0] == r and sorted(order) == list(range(world_size))
        for j in range(world_size):
            want = torch.arange(j * 3, dtype=torch.int64) + 100 * j
            assert torch.equal(msgs[j], want) and torch.equal(blocking[j], want) and torch.equal(again[j], want)


def _gather_impl_worker(rank, world_size, impl, sizes):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator(gather_impl=impl)
    mine = torch.arange(sizes[rank], dtype=torch.float32) + 1000 * rank
    blocking = comm.all_gather_v(mine)
    streamed = {j: buf.clone() for j, buf in comm.all_gather_v_start(mine).as_completed()}
    # A consumer that stops early: the rounds left still run (the others need what this rank forwards).
    next(iter(comm.all_gather_v_start(mine).as_completed()))
    with comm.signed(77, torch.float32, "sum", where="test"):
        signed = comm.all_gather_v(mine)
    return blocking, streamed, signed, comm.stats.as_dict()


@pytest.mark.parametrize("impl", ["direct", "ring", "bruck", "bruck4", "auto"])
@pytest.mark.parametrize("world_size", [3, 5])
def test_every_gather_algorithm_on_gloo_matches_simworld(impl, world_size):
    """Each algorithm at non-power-of-two n, with empty messages (rank 1 sends nothing; at 5 ranks rank 3
    too, so whole Bruck messages are empty): values and per-rank stats equal SimWorld's."""
    sizes = [5, 0, 3, 0, 9][:world_size]
    got = run_workers(_gather_impl_worker, world_size, impl, sizes)
    world = SimWorld(world_size, gather_impl=impl)

    def sim(c):
        mine = torch.arange(sizes[c.rank], dtype=torch.float32) + 1000 * c.rank
        c.all_gather_v(mine)
        c.all_gather_v(mine)
        c.all_gather_v(mine)
        with c.signed(77, torch.float32, "sum", where="test"):
            c.all_gather_v(mine)

    world.run(sim)
    for r, (blocking, streamed, signed, stats) in enumerate(got):
        for j in range(world_size):
            want = torch.arange(sizes[j], dtype=torch.float32) + 1000 * j
            assert torch.equal(blocking[j], want) and torch.equal(streamed[j], want) and torch.equal(signed[j], want)
        assert stats == world.stats[r].as_dict()


def _gather_mismatch_worker(rank, world_size):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator(gather_impl="bruck")
    with comm.signed(10 + (rank == 2), torch.float32, "sum", where="test"):
        try:
            comm.all_gather_v(torch.ones(rank + 1))
        except RuntimeError as exc:
            return str(exc)
    return "no error"


def test_bruck_gather_checks_signatures_on_every_rank_before_payloads():
    for r, msg in enumerate(run_workers(_gather_mismatch_worker, 5)):
        assert "ranks disagree" in msg and "numel 1" in msg, (r, msg)
