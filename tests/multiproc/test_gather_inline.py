"""all_gather_v with the counts in the blocks (inside a ``Communicator.slot``), on real gloo processes.

Every call returns every rank's payload exactly (integer-valued), whatever the payload rounds (direct,
ring, Bruck, radix-4 Bruck) and the dtype; bytes, messages and rounds equal SimWorld's. A rank that
passes a different gradient fails on every rank: test_exchange_inline.py checks both collectives.
"""

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext import SimWorld
from zen_ext.comm import gather
from zen_ext.comm.inline import next_capacity

IMPLS = ["direct", "ring", "bruck", "bruck4"]
DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
# Per step, rank r's element count: the first call (counts in a round of their own), a repeat that fits,
# growth past the capacity on odd ranks (the overflow round), shrinking to empty on rank 0, growth from
# empty (rank 0's whole payload in the overflow round), and a repeat.
STEPS = 6


def _count(step: int, r: int) -> int:
    base = 50 + 13 * r
    return [base, base - 1, 3 * base if r % 2 else base, 0 if r == 0 else base, base + 1, base + 1][step]


def _payload(step: int, r: int, dtype) -> torch.Tensor:
    return (torch.arange(_count(step, r)) % 89 + 3 * r + step).to(dtype)


def _steps(comm):
    out = {}
    for dtype in DTYPES:
        got, rounds = [], []
        for step in range(STEPS):
            with comm.slot(("pull", str(dtype))):
                before = comm.stats.rounds
                parts = comm.all_gather_v(_payload(step, comm.rank, dtype))
                rounds.append(comm.stats.rounds - before)
            got.append([p.clone() for p in parts])
        out[str(dtype)] = got, rounds
    return out, comm.stats.as_dict()


def _worker(rank, world_size):
    from zen_ext.comm.torch_dist import TorchCommunicator

    return {impl: _steps(TorchCommunicator(gather_impl=impl)) for impl in IMPLS}


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_count_carrying_gather_equals_every_rank_payload(world_size):
    got = run_workers(_worker, world_size)
    for impl in IMPLS:
        world = SimWorld(world_size, gather_impl=impl)
        sim = world.run(_steps)
        for r in range(world_size):
            per_dtype, stats = got[r][impl]
            for dtype in DTYPES:
                parts, rounds = per_dtype[str(dtype)]
                for step in range(STEPS):
                    for j in range(world_size):
                        assert torch.equal(parts[step][j], _payload(step, j, dtype)), (impl, r, dtype, step, j)
                # First call: the count phase, then the payload rounds; after it the payload rounds only,
                # plus one where any rank outgrew its block.
                payload_rounds = len(gather.schedule(impl, world_size, r))
                count_rounds = gather.count_rounds(world_size, gather.GatherCosts())
                overflow = [any(_count(s, j) > next_capacity(_count(s - 1, j)) for j in range(world_size))
                            for s in range(1, STEPS)]
                assert rounds == [count_rounds + payload_rounds] + [payload_rounds + o for o in overflow], \
                    (impl, r, dtype, rounds)
                assert sim[r][0][str(dtype)][1] == rounds
            assert stats == world.stats[r].as_dict(), (impl, r)
