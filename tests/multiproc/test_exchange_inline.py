"""exchange_v with the counts in the payload messages (inside a ``Communicator.slot``), on real gloo processes
(the count-carrying all_gather_v: test_gather_inline.py; the signature check of both is here).

Every call equals the two-round form (exact: integer-valued payloads), the byte, message and round
counts equal SimWorld's, and a rank passing a different gradient still fails at the signature check on
every rank instead of hanging.
"""

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext import SimWorld

# Per step, the number of elements rank src sends rank dst: steps exercise the first call (counts in a
# round of their own), a repeat that fits, growth past the capacity (overflow round), shrinking to empty
# (padding only), growth from empty (the whole payload in the overflow round), and a repeat.
STEPS = 6


def _count(step: int, src: int, dst: int) -> int:
    base = 40 + 7 * src + 3 * dst
    return [base, base - 1, 3 * base if (src + dst) % 2 else base, 0 if dst == 0 else base,
            base if dst == 0 else base + 1, base][step]


def _payload(step: int, src: int, dst: int, dtype) -> torch.Tensor:
    k = _count(step, src, dst)
    return (torch.arange(k, dtype=torch.float32) % 97 + 100 * src + 10 * dst + step).to(dtype)


def _steps(comm, dtype):
    got, rounds = [], []
    for step in range(STEPS):
        with comm.slot(("bucket", 0)):
            before = comm.stats.rounds
            recv = comm.exchange_v([_payload(step, comm.rank, j, dtype) for j in range(comm.size)])
            rounds.append(comm.stats.rounds - before)
        got.append([r.clone() for r in recv])
    return got, rounds, comm.stats.as_dict()


def _worker(rank, world_size, exchange_impl, dtype):
    from zen_ext.comm.torch_dist import TorchCommunicator

    return _steps(TorchCommunicator(exchange_impl=exchange_impl), dtype)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("exchange_impl", ["p2p", "a2a"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_count_carrying_exchange_equals_the_two_round_form(world_size, exchange_impl, dtype):
    got = run_workers(_worker, world_size, exchange_impl, dtype)
    world = SimWorld(world_size)
    sim = world.run(lambda c: _steps(c, dtype))
    for r in range(world_size):
        parts, rounds, stats = got[r]
        for step in range(STEPS):
            for j in range(world_size):
                assert torch.equal(parts[step][j], _payload(step, j, r, dtype)), (r, step, j)
        # First call: counts, then payloads; after it one round, two where this rank has an overflow.
        overflow = [any(_count(s, a, b) > _count(s - 1, a, b) + _count(s - 1, a, b) // 16 + 8 * (_count(s - 1, a, b) > 0)
                        for a, b in [(r, j) for j in range(world_size) if j != r] + [(j, r) for j in range(world_size) if j != r])
                    for s in range(1, STEPS)]
        assert rounds == [2] + [2 if o else 1 for o in overflow], (r, rounds)
        assert stats == world.stats[r].as_dict()
        assert sim[r][1] == rounds


def _mismatch_worker(rank, world_size, collective):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    for step in range(3):
        numel = 1000 + (1 if rank == 1 and step == 2 else 0)  # rank 1 passes a different gradient at step 2
        with comm.slot("b"), comm.signed(numel, torch.float32, "sum", where="test"):
            try:
                if collective == "exchange_v":
                    comm.exchange_v([torch.ones(10 + step) for _ in range(world_size)])
                else:
                    comm.all_gather_v(torch.ones(10 + rank + step))
            except RuntimeError as exc:
                return step, str(exc)
    return None, "no error"


@pytest.mark.parametrize("collective", ["exchange_v", "all_gather_v"])
def test_count_carrying_collectives_check_signatures_on_every_rank(collective):
    # The third call carries its counts in the payload: sizes still match (they come from the slot's
    # history, not the data) and every rank fails at the signature check instead of hanging.
    for r, (step, msg) in enumerate(run_workers(_mismatch_worker, 3, collective)):
        assert step == 2 and "ranks disagree" in msg and "numel 1001" in msg, (r, step, msg)
