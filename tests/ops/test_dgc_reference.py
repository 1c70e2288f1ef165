"""DGC's pure-torch references (``zen_ext/ops/_reference_dgc.py``, what ``zen_ext.ops`` runs where a device
has no kernel) against the C++ ops, bit for bit: ``dgc_accumulate_select_``, ``dgc_threshold_search``,
``dgc_sample_keys`` and ``dgc_sort_unkey`` on adversarial inputs (empty buckets, units and candidate
lists; ties at the threshold; all-equal values; NaN/±inf; index 0 and the last; every memory and
gradient dtype the ops take; capacity-sized buffers as on CUDA), and the whole one-pass DGC path with
every op forced onto its reference."""

from __future__ import annotations

import math

import pytest
import torch

from zen_ext import ops
from zen_ext.compress import DGCSparsifier, NamedGrad
from zen_ext.compress.dgc import thresholds, units
from zen_ext.ops import _reference_dgc as ref

pytestmark = pytest.mark.skipif(not (ops.has_dgc_select_op(torch.zeros(1)) and ops.has_dgc_search_op(torch.zeros(1))
                                     and ops.has_dgc_sample_op(torch.zeros(1))), reason="needs the zen_ext C++ op")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits (NaN and -0.0 compare too)."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# --- dgc_accumulate_select_ ------------------------------------------------------------------------------------
def _bucket(mdt, gdt, sizes, seed, pattern):
    gen = torch.Generator().manual_seed(seed)
    N = sum(sizes)
    R = (torch.randn(N, generator=gen, dtype=torch.float64) * 2).to(mdt)
    U = torch.randn(N, generator=gen, dtype=torch.float64).to(mdt)
    g = (torch.randn(N, generator=gen, dtype=torch.float64) * 3).to(gdt)
    if pattern == "ties":  # |R + g| exactly at the threshold 2 (kept), at index 0 and the last among them
        R.zero_()
        U.zero_()
        g[torch.arange(0, N, 7)] = 2.0
        g[torch.arange(3, N, 11)] = -2.0
        if N:
            g[0], g[-1] = 2.0, -2.0
    elif pattern == "equal":  # every value the same: all candidates or none
        R.fill_(1.0)
        U.fill_(0.0)
        g.fill_(1.0)
    elif pattern == "specials" and N > 4:
        g[1], g[2], g[3] = float("nan"), float("inf"), -float("inf")
        g[-1] = 50.0
    return R, U, list(g.split(list(sizes)))


@pytest.mark.parametrize("mdt, gdt", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                      (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("pattern", ["random", "ties", "equal", "specials"])
@pytest.mark.parametrize("capacity", [-1, 0, 1, 37, 200_000])
def test_accumulate_select_reference_equals_the_op(mdt, gdt, momentum, pattern, capacity):
    sizes = [0, 7001, 1, 0, 65536 + 3, 5]  # empty members; one across the CPU op's 64 K chunks
    R, U, g_T = _bucket(mdt, gdt, sizes, seed=len(pattern), pattern=pattern)
    U = U if momentum is not None else None
    N = R.numel()
    ends_U = torch.tensor([10, 10, 40000, N], dtype=torch.int64)  # an empty run; runs cut across tensors
    thr_U = torch.tensor([2.0, 9.0, 2.0, 2.0], dtype=mdt)
    got = [R.clone(), None if U is None else U.clone()]
    want = [R.clone(), None if U is None else U.clone()]
    out_ref = ref.dgc_accumulate_select_(got[0], got[1], g_T, momentum or 0.0, thr_U, ends_U, None, capacity)
    out_op = torch.ops.zen_ext.dgc_accumulate_select_(want[0], want[1], g_T, momentum or 0.0, thr_U, ends_U, None,
                                                      capacity)
    assert all(_same(a, b) for a, b in zip(out_ref, out_op))
    assert _same(got[0], want[0]) and (U is None or _same(got[1], want[1]))
    if pattern == "ties":  # the ends are candidates, and every tie
        pos = out_op[0][: out_op[3].item()]
        assert capacity == 0 or pos[0] == 0
        if capacity < 0:
            assert pos[-1] == N - 1 and pos.numel() >= N // 7
    if pattern == "equal":  # |R| = 2 everywhere, at the threshold of every non-empty run
        assert out_op[3].item() == N


@pytest.mark.parametrize("ok", [True, False])
@pytest.mark.parametrize("capacity", [-1, 16])
def test_accumulate_select_reference_flag_and_empty_bucket(ok, capacity):
    """``ok`` false writes nothing and finds nothing (padding only); an empty bucket has no candidates."""
    R, U = torch.ones(300), torch.ones(300)
    g = [torch.full((300,), float("nan") if not ok else 1.0)]
    flag = torch.tensor(ok)
    a, b = (R.clone(), U.clone()), (R.clone(), U.clone())
    out_ref = ref.dgc_accumulate_select_(*a, g, 0.5, torch.ones(1), torch.tensor([300]), flag, capacity)
    out_op = torch.ops.zen_ext.dgc_accumulate_select_(*b, g, 0.5, torch.ones(1), torch.tensor([300]), flag, capacity)
    assert all(_same(x, y) for x, y in zip(out_ref, out_op)) and all(_same(x, y) for x, y in zip(a, b))
    assert out_op[3].item() == (300 if ok else 0)
    empty = [ref.dgc_accumulate_select_(torch.zeros(0), None, [torch.zeros(0)], 0.0, torch.ones(1),
                                        torch.zeros(1, dtype=torch.int64), None, capacity),
             torch.ops.zen_ext.dgc_accumulate_select_(torch.zeros(0), None, [torch.zeros(0)], 0.0, torch.ones(1),
                                                      torch.zeros(1, dtype=torch.int64), None, capacity)]
    assert all(_same(x, y) for x, y in zip(*empty))


def test_accumulate_select_reference_rejects_what_the_op_rejects():
    R = torch.zeros(8)
    for g, match in (([torch.ones(7)], "the gradients hold 7 elements, R 8"),
                     ([torch.ones(8, dtype=torch.float64)], r"gradients of torch.float64 with memory of torch.float32")):
        with pytest.raises(RuntimeError, match=match):
            ref.dgc_accumulate_select_(R, None, g, 0.0, torch.ones(1), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="memory of torch.bfloat16"):
        ref.dgc_accumulate_select_(R.bfloat16(), None, [torch.ones(8)], 0.0, torch.ones(1), torch.tensor([8]))
    with pytest.raises(RuntimeError, match=r"capacity \(-2\) must be >= 0"):
        ref.dgc_accumulate_select_(R, None, [torch.ones(8)], 0.0, torch.ones(1), torch.tensor([8]), None, -2)
    assert torch.all(R == 0)


# --- dgc_threshold_search --------------------------------------------------------------------------------------
def _search_case(dtype, unit_sizes, density, seed, equal=False):
    """A bucket's samples, constants and candidates as ``thresholds.sampled_thresholds`` builds them."""
    gen = torch.Generator().manual_seed(seed)
    lay = units.Layout(tuple(f"p{i}" for i in range(len(unit_sizes))), tuple(unit_sizes), True, "cpu")
    if equal:  # every value the same: each count is all or nothing, the probes tie
        R = torch.ones(sum(unit_sizes), dtype=dtype)
    else:  # units of very different scales, heavy tails
        R = torch.cat([torch.randn(n, generator=gen, dtype=torch.float64) ** 3 * 10.0 ** (i % 5 - 2)
                       for i, n in enumerate(unit_sizes)]).to(dtype)
    pos_S, ns_U = lay.sample_positions(density, 0.01, seed, "cpu")
    k_U = [max(1, math.ceil(density * n)) for n in unit_sizes]
    consts = lay.search_constants(ns_U, k_U, list(unit_sizes), "cpu")
    sorted_S = units.sort_per_unit(R.index_select(0, pos_S).abs(), consts.unit_S)
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    t_low = sorted_S.index_select(0, consts.low_S).clamp(min=tiny)
    pos_C, v_C, unit_C = thresholds.candidates(R, lay, t_low)
    return consts, sorted_S, v_C, unit_C, t_low


def _both_searches(consts, sorted_S, v_C, unit_C, t_low, passes, **kw):
    args = (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U, v_C, unit_C, t_low, passes)
    return ref.dgc_threshold_search(*args, **kw), torch.ops.zen_ext.dgc_threshold_search(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("unit_sizes, density, equal", [
    ([4096] * 7, 0.01, False),
    ([1, 64, 5000, 3, 20000], 0.05, False),  # tiny units: every element sampled, k = 1
    ([8192, 1024] * 12, 0.02, False),         # many units
    ([4096, 1, 777], 0.01, True),             # all values equal: ties at every probe
])
@pytest.mark.parametrize("passes", [0, 1, 4, 9])
@pytest.mark.parametrize("mode", ["plain", "early_stop", "all_reduce"])
def test_search_reference_equals_the_op(dtype, unit_sizes, density, equal, passes, mode):
    """Same thresholds and keep masks, whatever the passes; the loop's early stop and a count hook (a
    one-rank TP group's all-reduce) change nothing."""
    case = _search_case(dtype, unit_sizes, density, seed=len(unit_sizes), equal=equal)
    kw = dict(early_stop=mode == "early_stop", all_reduce=(lambda c: None) if mode == "all_reduce" else None)
    (thr_r, keep_r), (thr_o, keep_o) = _both_searches(*case, passes, **kw)
    assert _same(thr_r, thr_o) and torch.equal(keep_r, keep_o)
    if equal:
        assert keep_o.all()


@pytest.mark.parametrize("pad", [0, 1, 5000])
def test_search_reference_empty_units_no_candidates_and_padding(pad):
    """A unit without candidates, no candidates at all, and a capacity buffer's padding (value 0, unit
    U: never kept, not even with a zero lower bound, which would keep a 0 of a unit)."""
    consts, sorted_S, v_C, unit_C, t_low = _search_case(torch.float32, [4096, 4096, 4096], 0.01, seed=3)
    drop = unit_C != 1
    v_P = torch.cat([v_C[drop], torch.zeros(pad)])
    unit_P = torch.cat([unit_C[drop], torch.full((pad,), 3, dtype=torch.int64)])
    zero_last = sorted_S.clone()
    zero_last[int(consts.start_U[-1]):] = 0  # the last unit's threshold 0: its |v| >= 0 holds for the padding too
    for samples, t_floor in ((sorted_S, t_low), (zero_last, torch.zeros_like(t_low))):
        (thr_r, keep_r), (thr_o, keep_o) = _both_searches(consts, samples, v_P, unit_P, t_floor, 4)
        assert _same(thr_r, thr_o) and torch.equal(keep_r, keep_o) and not keep_o[v_P.numel() - pad:].any()
    (thr_r, keep_r), (thr_o, keep_o) = _both_searches(consts, sorted_S, v_C[:0], unit_C[:0], t_low, 4)
    assert _same(thr_r, thr_o) and keep_r.numel() == keep_o.numel() == 0


def test_search_all_reduce_runs_the_loop_through_ops():
    """``ops.dgc_threshold_search`` with ``all_reduce`` (the TP path) calls it once per pass, on the int64
    counts, and gives the op's result where it sums one rank."""
    consts, sorted_S, v_C, unit_C, t_low = _search_case(torch.float32, [4096, 70000, 512], 0.02, seed=9)
    seen = []
    args = (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U, v_C, unit_C, t_low, 4)
    thr, keep = ops.dgc_threshold_search(*args, all_reduce=lambda c: seen.append((c.dtype, c.numel())))
    want = torch.ops.zen_ext.dgc_threshold_search(*args)
    assert seen == [(torch.int64, 3)] * 4 and _same(thr, want[0]) and torch.equal(keep, want[1])


# --- dgc_sample_keys / dgc_sort_unkey --------------------------------------------------------------------------
def _sample_case(gdt, numels, seed, pattern):
    gen = torch.Generator().manual_seed(seed)
    N = sum(numels)
    R, U = torch.randn(N, generator=gen) * 3, torch.randn(N, generator=gen)
    g = (torch.randn(N, generator=gen) * 10).to(gdt)
    if pattern == "specials" and N > 16:  # NaN, ±inf, ties, ±0, huge values, at the ends too
        R[0], R[-1], R[N // 2] = float("nan"), float("inf"), -float("inf")
        R[1:9] = 2.5
        R[9], R[10] = -0.0, 3.0e38
        g[9], g[10] = 0.0, 3.0e38 if gdt == torch.float32 else 1.0
    elif pattern == "equal":
        R.fill_(0.5)
        U.zero_()
        g.fill_(0.5)
    lay = units.Layout(tuple(f"t{i}" for i in range(len(numels))), tuple(numels), True, "cpu")
    return R, U, list(g.split(list(numels))), lay


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_u", [False, True])
@pytest.mark.parametrize("numels, density", [((1,), 0.5), ((7, 1, 4096), 0.01), ((64 * 33, 5000, 3, 20000), 0.05)])
@pytest.mark.parametrize("pattern", ["random", "specials", "equal"])
def test_sample_and_sort_references_equal_the_ops(gdt, with_u, numels, density, pattern):
    R, U, g_T, lay = _sample_case(gdt, numels, seed=len(numels), pattern=pattern)
    U = U if with_u else None
    grid_S, ns_U, stride_U, unit_S, hash_U = lay.sample_grid(density, 0.01, "cpu")
    numel_U = list(lay.unit_numels)
    consts = lay.search_constants(ns_U, [max(1, math.ceil(density * n)) for n in numel_U], numel_U, "cpu")
    tiny = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
    for step in (0, 1, 977):
        shift = units.sample_shift(step)
        keys = torch.ops.zen_ext.dgc_sample_keys(R, U, g_T, 0.9, grid_S, unit_S, hash_U, stride_U, shift)
        assert torch.equal(ref.dgc_sample_keys(R, U, g_T, 0.9, grid_S, unit_S, hash_U, stride_U, shift), keys)
        for low, floor, bits in ((consts.low_S, tiny, lay.key_bits), (consts.low_S, 1e-30, 64)):
            got = ref.dgc_sort_unkey(keys, low, floor, bits)
            want = torch.ops.zen_ext.dgc_sort_unkey(keys, low, floor, bits)
            assert _same(got[0], want[0]) and _same(got[1], want[1])


def test_sort_unkey_reference_on_raw_keys():
    """Keys at the ends of the low 32 bits (NaN and negative bit patterns decode alike), duplicates, and
    no keys at all."""
    keys = torch.tensor([0, 0xFFFFFFFF, (1 << 32) | 5, 0x7FFFFFFF, 0x7FFFFFFF, 3 << 32, 0x80000000], dtype=torch.int64)
    low = torch.tensor([0, 3, 6])
    got, want = ref.dgc_sort_unkey(keys, low, 0.0, 34), torch.ops.zen_ext.dgc_sort_unkey(keys, low, 0.0, 34)
    assert _same(got[0], want[0]) and _same(got[1], want[1])
    none = torch.zeros(0, dtype=torch.int64)
    got, want = ref.dgc_sort_unkey(none, none, 1.0, 33), torch.ops.zen_ext.dgc_sort_unkey(none, none, 1.0, 33)
    assert _same(got[0], want[0]) and _same(got[1], want[1])


# --- the one-pass DGC path with every op on its reference --------------------------------------------------------
DGC_OPS = ("dgc_accumulate_select_", "dgc_threshold_search", "dgc_gather_kept", "dgc_sample_keys", "dgc_sort_unkey",
           "dgc_all_finite", "gather_list")


@pytest.mark.parametrize("dtype, cfg", [
    (torch.float32, dict()),
    (torch.bfloat16, dict(selection="per_bucket", momentum_correction=False)),
    (torch.float16, dict(momentum_masking=False)),
    (torch.float64, dict()),
])
@pytest.mark.parametrize("device_path", ["cpu", "gpu", "overflow"])
def test_sparsifier_on_the_references_sends_what_it_sends_on_the_ops(monkeypatch, dtype, cfg, device_path):
    """Bit for bit the same positions, values, residual and momentum over steps, on the CPU's path
    (candidates sized exactly, the loop may stop early), the GPU's (a capacity-sized buffer, blind
    passes), and with a capacity too small (the selection again); a non-finite step included."""
    if device_path != "cpu":
        monkeypatch.setattr(thresholds, "FREE_HOST_READ_DEVICES", ())
    if device_path == "overflow":
        monkeypatch.setattr(units.Layout, "candidate_capacity", lambda self, k: 5)
    gen = torch.Generator().manual_seed(21)
    sizes = (4096, 1, 30000, 777)
    steps = [torch.randn(sum(sizes), generator=gen, dtype=torch.float64).to(dtype) * (s + 1) for s in range(4)]
    steps[0][[0, -1]] = 1e3  # index 0 and the last, large
    steps[2][5] = float("nan")  # a non-finite step: sent as is, memory untouched

    def run():
        sp = DGCSparsifier(dict(density=0.02, min_numel=1, **cfg))
        sent = []
        for bucket in steps:
            sg = sp.compress([NamedGrad(f"p{i}", v) for i, v in enumerate(bucket.clone().split(sizes))])
            sent.append((sg.indices, sg.values))
            sp.end_step()
            sp.state.step += 1
        return sent, sp.state.state_dict()

    want, want_state = run()
    with ops.force_reference(*DGC_OPS):
        got, got_state = run()
    for (gi, gv), (wi, wv) in zip(got, want):
        assert gi.numel() > 0 and torch.equal(gi, wi) and _same(gv, wv)
    assert _same_nested(got_state, want_state) and "residual" in str(want_state)


def _same_nested(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _same(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_nested(x, y) for x, y in zip(a, b))
    return a == b


def test_force_reference_takes_the_reference_and_restores():
    t = torch.zeros(1)
    assert ops._has_kernel("dgc_sort_unkey", t)
    with ops.force_reference("dgc_sort_unkey"):
        assert not ops._has_kernel("dgc_sort_unkey", t) and ops._has_kernel("dgc_sample_keys", t)
        with ops.force_reference("dgc_sample_keys"):
            assert not ops._has_kernel("dgc_sample_keys", t) and not ops._has_kernel("dgc_sort_unkey", t)
        assert ops._has_kernel("dgc_sample_keys", t)
    assert ops._has_kernel("dgc_sort_unkey", t)
