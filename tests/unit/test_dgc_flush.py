"""``zen.dgc.flush_fraction``: a rotating stride of residuals sent each step, the same positions on every
rank, at the same density budget (the bounded-wait experiment of docs/results/time_to_quality_history.md);
conservation stays exact and the Synchronizer's result is the reduction of what each rank sent."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_dgc import compress, check_conservation
from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs, dgc_oracle, run_steps
from zen_ext.compress import DGCConfig, DGCSparsifier

SHAPES = [(64, 33), (1000,), (7, 5, 11)]
TOTAL = 64 * 33 + 1000 + 7 * 5 * 11


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum_correction", [False, True])
@pytest.mark.parametrize("threshold", ["sampled", "exact"])
def test_conservation_with_the_flush_is_exact(wire, momentum_correction, threshold):
    """sent + new residual == accumulated input, bitwise, every step (fp32 memory)."""
    gen = torch.Generator().manual_seed(3)
    sp = DGCSparsifier(DGCConfig(enabled=True, density=0.05, flush_fraction=0.5, threshold=threshold,
                                 momentum_correction=momentum_correction))
    for step in range(5):
        grads = [torch.randn(s, generator=gen).to(wire) for s in SHAPES]
        check_conservation(sp, grads, momentum_correction)
        sp.state.step += 1


def test_every_coordinate_is_flushed_within_one_stride_and_the_budget_is_kept():
    """One huge coordinate per tensor takes the top-k's attention; the small ones still travel once per
    stride of steps, from positions that are a function of the step alone (every rank agrees)."""
    cfg = DGCConfig(enabled=True, density=0.05, flush_fraction=0.4, threshold="exact")
    stride = cfg.flush_stride(cfg.density)
    assert stride == round(1 / (0.4 * 0.05)) == 50
    a, b = DGCSparsifier(cfg), DGCSparsifier(cfg)
    gen = torch.Generator().manual_seed(4)
    seen = torch.zeros(TOTAL, dtype=torch.bool)
    for step in range(stride):
        a.state.step = b.state.step = step
        ga = [torch.rand(s, generator=gen) * 1e-3 for s in SHAPES]
        gb = [torch.rand(s, generator=gen) * 1e-3 for s in SHAPES]
        sa, sb = compress(a, *ga), compress(b, *gb)
        # Every stride-th element of each tensor, from the step's phase (counted from the tensor's start).
        offsets = [0, 64 * 33, 64 * 33 + 1000]
        flushed = torch.cat([o + torch.arange(step % stride, torch.Size(s).numel(), stride)
                             for o, s in zip(offsets, SHAPES)])
        for sg in (sa, sb):  # the same flush positions on both "ranks", whatever their gradients
            assert torch.isin(flushed, sg.indices).all()
        # The budget: the exact top-k keeps ceil(0.05 * (1 - 0.4) * n) per tensor, the flush TOTAL / 50
        # (a position both chose travels twice, the second time as 0).
        k = sum(math.ceil(0.05 * (1 - 0.4) * torch.Size(s).numel()) for s in SHAPES)
        assert sa.nnz == k + flushed.numel(), (sa.nnz, k, flushed.numel())
        seen[sa.indices] = True
    assert seen.all()  # no coordinate waited longer than one stride


def test_config_rules():
    assert DGCConfig(flush_fraction=0.0).flush_stride(0.05) == 0
    assert DGCConfig(flush_fraction=0.5).flush_stride(1.0) == 0  # dense steps send everything anyway
    assert DGCConfig(flush_fraction=0.5).flush_stride(0.05) == 40
    with pytest.raises(ValueError, match=r"zen.dgc.flush_fraction \(1.0\) must be in \[0, 1\)"):
        DGCConfig(flush_fraction=1.0)
    with pytest.raises(ValueError, match=r"zen.dgc.flush_fraction \(-0.1\) must be in \[0, 1\)"):
        DGCConfig(flush_fraction=-0.1)
    with pytest.raises(TypeError, match=r"zen.dgc.flush_fraction \('x'\) must be a number"):
        DGCConfig(flush_fraction="x")


@pytest.mark.parametrize("n", [1, 3])
def test_synchronizer_result_is_the_reduction_of_what_each_rank_sent(n):
    dgc = dict(DGC, flush_fraction=0.5)
    steps = [bucket_inputs(n, seed=40 + s, empty_rank=1 if n > 2 else None) for s in range(3)]
    res, _ = run_steps(n, steps, "mean", dgc=dgc)
    want = dgc_oracle(steps, dgc, "mean")
    mask = torch.zeros(NUMEL, dtype=torch.bool)
    for s in SLICES:
        if KINDS[s.name] == "dgc":
            mask[s.offset : s.offset + s.numel] = True
    for step in range(len(steps)):
        for r in range(n):
            assert torch.equal(res[r][0][step][mask], want[step][mask].float()), (step, r)


def test_flush_positions_follow_each_tensor_not_the_bucket():
    """A parameter flushes the same elements alone or in a bucket with others, in any order (DDP rebuilds
    its buckets after the first iteration, and a resumed run starts on the unrebuilt ones), and a tensor
    shorter than the phase flushes nothing."""
    from zen_ext.compress.dgc.units import _Layout

    sizes = {"a": 2112, "b": 1000, "c": 3, "d": 385}
    for step in (0, 7, 49, 123):
        alone = {k: _Layout((k,), (n,), True, "cpu").flush_positions(step, 50, "cpu") for k, n in sizes.items()}
        for order in (("a", "b", "c", "d"), ("d", "c", "b", "a")):
            lay = _Layout(order, tuple(sizes[k] for k in order), True, "cpu")
            got = lay.flush_positions(step, 50, "cpu")
            want, offset = [], 0
            for k in order:
                want.append(alone[k] + offset)
                offset += sizes[k]
            assert torch.equal(got, torch.cat(want)), (step, order)
        assert torch.equal(alone["b"], torch.arange(step % 50, 1000, 50))
        assert alone["c"].numel() == (1 if step % 50 < 3 else 0)
