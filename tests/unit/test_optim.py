"""``zen_ext.optim.FrozenVarianceAdamW``: AdamW until the freeze, then a frozen second moment."""

from __future__ import annotations

import copy

import pytest
import torch

from zen_ext.optim import FrozenVarianceAdamW


def _pair(freeze_after: int, seed: int = 0):
    torch.manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(64))
    b = torch.nn.Parameter(a.detach().clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)
    return a, b, torch.optim.AdamW([a], foreach=False, **kw), FrozenVarianceAdamW([b], freeze_after=freeze_after, **kw)


def test_equals_torch_adamw_until_the_freeze():
    a, b, opt_a, opt_b = _pair(freeze_after=6)
    for t in range(10):
        g = torch.randn(64)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        if t < 6:
            assert torch.equal(a, b), t
    assert not torch.equal(a, b)  # after the freeze the steps differ


def test_second_moment_is_frozen_and_the_step_is_linear_in_the_gradient():
    """After the freeze, v never moves; the step is lr·m̂/(sqrt(v̂)+eps) with v̂ from the freeze step, so
    a gradient delayed by error feedback and then sent moves the parameter as far in total (momentum-free
    case: b1 = 0 makes the step linear in g)."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(8))
    opt = FrozenVarianceAdamW([p], lr=0.1, betas=(0.0, 0.9), weight_decay=0.0, freeze_after=3)
    for _ in range(3):
        p.grad = torch.randn(8)
        opt.step()
    v = opt.state[p]["exp_avg_sq"].clone()
    start = p.detach().clone()
    g = torch.randn(8)
    for _ in range(4):  # four steps of g ...
        p.grad = g.clone()
        opt.step()
    four = p.detach() - start
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)
    p.data.copy_(start)
    for grad in (torch.zeros(8), torch.zeros(8), torch.zeros(8), 4 * g):  # ... or one burst of 4g
        p.grad = grad
        opt.step()
    torch.testing.assert_close(p.detach() - start, four, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip():
    a, b, _, opt = _pair(freeze_after=2)
    for _ in range(3):
        b.grad = torch.randn(64)
        opt.step()
    c = torch.nn.Parameter(b.detach().clone())
    opt2 = FrozenVarianceAdamW([c], lr=1e-2, betas=(0.9, 0.95), freeze_after=2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint: no shared tensors
    g = torch.randn(64)
    b.grad, c.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(b, c) and opt2.state[c]["step"] == 4


@pytest.mark.parametrize("kw, text", [
    (dict(freeze_after=0), r"freeze_after \(0\) must be an int >= 1"),
    (dict(freeze_after=True), r"freeze_after \(True\) must be an int >= 1"),
    (dict(betas=(0.9, 1.0)), r"betas \(\(0.9, 1.0\)\) must be in \[0, 1\)"),
    (dict(lr=-1.0), r"lr \(-1.0\) must be >= 0"),
    (dict(eps=0.0), r"eps \(0.0\) must be > 0"),
])
def test_bad_hyperparameters_raise(kw, text):
    with pytest.raises(ValueError, match=text):
        FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(1))], **kw)


def test_a_coordinate_first_seen_after_the_freeze_does_not_explode():
    """v = 0 at the freeze (an embedding row no batch touched) would divide by eps: the coordinate takes
    its first gradient's square instead, so its step stays of the order of lr, then v stays frozen."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = FrozenVarianceAdamW([p], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0, freeze_after=2)
    for _ in range(2):
        p.grad = torch.tensor([1.0, -2.0, 0.0, 0.0])  # coordinates 2 and 3 never see a gradient
        opt.step()
    before = p.detach().clone()
    p.grad = torch.tensor([1.0, -2.0, 3.0, 0.0])
    opt.step()
    step = (p.detach() - before).abs()
    assert step[2] < 0.1 and step[2] > 0  # lr·0.1·g / sqrt(0.05·g²/bc2): about 0.4·lr, not lr·0.3/1e-8
    v = opt.state[p]["exp_avg_sq"].clone()
    assert v[2] > 0 and v[3] == 0
    p.grad = torch.tensor([5.0, 5.0, 5.0, 0.0])
    opt.step()
    assert torch.equal(opt.state[p]["exp_avg_sq"], v)  # frozen once seen
