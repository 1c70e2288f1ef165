"""``zen.dgc.normalize_beta``: the selection ranks residuals by ``|r| / sqrt(running mean of g²)`` (issue
21's Adam-aware selection experiment). Error feedback stays exact, the running mean is the formula's,
coordinates of a small gradient scale travel too (plain DGC starves them), loss-scale changes rescale
it by the square, and bad values raise."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_dgc import _ops_of_second_step, compress, check_conservation
from zen_ext.compress import DGCConfig, DGCSparsifier

SHAPES = [(64, 33), (1000,), (7, 5, 11)]


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum_correction", [False, True])
@pytest.mark.parametrize("threshold", ["sampled", "exact"])
def test_conservation_and_the_running_mean(wire, momentum_correction, threshold):
    """sent + new residual == accumulated input, bitwise, every step; ``sq_mean`` follows
    ``s ← β·s + (1 − β)·g²`` of the local gradients."""
    gen = torch.Generator().manual_seed(4)
    beta = 0.9
    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, normalize_beta=beta, threshold=threshold,
                                 momentum_correction=momentum_correction))
    want_s = [torch.zeros(s).reshape(-1) for s in SHAPES]
    for step in range(4):
        grads = [torch.randn(s, generator=gen).to(wire) for s in SHAPES]
        check_conservation(sp, grads, momentum_correction)
        for i, g in enumerate(grads):
            gf = g.float().reshape(-1)
            want_s[i] = want_s[i] * beta + gf * gf * (1 - beta)
            assert torch.allclose(sp.state.get(f"p{i}", "sq_mean"), want_s[i], rtol=1e-6, atol=0), (step, i)
        sp.state.step += 1


def test_small_scale_coordinates_travel_too():
    """Half a tensor's gradients are 100x the other half's: plain DGC sends only the large half; the
    normalized selection sends both halves about equally (each against its own scale)."""
    scale = torch.cat([torch.full((5000,), 100.0), torch.ones(5000)])

    def sent_small(cfg: DGCConfig) -> list[float]:
        gen = torch.Generator().manual_seed(5)
        sp = DGCSparsifier(cfg)
        out = []
        for step in range(6):
            sp.state.step = step
            idx = compress(sp, torch.randn(10000, generator=gen) * scale).indices
            out.append(float((idx >= 5000).sum()) / max(1, idx.numel()))
        return out

    plain = sent_small(DGCConfig(enabled=True, density=0.05, momentum_correction=False))
    normalized = sent_small(DGCConfig(enabled=True, density=0.05, momentum_correction=False, normalize_beta=0.95))
    assert max(plain) == 0.0, plain
    assert all(0.3 < f < 0.7 for f in normalized[1:]), normalized


def test_loss_scale_change_rescales_the_squares():
    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, normalize_beta=0.5, momentum_correction=False))
    sp.set_loss_scale(4.0)
    compress(sp, torch.full((4096,), 2.0))
    before = sp.state.get("p0", "sq_mean").clone()
    sp.end_step()
    sp.set_loss_scale(8.0)
    assert torch.equal(sp.state.get("p0", "sq_mean"), before * 4.0)


@pytest.mark.parametrize("bad", [1.0, -0.1])
def test_bad_beta_raises(bad):
    with pytest.raises(ValueError, match=rf"zen.dgc.normalize_beta \({bad}\) must be in \[0, 1\)"):
        DGCConfig(normalize_beta=bad)


def test_ef21_rejects_it():
    with pytest.raises(ValueError, match=r'zen.dgc.normalize_beta \(0.9\) must be 0 when zen.dgc.feedback is "ef21"'):
        DGCConfig(normalize_beta=0.9, feedback="ef21", momentum_correction=False)


def test_ops_per_bucket_do_not_grow_with_the_number_of_tensors():
    """The running mean is updated over the bucket at once (the gradients as one view), not per tensor."""
    counts = _ops_of_second_step(torch.bfloat16, dict(density=0.05, normalize_beta=0.95, momentum_correction=False),
                                 seed=22)
    assert counts[0] == counts[1], counts
