"""``zen_ext::dgc_accumulate_select_`` and ``zen_ext::gather_list`` (CPU) against plain torch: gradients
as lists with empty members, selection units that cut across tensors, both dtypes, momentum on and off,
positions in any order, and the errors that bad input raises before anything is written."""

from __future__ import annotations

import math

import pytest
import torch

from zen_ext import ops
from zen_ext.ops import _reference_dgc
from zen_ext.ops._reference_dgc import at_rank

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
    pos, val, run, count = ops.dgc_accumulate_select_(got_R, got_U, g_T, momentum or 0.0, thr_U, ends_U)
    assert count.tolist() == [pos.numel()]
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
    pos, val, run, _ = ops.dgc_accumulate_select_(R, got_U, g_T, momentum or 0.0, thr_U, ends_U)
    assert torch.equal(pos, want_pos) and 100 not in pos.tolist() and {101, 102, N - 1} <= set(pos.tolist())
    assert torch.equal(R.nan_to_num(), want_R.nan_to_num()) and R.isnan().equal(want_R.isnan())
    assert torch.equal(val, want_R[want_pos]) and torch.equal(run, torch.searchsorted(ends_U, want_pos, right=True))
    if U is not None:
        assert torch.equal(got_U.nan_to_num(), want_U.nan_to_num())


def test_empty_bucket_and_no_candidates():
    R = torch.zeros(0)
    got = ops.dgc_accumulate_select_(R, None, [torch.zeros(0)], 0.0, torch.ones(1), torch.zeros(1, dtype=torch.int64))
    assert [t.numel() for t in got[:3]] == [0, 0, 0] and got[3].tolist() == [0]
    R = torch.zeros(1000)
    pos, val, run, _ = ops.dgc_accumulate_select_(R, None, [torch.full((1000,), 1e-3)], 0.0, torch.ones(1),
                                               torch.tensor([1000]))
    assert pos.numel() == val.numel() == run.numel() == 0 and torch.all(R == 1e-3)


@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_half_gradients_widen_into_fp32_memory(gdt, momentum):
    """bf16/fp16 gradients with fp32 memory: widened exactly, as torch's mixed-dtype add does."""
    g = torch.Generator().manual_seed(9)
    N = 16 * 50 + 7
    grad = (torch.randn(N, generator=g) * 3).to(gdt)
    R = torch.randn(N, generator=g)
    U = torch.randn(N, generator=g) if momentum is not None else None
    ends_U = torch.tensor([100, N], dtype=torch.int64)
    thr_U = torch.tensor([1.0, 2.5])
    want_R, want_U, want_pos = _reference(R, U, grad, momentum or 0.0, thr_U, ends_U)
    got_U = None if U is None else U.clone()
    pos, val, run, count = ops.dgc_accumulate_select_(R, got_U, list(grad.split([3, N - 3])), momentum or 0.0, thr_U,
                                                      ends_U)
    assert torch.equal(pos, want_pos) and torch.equal(R, want_R) and val.dtype == torch.float32
    assert count.tolist() == [pos.numel()] and pos.numel() > 50
    if U is not None:
        assert torch.equal(got_U, want_U)


@pytest.mark.parametrize("capacity", [0, 1, 37, 10_000])
def test_capacity_pads_or_keeps_the_first_candidates(capacity):
    """With a capacity the outputs hold exactly that many entries: the first candidates in order, then
    padding (position numel, value 0, run = the number of runs); the count is every candidate's, as on
    CUDA."""
    g = torch.Generator().manual_seed(3)
    N = 5000
    grad = torch.randn(N, generator=g)
    ends_U = torch.tensor([1000, 1001, N])
    thr_U = torch.tensor([1.0, 0.5, 2.0])
    R_all, R_cap = torch.zeros(N), torch.zeros(N)
    pos, val, run, count = ops.dgc_accumulate_select_(R_all, None, [grad], 0.0, thr_U, ends_U)
    cpos, cval, crun, ccount = ops.dgc_accumulate_select_(R_cap, None, list(grad.split([7, N - 7])), 0.0, thr_U,
                                                          ends_U, None, capacity)
    K = pos.numel()
    assert torch.equal(R_all, R_cap) and ccount.tolist() == count.tolist() == [K] and K > 100
    assert cpos.numel() == cval.numel() == crun.numel() == capacity
    k = min(K, capacity)
    assert torch.equal(cpos[:k], pos[:k]) and torch.equal(cval[:k], val[:k]) and torch.equal(crun[:k], run[:k])
    assert torch.all(cpos[k:] == N) and torch.all(cval[k:] == 0) and torch.all(crun[k:] == 3)  # past every run


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_false_flag_writes_nothing(momentum):
    """``ok`` false (a non-finite gradient): R and U untouched, no candidates, count 0."""
    grad = torch.full((300,), float("nan"))
    R = torch.ones(300)
    U = torch.ones(300) if momentum is not None else None
    pos, val, run, count = ops.dgc_accumulate_select_(R, U, [grad], momentum or 0.0, torch.ones(1),
                                                      torch.tensor([300]), torch.tensor(False), 16)
    assert torch.all(R == 1) and (U is None or torch.all(U == 1))
    assert count.tolist() == [0] and torch.all(pos == 300) and torch.all(val == 0)
    _, _, _, count = ops.dgc_accumulate_select_(R, U, [torch.ones(300)], momentum or 0.0, torch.ones(1),
                                                torch.tensor([300]), torch.tensor(True), 16)
    assert count.tolist() == [300] and torch.all(R > 1)


def test_bad_input_raises_and_writes_nothing():
    R = torch.zeros(8)
    with pytest.raises(RuntimeError, match="the gradients hold 7 elements, R 8"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(7)], 0.0, torch.ones(1), torch.tensor([8]))
    with pytest.raises(RuntimeError, match=r"gradients of Double with memory of Float \(supported: the memory's dtype"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(8, dtype=torch.float64)], 0.0, torch.ones(1), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="every gradient must be a contiguous CPU tensor of BFloat16"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(4, dtype=torch.bfloat16), torch.ones(4)], 0.0, torch.ones(1),
                                   torch.tensor([8]))
    with pytest.raises(RuntimeError, match="ends_U must end at numel"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(8)], 0.0, torch.ones(1), torch.tensor([7]))
    with pytest.raises(RuntimeError, match=r"capacity \(-2\) must be >= 0"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(8)], 0.0, torch.ones(1), torch.tensor([8]), None, -2)
    with pytest.raises(RuntimeError, match="ok must be one CPU bool"):
        ops.dgc_accumulate_select_(R, None, [torch.ones(8)], 0.0, torch.ones(1), torch.tensor([8]), torch.ones(2) > 0)
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


# --- zen_ext::dgc_threshold_search against its torch reference (the search loop, also the TP path) -------
def search_loop(sorted_S, consts, v_C, unit_C, t_low, passes=4, **kw):
    """The torch loop (``_reference_dgc.dgc_threshold_search``) on a bucket's search constants."""
    return _reference_dgc.dgc_threshold_search(sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U, v_C,
                                               unit_C, t_low, passes, **kw)


def _search_case(dtype, unit_sizes, density, seed, spread=True):
    """A bucket's samples, constants and candidates as ``thresholds.sampled_thresholds`` builds them."""
    import zen_ext.compress.dgc.units as units

    g = torch.Generator().manual_seed(seed)
    lay = units.Layout(tuple(f"p{i}" for i in range(len(unit_sizes))), tuple(unit_sizes), True, "cpu")
    # Units of very different scales (and heavy tails), as a bucket's layers are.
    R = torch.cat([torch.randn(n, generator=g, dtype=torch.float64) ** 3 * (10.0 ** (i % 5 - 2) if spread else 1.0)
                   for i, n in enumerate(unit_sizes)]).to(dtype)
    pos_S, ns_U = lay.sample_positions(density, 0.01, seed, "cpu")
    samples = R.index_select(0, pos_S).abs()
    k_U = [max(1, math.ceil(density * n)) for n in unit_sizes]
    consts = lay.search_constants(ns_U, k_U, list(unit_sizes), "cpu")
    sorted_S = units.sort_per_unit(samples, consts.unit_S)
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    t_low = at_rank(sorted_S, consts.start_U, consts.ns_U, consts.first_U * units.CANDIDATE_FACTOR).clamp(min=tiny)
    pos_C = lay.select(R, t_low).view(-1).nonzero().flatten()
    v_C = R.index_select(0, pos_C)
    unit_C = torch.searchsorted(lay.unit_ends_N, pos_C, right=True)
    return lay, consts, sorted_S, v_C, unit_C, t_low


@pytest.mark.skipif(not ops.has_dgc_search_op(torch.zeros(1)), reason="needs dgc_threshold_search in the C++ op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("unit_sizes, density", [
    ([4096] * 7, 0.01),                                   # equal units
    ([1, 64, 5000, 65536, 3, 20000], 0.05),                # tiny units (every sample, k = 1) and large ones
    ([262144], 0.001),                                     # one unit (per_bucket selection)
    ([8192, 8192 * 3, 1024] * 20, 0.02),                   # many units
])
@pytest.mark.parametrize("passes", [0, 1, 4])
def test_search_op_equals_the_torch_loop(dtype, unit_sizes, density, passes):
    """Same thresholds and keep mask as the torch loop, after any number of passes (the early stop of a
    unit in the band changes nothing)."""
    lay, consts, sorted_S, v_C, unit_C, t_low = _search_case(dtype, unit_sizes, density, seed=len(unit_sizes))
    want_thr, want_keep = search_loop(sorted_S, consts, v_C, unit_C, t_low, passes)
    thr, keep = ops.dgc_threshold_search(sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U,
                                         v_C, unit_C, t_low, passes)
    assert thr.dtype == dtype and keep.dtype == torch.bool and keep.shape == v_C.shape
    assert torch.equal(thr, want_thr), (thr - want_thr).abs().max()
    assert torch.equal(keep, want_keep)
    if passes == 4 and dtype != torch.bfloat16:  # the search did its job: most units land in the band
        counts = torch.zeros(lay.units, dtype=torch.int64).index_add_(0, unit_C, keep.long()).double()
        in_band = ((counts >= 0.8 * consts.k_U) & (counts <= 1.25 * consts.k_U)).double().mean()
        assert in_band >= 0.5, in_band


@pytest.mark.skipif(not ops.has_dgc_search_op(torch.zeros(1)), reason="needs dgc_threshold_search in the C++ op")
def test_search_op_units_without_candidates_and_no_candidates_at_all():
    """A unit with no candidate keeps t_low or a probe above it and selects nothing; an empty candidate
    list gives every unit a threshold and an empty mask."""
    lay, consts, sorted_S, v_C, unit_C, t_low = _search_case(torch.float32, [4096, 4096, 4096], 0.01, seed=3)
    drop = unit_C != 1  # unit 1 loses its candidates
    args = (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U)
    want = search_loop(sorted_S, consts, v_C[drop], unit_C[drop], t_low)
    got = ops.dgc_threshold_search(*args, v_C[drop], unit_C[drop], t_low, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0][1] >= t_low[1]
    empty = ops.dgc_threshold_search(*args, v_C[:0], unit_C[:0], t_low, 4)
    want = search_loop(sorted_S, consts, v_C[:0], unit_C[:0], t_low)
    assert torch.equal(empty[0], want[0]) and empty[1].numel() == 0


@pytest.mark.skipif(not ops.has_dgc_search_op(torch.zeros(1)), reason="needs dgc_threshold_search in the C++ op")
@pytest.mark.parametrize("pad", [1, 5000])
def test_search_padding_of_a_capacity_buffer_belongs_to_no_unit(pad):
    """Candidates padded as dgc_accumulate_select_ pads them (value 0, unit U): op and torch loop give the
    unpadded thresholds and mask, and never keep the padding (the op does not even scan it)."""
    lay, consts, sorted_S, v_C, unit_C, t_low = _search_case(torch.float32, [4096, 70000, 512], 0.02, seed=9)
    args = (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U)
    want_thr, want_keep = ops.dgc_threshold_search(*args, v_C, unit_C, t_low, 4)
    v_P = torch.cat([v_C, torch.zeros(pad)])
    unit_P = torch.cat([unit_C, torch.full((pad,), lay.units, dtype=torch.int64)])
    for thr, keep in (ops.dgc_threshold_search(*args, v_P, unit_P, t_low, 4),
                      search_loop(sorted_S, consts, v_P, unit_P, t_low)):
        assert torch.equal(thr, want_thr) and torch.equal(keep[: v_C.numel()], want_keep)
        assert not keep[v_C.numel():].any()


@pytest.mark.skipif(not ops.has_dgc_search_op(torch.zeros(1)), reason="needs dgc_threshold_search in the C++ op")
def test_search_op_rejects_mismatched_inputs():
    _, consts, sorted_S, v_C, unit_C, t_low = _search_case(torch.float32, [4096, 4096], 0.01, seed=4)
    args = (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U)
    with pytest.raises(RuntimeError, match="sorted_S, v_C and t_low_U must be 1-D of one floating dtype"):
        ops.dgc_threshold_search(*args, v_C.double(), unit_C, t_low, 4)
    with pytest.raises(RuntimeError, match="unit_C must be int64, unit_C as long as v_C"):
        ops.dgc_threshold_search(*args, v_C, unit_C[1:], t_low, 4)
    with pytest.raises(RuntimeError, match="one entry per unit"):
        ops.dgc_threshold_search(*args, v_C, unit_C, t_low[:1], 4)


# --- dgc_sample_keys / dgc_sort_unkey: the sampling step in two ops -------------------------------------------
needs_sample_op = pytest.mark.skipif(not ops.has_dgc_sample_op(torch.zeros(1)),
                                     reason="needs dgc_sample_keys in the C++ op")


def _sample_oracle(R, U, g_T, m, lay, density, step):
    """The torch path the ops replace: positions, the pending update's value, nan_to_num, the sort key."""
    from zen_ext.compress.dgc.units import sort_per_unit
    pos_S, ns_U = lay.sample_positions(density, 0.01, step, R.device)
    g_S = ops.concat_view(g_T).index_select(0, pos_S)
    delta = g_S if U is None else U.index_select(0, pos_S) * m + g_S
    samples = torch.nan_to_num((R.index_select(0, pos_S) + delta).abs(), nan=0.0)
    grid_S, _, _, unit_S, _ = lay.sample_grid(density, 0.01, R.device)
    return samples, unit_S, ns_U, sort_per_unit(samples, unit_S)


def _sample_case(gdt, numels, seed, specials=True):
    from zen_ext.compress.dgc.units import Layout
    gen = torch.Generator().manual_seed(seed)
    N = sum(numels)
    R = torch.randn(N, generator=gen) * 3
    U = torch.randn(N, generator=gen)
    g = (torch.randn(N, generator=gen) * torch.rand(N, generator=gen) * 10).to(gdt)
    if specials and N > 16:  # NaN, ±inf, ties, ±0 and huge values at the ends and at tensor boundaries
        R[0], R[-1], R[N // 2] = float("nan"), float("inf"), -float("inf")
        R[1:9] = 2.5
        R[2], R[3] = float("inf"), -float("inf")  # in the first unit of (7, 1, 4096): every element sampled
        R[9], R[10] = -0.0, 3.0e38
        g[9], g[10] = 0.0, 3.0e38 if gdt == torch.float32 else 1.0
    g_T = list(g.split(list(numels)))
    lay = Layout(tuple(f"t{i}" for i in range(len(numels))), tuple(numels), True, "cpu")
    return R, U, g_T, lay


@needs_sample_op
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_u", [False, True])
@pytest.mark.parametrize("numels, density", [((1,), 0.5), ((7, 1, 4096), 0.01), ((64 * 33, 5000, 3, 20000), 0.05)])
def test_sample_keys_and_sort_unkey_equal_the_torch_path(gdt, with_u, numels, density):
    """Keys, their order, the decoded values and the candidates' threshold equal the torch path bit for
    bit: every sample position (index 0 and the last of each unit among them, since a unit of 1..8
    elements samples all of it), NaN/±inf/−0/huge values, ties, bf16/fp16 gradients widened."""
    from zen_ext.compress.dgc.units import CANDIDATE_FACTOR, sample_shift
    R, U, g_T, lay = _sample_case(gdt, numels, seed=len(numels))
    U = U if with_u else None
    for step in (0, 1, 977):
        samples, unit_S, ns_U, want_sorted = _sample_oracle(R, U, g_T, 0.9, lay, density, step)
        grid_S, _, stride_U, _, hash_U = lay.sample_grid(density, 0.01, "cpu")
        keys = ops.dgc_sample_keys(R, U, g_T, 0.9, grid_S, unit_S, hash_U, stride_U, sample_shift(step))
        want_keys = (unit_S << 32) | (0x7FFFFFFF - samples.view(torch.int32)).to(torch.int64)
        assert torch.equal(keys, want_keys)
        numel_U = list(lay.unit_numels)
        k_U = [max(1, math.ceil(density * n)) for n in numel_U]
        consts = lay.search_constants(ns_U, k_U, numel_U, "cpu")
        tiny = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
        got_sorted, got_low = ops.dgc_sort_unkey(keys, consts.low_S, tiny, lay.key_bits)
        assert torch.equal(got_sorted.view(torch.int32), want_sorted.view(torch.int32))
        want_low = at_rank(want_sorted, consts.start_U, consts.ns_U, consts.first_U * CANDIDATE_FACTOR).clamp(min=tiny)
        assert torch.equal(got_low, want_low)


@needs_sample_op
def test_sample_keys_read_apart_tensors_and_zero_thresholds():
    """Gradients in separate allocations (not back to back) read like one concatenation; a unit whose
    samples are all zero gets the floor ``tiny`` as its candidates' threshold."""
    from zen_ext.compress.dgc.units import Layout, sample_shift
    numels = (300, 1, 4000)
    lay = Layout(("a", "b", "c"), numels, True, "cpu")
    R = torch.zeros(sum(numels))
    g_T = [torch.zeros(300), torch.full((1,), -2.0), torch.arange(4000, dtype=torch.float32)]
    grid_S, ns_U, stride_U, unit_S, hash_U = lay.sample_grid(0.01, 0.01, "cpu")
    keys = ops.dgc_sample_keys(R, None, g_T, 0.0, grid_S, unit_S, hash_U, stride_U, sample_shift(5))
    pos_S, _ = lay.sample_positions(0.01, 0.01, 5, "cpu")
    want = torch.cat(g_T).index_select(0, pos_S).abs()
    assert torch.equal(keys >> 32, unit_S)
    vals = ops.dgc_sort_unkey(keys, torch.zeros(0, dtype=torch.int64), 0.0, lay.key_bits)[0]
    want_sorted = torch.cat([want[unit_S == u].sort(descending=True).values for u in range(3)])
    assert torch.equal(vals, want_sorted)  # by unit, then descending
    assert torch.equal(ops.dgc_sort_unkey(keys, torch.zeros(0, dtype=torch.int64), 0.0, 64)[0], vals)
    consts = lay.search_constants(ns_U, [3, 1, 40], list(numels), "cpu")
    _, low = ops.dgc_sort_unkey(keys, consts.low_S, 1e-30, lay.key_bits)
    assert low[0].item() == pytest.approx(1e-30) and low[1].item() == 2.0 and low[2].item() > 3000


@needs_sample_op
def test_sample_ops_reject_bad_input():
    from zen_ext.compress.dgc.units import Layout
    lay = Layout(("a",), (100,), True, "cpu")
    grid_S, _, stride_U, unit_S, hash_U = lay.sample_grid(0.1, 0.01, "cpu")
    R, g = torch.zeros(100), [torch.zeros(100)]
    with pytest.raises(RuntimeError, match="R must be a contiguous 1-D float32"):
        ops.dgc_sample_keys(R.double(), None, [g[0].double()], 0.0, grid_S, unit_S, hash_U, stride_U, 0)
    with pytest.raises(RuntimeError, match="the gradients hold 99 elements"):
        ops.dgc_sample_keys(R, None, [torch.zeros(99)], 0.0, grid_S, unit_S, hash_U, stride_U, 0)
    with pytest.raises(RuntimeError, match="sample position 100 outside"):
        ops.dgc_sample_keys(R, None, g, 0.0, grid_S + 100, unit_S, hash_U, stride_U, 0)
    with pytest.raises(RuntimeError, match="shift"):
        ops.dgc_sample_keys(R, None, g, 0.0, grid_S, unit_S, hash_U, stride_U, -1)
    with pytest.raises(RuntimeError, match="must be >= 1"):
        ops.dgc_sample_keys(R, None, g, 0.0, grid_S, unit_S, hash_U, stride_U * 0, 0)
    with pytest.raises(RuntimeError, match="outside"):
        ops.dgc_sort_unkey(torch.zeros(3, dtype=torch.int64), torch.tensor([3]), 0.0, 33)
    with pytest.raises(RuntimeError, match=r"keys must lie in \[0, 2\^33\)"):
        ops.dgc_sort_unkey(torch.tensor([1 << 33]), torch.tensor([0]), 0.0, 33)
    with pytest.raises(RuntimeError, match="key_bits"):
        ops.dgc_sort_unkey(torch.zeros(3, dtype=torch.int64), torch.tensor([0]), 0.0, 0)


@needs_sample_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_equals_isfinite_all(dtype):
    """``dgc_all_finite`` = ``isfinite().all()`` over a list: NaN/±inf at the first and the last element
    of any tensor, empty tensors in the list, the largest finite values (fp16 65504, fp64 1e300 that a
    float32 cast would overflow), and tensors apart in memory."""
    big = torch.finfo(dtype).max
    base = [torch.zeros(0, dtype=dtype), torch.randn(1000, dtype=torch.float64).to(dtype), torch.full((3,), big, dtype=dtype),
            torch.zeros(0, dtype=dtype), torch.randn(77, dtype=torch.float64).to(dtype)]
    got = ops.dgc_all_finite(base)
    assert got.dtype == torch.bool and got.dim() == 0 and bool(got)
    for t in (1, 2, 4):
        for where in (0, -1):
            for bad in (float("nan"), float("inf"), -float("inf")):
                g_T = [x.clone() for x in base]
                g_T[t][where] = bad
                assert not bool(ops.dgc_all_finite(g_T)), (t, where, bad)
                assert bool(ops.dgc_all_finite(g_T)) == bool(torch.cat(g_T).isfinite().all())
    with pytest.raises(ValueError, match="at least one"):
        ops.dgc_all_finite([])
