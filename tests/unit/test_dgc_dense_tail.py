"""``zen.dgc.dense_from_step``: a dense tail (issue 21's experiment). From that step on every entry of
the velocity travels, the residual DGC held back included, so the first tail step sends the whole
accumulated gradient and leaves the residual at zero; before it, the schedule is unchanged."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_dgc import check_conservation
from zen_ext.compress import DGCConfig, DGCSparsifier


def test_the_schedule_turns_dense_at_the_step():
    c = DGCConfig(density=0.01, dense_steps=2, warmup_steps=4, warmup_start_density=0.25, dense_from_step=8)
    got = [c.density_at(s) for s in range(11)]
    assert got[:2] == [1.0, 1.0] and got[2] == 0.25 and got[6:8] == [0.01, 0.01] and got[8:] == [1.0, 1.0, 1.0]
    assert DGCConfig(density=0.05).density_at(10**6) == 0.05  # 0: off


@pytest.mark.parametrize("momentum_correction", [False, True])
def test_the_first_tail_step_releases_every_residual(momentum_correction):
    gen = torch.Generator().manual_seed(9)
    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, dense_from_step=3, momentum_correction=momentum_correction))
    sums = torch.zeros(64 * 64)
    sent = torch.zeros(64 * 64)
    for step in range(5):
        sp.state.step = step
        grads = [torch.randn(64, 64, generator=gen)]
        sums += grads[0].reshape(-1)
        sg = check_conservation(sp, grads, momentum_correction)
        sent += sg.to_dense()
        if step < 3:
            assert sg.indices.numel() < 0.1 * 64 * 64, step
        else:  # everything travels; nothing is held back
            assert sg.indices.numel() == 64 * 64 and not sp.state.get("p0", "residual").any(), step
    if not momentum_correction:  # plain error feedback: the tail has sent the sum of all gradients so far
        assert torch.allclose(sent, sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.5, TypeError)])
def test_bad_values_raise(bad, exc):
    with pytest.raises(exc, match=r"zen.dgc.dense_from_step"):
        DGCConfig(dense_from_step=bad)
