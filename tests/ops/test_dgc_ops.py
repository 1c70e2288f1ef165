"""``zen_ext::dgc_accumulate_select_`` and ``zen_ext::gather_list`` (CPU) against plain torch: gradients
as lists with empty members, selection units that cut across tensors, both dtypes, momentum on and off,
positions in any order, and the errors that bad input raises before anything is written."""

from __future__ import annotations

import pytest
import torch

from zen_ext import ops

pytestmark = pytest.mark.skipif(not ops.has_dgc_select_op(torch.zeros(1)), reason="needs the zen_ext C++ op")


def _reference(R, U, g, m, thr_U, ends_U):
    R, U = R.clone(), None if U is None else U.clone()
    if U is not None:
        U.mul_(m)
        U.add_(g)
        R.add_(U)
    else:
        R.add_(g)
    unit_numels = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int64), ends_U]))
    t = thr_U.repeat_interleave(unit_numels)
    return R, U, ((R >= t) | (R <= -t)).nonzero().flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_equals_torch_across_tensor_and_unit_boundaries(dtype, momentum):
    g = torch.Generator().manual_seed(2)
    sizes = [0, 70000, 1, 0, 131072 + 3, 5]  # empty members, one across 2 chunks of the op's grain
    g_T = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
    N = sum(sizes)
    R = torch.randn(N, generator=g, dtype=dtype)
    R[0] = 0.0  # index 0 and the last index are candidates below
    U = torch.randn(N, generator=g, dtype=dtype) if momentum is not None else None
    g_T[1][0] = 50.0
    g_T[-1][-1] = -50.0
    ends_U = torch.tensor([10, 10, 100000, N], dtype=torch.int64)  # an empty unit; units cut tensors
    thr_U = torch.tensor([0.5, 9.0, 2.0, 1.5], dtype=dtype)
    want_R, want_U, want_pos = _reference(R, U, torch.cat(g_T), momentum or 0.0, thr_U, ends_U)
    got_U = None if U is None else U.clone()
    got_R = R.clone()
    pos, val, run = ops.dgc_accumulate_select_(got_R, got_U, g_T, momentum or 0.0, thr_U, ends_U)
    assert torch.equal(pos, want_pos) and pos[0] == 0 and pos[-1] == N - 1
    assert torch.equal(got_R, want_R)
    assert val.dtype == dtype and torch.equal(val, want_R[want_pos])  # the values: nothing to gather after
    assert torch.equal(run, torch.searchsorted(ends_U, want_pos, right=True))
    if U is not None:
        assert torch.equal(got_U, want_U)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [None, 0.5])
def test_ties_specials_and_every_lane(dtype, momentum):
    """|R| exactly at the threshold (kept), NaN (never a candidate), ±inf (kept), in every lane of the
    fp32 op's 16-element step and in its scalar tail (runs of odd lengths)."""
    g = torch.Generator().manual_seed(7)
    N = 16 * 40 + 13
    R = torch.zeros(N, dtype=dtype)
    U = torch.zeros(N, dtype=dtype) if momentum is not None else None
    grad = torch.randn(N, generator=g, dtype=dtype) * 0.1
    grad[torch.arange(0, N, 17)] = 2.0  # hits walk through every lane: 17 is coprime with 16
    grad[torch.arange(5, N, 29)] = -2.0
    grad[100], grad[101], grad[102], grad[N - 1] = float("nan"), float("inf"), -float("inf"), -2.0
    ends_U = torch.tensor([9, 300, 301, N], dtype=torch.int64)
    thr_U = torch.tensor([2.0, 2.0, 0.01, 2.0], dtype=dtype)  # |2.0| == threshold: selected
    g_T = list(grad.split([9, 290, 300, N - 599]))
    want_R, want_U, want_pos = _reference(R, U, grad, momentum or 0.0, thr_U, ends_U)
    got_U = None if U is None else U.clone()
    pos, val, run = ops.dgc_accumulate_select_(R, got_U, g_T, momentum or 0.0, thr_U, ends_U)
    assert torch.equal(pos, want_pos) and 100 not in pos.tolist() and {101, 102, N - 1} <= set(pos.tolist())
    assert torch.equal(R.nan_to_num(), want_R.nan_to_num()) and R.isnan().equal(want_R.isnan())
    assert torch.equal(val, want_R[want_pos]) and torch.equal(run, torch.searchsorted(ends_U, want_pos, right=True))
    if U is not None:
        assert torch.equal(got_U.nan_to_num(), want_U.nan_to_num())


def test_empty_bucket_and_no_candidates():
    R = torch.zeros(0)
    got = ops.dgc_accumulate_select_(R, None, [torch.zeros(0)], 0.0, torch.ones(1), torch.zeros(1, dtype=torch.int64))
    assert [t.numel() for t in got] == [0, 0, 0]
    R = torch.zeros(1000)
    pos, val, run = ops.dgc_accumulate_select_(R, None, [torch.full((1000,), 1e-3)], 0.0, torch.ones(1),
                                               torch.tensor([1000]))
    assert pos.numel() == val.numel() == run.numel() == 0 and torch.all(R == 1e-3)


def test_bad_input_raises_and_writes_nothing():
    R = torch.zeros(8)
    with pytest.raises(RuntimeError, match="the gradients hold 7 elements, R 8"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(7)], 0.0, torch.ones(1), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="every gradient must be a contiguous CPU tensor of Float"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(8, dtype=torch.float64)], 0.0, torch.ones(1), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="ends_U must end at numel"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(8)], 0.0, torch.ones(1), torch.tensor([7]))
    assert torch.all(R == 0)


def test_gather_list_any_order_and_range_check():
    g = torch.Generator().manual_seed(4)
    g_T = [torch.randn(n, generator=g) for n in (5, 0, 17, 1, 40)]
    cat = torch.cat(g_T)
    pos = torch.tensor([0, 62, 22, 5, 21, 23, 22, 61, 3], dtype=torch.int64)
    assert torch.equal(ops.gather_list(g_T, pos), cat[pos])
    asc = torch.arange(0, 63, 2)
    assert torch.equal(ops.gather_list(g_T, asc), cat[asc])
    with pytest.raises(RuntimeError, match=r"position 63 outside \[0, 63\)"):
        ops.gather_list(g_T, torch.tensor([1, 63]))
