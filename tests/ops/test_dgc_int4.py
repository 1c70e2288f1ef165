"""DGC's 4-bit residual ops (``dgc_int4_select``, ``dgc_int4_requantize_``; csrc/cpu/dgc_int4.cpp,
csrc/cuda/dgc_int4.cu) against their torch oracle (zen_ext/ops/_reference_dgc.py), bit for bit; the
quantization's error bound per block; edge cases (constant blocks, zeros, sizes not a multiple of the
block, empty tensors, more than 2^24 elements). The CUDA variant compares the CUDA op with the CPU op
and runs only on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from zen_ext import ops
from zen_ext.compress.dgc.int4 import INT4_BLOCK, Int4Layout, dequantize, quantize
from zen_ext.ops import _reference_dgc as ref

B = INT4_BLOCK
CPU_OP = pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="zen_ext._C is not built")


def _case(numels, gdt, seed, runs=None, momentum=True):
    """A random residual (codes, scales of sorted pairs), gradients, velocity, per-run thresholds."""
    g = torch.Generator().manual_seed(seed)
    q = Int4Layout(tuple(numels), "cpu")
    codes = torch.randint(0, 256, (q.blocks * B // 2,), dtype=torch.uint8, generator=g)
    scales = (torch.randn(q.blocks, 2, generator=g) * 0.5).sort(1).values.flatten().contiguous()
    g_T = [torch.randn(n, generator=g).to(gdt) for n in numels]
    U = torch.randn(sum(numels), generator=g) if momentum else None
    total = sum(numels)
    ends_U = torch.tensor(runs if runs is not None else [total], dtype=torch.int64)
    thr_U = torch.rand(ends_U.numel(), generator=g) + 0.8
    return q, codes, scales, g_T, U, thr_U, ends_U


def _clone(x):
    return None if x is None else x.clone()


def _run_both(select, requantize, case, mode, capacity, ok, flush, seed=-1):
    q, codes, scales, g_T, U, thr_U, ends_U = case
    c, s, u = codes.clone(), scales.clone(), _clone(U) if mode != "grad" else None
    got = select(c, s, u, g_T, 0.9, mode == "update", q.ends_T, q.blocks_T, thr_U, ends_U, ok, capacity)
    requantize(c, s, u, g_T, q.ends_T, q.blocks_T, thr_U, ends_U, *flush, seed)
    return got, c, s, u


@CPU_OP
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["update", "velocity", "grad"])
@pytest.mark.parametrize("capacity", [-1, 7, 100000])
def test_cpu_op_equals_the_oracle(gdt, mode, capacity):
    # Tensors of 1, B-1, B, B+1 and 3000 elements; runs cutting through tensors and blocks.
    numels = [1000, 1, B - 1, B, B + 1, 3000]
    total = sum(numels)
    case = _case(numels, gdt, seed=3, runs=[700, 1300, total])
    for flush, seed in [((0, 0), -1), ((7, 3), -1), ((0, 0), 12345), ((5, 0), (1 << 31) - 1)]:
        ref_out = _run_both(ref.dgc_int4_select, ref.dgc_int4_requantize_, case, mode, capacity, None, flush, seed)
        op_out = _run_both(torch.ops.zen_ext.dgc_int4_select, torch.ops.zen_ext.dgc_int4_requantize_, case, mode,
                           capacity, None, flush, seed)
        (r_sel, r_c, r_s, r_u), (o_sel, o_c, o_s, o_u) = ref_out, op_out
        for a, b in zip(r_sel, o_sel):
            assert torch.equal(a, b)
        assert torch.equal(r_c, o_c) and torch.equal(r_s, o_s)
        assert (r_u is None and o_u is None) or torch.equal(r_u, o_u)
        assert int(r_sel[3]) > 100  # the case selects something


@CPU_OP
def test_false_flag_writes_nothing():
    q, codes, scales, g_T, U, thr_U, ends_U = _case([500, 300], torch.float32, seed=4)
    for select in (ref.dgc_int4_select, torch.ops.zen_ext.dgc_int4_select):
        u = U.clone()
        pos, val, run, count = select(codes, scales, u, g_T, 0.9, True, q.ends_T, q.blocks_T, thr_U, ends_U,
                                      torch.tensor(False), 4)
        assert torch.equal(u, U) and int(count) == 0
        assert pos.tolist() == [800] * 4 and run.tolist() == [1] * 4 and not val.any()


def _quantize_with_op(x: torch.Tensor, op) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized by the requantize op: a zero residual plus ``x`` as the gradient, nothing sent."""
    q = Int4Layout((x.numel(),), "cpu")
    codes = torch.zeros(q.blocks * B // 2, dtype=torch.uint8)
    scales = torch.zeros(2 * q.blocks)
    op(codes, scales, None, [x], q.ends_T, q.blocks_T, torch.tensor([math.inf]), torch.tensor([x.numel()]), 0, 0)
    return codes, scales


def _check_bound(x: torch.Tensor, codes, scales):
    back = dequantize(codes, scales, x.numel())
    assert torch.isfinite(back).all()
    nb = scales.numel() // 2
    pad = nb * B - x.numel()
    xp = torch.cat([x, x[-1:].expand(pad)]).view(nb, B)
    lo, hi = xp.amin(1), xp.amax(1)
    assert torch.equal(scales.view(nb, 2)[:, 0], lo) and torch.equal(scales.view(nb, 2)[:, 1], hi)
    err = (torch.cat([x - back, torch.zeros(pad)]).view(nb, B)).abs().amax(1)
    # (Δ − δ)/30, plus the fp32 roundings of the scale, the product and the sum (a few ulps of the range).
    bound = (hi - lo) / 30 + 4 * torch.finfo(torch.float32).eps * torch.maximum(hi.abs(), lo.abs())
    assert (err <= bound).all(), (err - bound).max()
    return back


@pytest.mark.parametrize("numel", [1, B - 1, B, 5 * B + 17, 70000])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_quantization_error_is_at_most_a_thirtieth_of_the_block_range(numel, scale):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * scale
    x[::97] *= 50  # outliers widen some blocks
    codes, scales = quantize(x)
    _check_bound(x, codes, scales)
    if ops.HAVE_CPP_OP:  # the op quantizes the same way
        c2, s2 = _quantize_with_op(x, torch.ops.zen_ext.dgc_int4_requantize_)
        assert torch.equal(codes, c2) and torch.equal(scales, s2)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    """``seed ≥ 0``: each value lands on one of its two neighbouring levels (at most (Δ − δ)/15 off), up
    with the probability of its fraction: the mean over seeds converges to the value."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4 * B, generator=g)
    q = Int4Layout((x.numel(),), "cpu")
    backs = []
    for seed in range(200):
        codes = torch.zeros(q.blocks * B // 2, dtype=torch.uint8)
        scales = torch.zeros(2 * q.blocks)
        ref.dgc_int4_requantize_(codes, scales, None, [x], q.ends_T, q.blocks_T, torch.tensor([math.inf]),
                                 torch.tensor([x.numel()]), 0, 0, seed)
        backs.append(dequantize(codes, scales, x.numel()))
    backs = torch.stack(backs)
    s = scales.view(-1, 2)
    step = ((s[:, 1] - s[:, 0]) / 15).repeat_interleave(B)
    assert ((backs - x).abs() <= step * (1 + 1e-5)).all()
    # The mean of 200 draws: within 4 standard errors (step/2/sqrt(200)) of x; nearest rounding is biased.
    assert ((backs.mean(0) - x).abs() <= 4 * step / 2 / math.sqrt(200)).all()
    near = _quantize_with_op(x, ref.dgc_int4_requantize_)
    assert (dequantize(*near, x.numel()) - x).abs().mean() > (backs.mean(0) - x).abs().mean() * 3


@pytest.mark.parametrize("value", [0.0, 1.5, -3e-5])
def test_constant_blocks_and_zeros_come_back_exactly(value):
    x = torch.full((3 * B + 5,), value)
    x[B:2 * B] = 0.0  # a zero block between constant ones
    for op in [ref.dgc_int4_requantize_] + ([torch.ops.zen_ext.dgc_int4_requantize_] if ops.HAVE_CPP_OP else []):
        codes, scales = _quantize_with_op(x, op)
        assert not codes.any()  # every code 0: min is the value
        assert torch.equal(dequantize(codes, scales, x.numel()), x)


def test_extreme_ranges_stay_finite():
    # A subnormal range (15/range overflows: the factor is capped; the step (range/15) rounds to a few
    # subnormals, so the error is bounded by the range itself, 1e-44) and ranges near the fp32 limit.
    tiny = torch.tensor([0.0, 1e-44, 3e-45] * 100)
    codes, scales = quantize(tiny)
    back = dequantize(codes, scales, tiny.numel())
    assert torch.isfinite(back).all() and ((tiny - back).abs() <= 1e-44).all()
    for x in [torch.tensor([-1e38, 1e38, 0.5] * 100), torch.tensor([3e38, 3.4e38] * 100)]:
        codes, scales = quantize(x)
        back = dequantize(codes, scales, x.numel())
        assert torch.isfinite(back).all() and torch.isfinite(scales).all()
        assert ((x - back).abs() <= (x.max() - x.min()) / 30 * (1 + 1e-5)).all()


@CPU_OP
def test_empty_tensors_and_an_empty_bucket():
    numels = [0, 300, 0, 5]
    case = _case(numels, torch.float32, seed=5)
    ref_out = _run_both(ref.dgc_int4_select, ref.dgc_int4_requantize_, case, "update", -1, None, (0, 0))
    op_out = _run_both(torch.ops.zen_ext.dgc_int4_select, torch.ops.zen_ext.dgc_int4_requantize_, case, "update", -1,
                       None, (0, 0))
    for a, b in zip(ref_out[0], op_out[0]):
        assert torch.equal(a, b)
    assert torch.equal(ref_out[1], op_out[1]) and torch.equal(ref_out[2], op_out[2])
    # A bucket of empty tensors: no blocks, no candidates.
    q = Int4Layout((0, 0), "cpu")
    codes, scales = torch.zeros(0, dtype=torch.uint8), torch.zeros(0)
    g_T = [torch.zeros(0), torch.zeros(0)]
    out = torch.ops.zen_ext.dgc_int4_select(codes, scales, None, g_T, 0.0, False, q.ends_T, q.blocks_T,
                                            torch.tensor([1.0]), torch.tensor([0]), None, 3)
    assert out[0].tolist() == [0, 0, 0] and int(out[3]) == 0
    torch.ops.zen_ext.dgc_int4_requantize_(codes, scales, None, g_T, q.ends_T, q.blocks_T, torch.tensor([1.0]),
                                           torch.tensor([0]), 0, 0)


@CPU_OP
def test_bad_inputs_are_refused():
    q, codes, scales, g_T, U, thr_U, ends_U = _case([300], torch.float32, seed=6)
    with pytest.raises(RuntimeError, match="code bytes"):
        torch.ops.zen_ext.dgc_int4_select(codes[:-1], scales, None, g_T, 0.0, False, q.ends_T, q.blocks_T, thr_U,
                                          ends_U, None, -1)
    with pytest.raises(RuntimeError, match="ends_T/blocks_T"):
        torch.ops.zen_ext.dgc_int4_requantize_(codes, scales, None, g_T, q.ends_T + 1, q.blocks_T, thr_U, ends_U, 0, 0)
    with pytest.raises(RuntimeError, match="flush_phase"):
        torch.ops.zen_ext.dgc_int4_requantize_(codes, scales, None, g_T, q.ends_T, q.blocks_T, thr_U, ends_U, 4, 4)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.zen_ext.dgc_int4_select(codes, scales, None, [g_T[0].double()], 0.0, False, q.ends_T, q.blocks_T,
                                          thr_U, ends_U, None, -1)


@CPU_OP
def test_more_than_2_pow_24_elements():
    # Positions past 2^24 (where fp32 stops counting exactly) and one tensor of 2^24 + 300 elements.
    n = (1 << 24) + 300
    g = torch.Generator().manual_seed(9)
    q = Int4Layout((n,), "cpu")
    codes = torch.zeros(q.blocks * B // 2, dtype=torch.uint8)
    scales = torch.zeros(2 * q.blocks)
    grad = torch.zeros(n)
    hot = torch.tensor([0, 5, 1 << 24, (1 << 24) + 1, n - 1])
    grad[hot] = 10.0
    grad += torch.rand(n, generator=g)  # below the threshold
    thr, ends = torch.tensor([5.0]), torch.tensor([n])
    pos, val, _, count = torch.ops.zen_ext.dgc_int4_select(codes, scales, None, [grad], 0.0, False, q.ends_T,
                                                           q.blocks_T, thr, ends, None, -1)
    assert pos.tolist() == hot.tolist() and torch.equal(val, grad[hot])
    torch.ops.zen_ext.dgc_int4_requantize_(codes, scales, None, [grad], q.ends_T, q.blocks_T, thr, ends, 0, 0)
    back = ref.dgc_int4_gather(codes, scales, q.ends_T, q.blocks_T, hot)
    assert back.tolist() == [0.0] * 5  # sent (fp32: exactly), kept 0
    tail = torch.arange((1 << 24) + 2, n - 1)  # past the hot ones
    err = (ref.dgc_int4_gather(codes, scales, q.ends_T, q.blocks_T, tail) - grad[tail]).abs()
    assert err.max() <= 1 / 30 + 1e-6


def test_gather_equals_the_block_dequantization():
    q, codes, scales, g_T, U, thr_U, ends_U = _case([1000, 1, B, 777], torch.float32, seed=8)
    full = torch.cat([ref.int4_dequantize(codes, scales, b0, nb, n) for _, b0, n, nb in ref._int4_tensors(g_T)])
    pos = torch.randperm(full.numel())[:500]
    assert torch.equal(ops.dgc_int4_gather(codes, scales, q.ends_T, q.blocks_T, pos), full[pos])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["update", "velocity", "grad"])
def test_cuda_op_equals_the_cpu_op(gdt, mode):
    numels = [1000, 1, B - 1, B, B + 1, 30000]
    total = sum(numels)
    case = _case(numels, gdt, seed=11, runs=[700, 1300, total])
    cuda_case = tuple(None if x is None else ([t.cuda() for t in x] if isinstance(x, list) else
                                              (x if isinstance(x, Int4Layout) else x.cuda())) for x in case)
    q = Int4Layout(tuple(numels), "cuda")
    cuda_case = (q, *cuda_case[1:])
    ok = torch.tensor(True)
    for capacity, flush in [(50, (0, 0)), (total, (9, 4))]:
        cpu = _run_both(torch.ops.zen_ext.dgc_int4_select, torch.ops.zen_ext.dgc_int4_requantize_, case, mode,
                        capacity, ok, flush)
        gpu = _run_both(torch.ops.zen_ext.dgc_int4_select, torch.ops.zen_ext.dgc_int4_requantize_, cuda_case, mode,
                        capacity, ok.cuda(), flush)
        for a, b in zip(cpu[0], gpu[0]):
            assert torch.equal(a, b.cpu())
        for a, b in zip(cpu[1:], gpu[1:]):
            assert (a is None and b is None) or torch.equal(a, b.cpu())
