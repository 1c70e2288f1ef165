"""``zen.dgc.value_bits`` on real gloo processes: at 3 and 4 ranks every replica gets the same bits, equal to
SimWorld's run of the same inputs, with the owner residual on; the natural rows and dense slices stay exact."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.launch import run_workers
from tests.unit.test_synchronizer import DGC, KINDS, SLICES, bucket_inputs
from zen_ext import SimWorld
from zen_ext.reduction.synchronizer import Synchronizer

LOWBIT = dict(DGC, value_bits=4, momentum_correction=True)


def _steps(comm, steps, dgc=LOWBIT):
    sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=KINDS, dgc=dgc, natural={})
    outs = []
    for inputs in steps:
        outs.append(sync.sync_flat(inputs[comm.rank], SLICES, "mean").clone())
        sync.end_step()
    return outs


def _worker(rank, world_size, steps):
    from zen_ext.comm.torch_dist import TorchCommunicator

    return _steps(TorchCommunicator(), steps)


@pytest.mark.parametrize("n", [3, 4])
def test_replicas_agree_bitwise_on_gloo_and_equal_simworld(n):
    steps = [bucket_inputs(n, seed=20 + s) for s in range(3)]
    got = run_workers(_worker, n, steps)
    sim = SimWorld(n).run(lambda c: _steps(c, steps))
    dense_mask = torch.zeros(2472, dtype=torch.bool)
    for s in SLICES:
        if KINDS[s.name] != "dgc":
            dense_mask[s.offset:s.offset + s.numel] = True
    for step, inputs in enumerate(steps):
        exact = sum(inputs) / n
        for r in range(n):
            assert torch.equal(got[r][step], got[0][step]), (step, r)
            assert torch.equal(got[r][step], sim[r][step]), (step, r)
            assert torch.equal(got[r][step][dense_mask], exact[dense_mask])
