"""The fused low-bit ops (zen.dgc.value_bits): ``quantize_sent_`` (the sender's gather, quantize and error
feedback), ``dequantize_add_blocks_`` (the owner's aggregation) and ``quantize_owned_`` (the owner's residual,
quantize and residual update), the CPU op against the pure-torch oracle (``ops/_reference_lowbit.py``) bit for
bit: fp32/bf16/fp16 (and fp64) values, empty input and empty segments, counts on and off the block
boundaries, senders overlapping at the owner (the order of the fp32 adds is part of the result), non-finite
sums (the owner residual keeps its old value), int32 and int64 indices, and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from tests.ops.test_lowbit_ops import _bits32
from zen_ext import ops
from zen_ext.ops import _reference_lowbit as ref

needs_op = pytest.mark.skipif(not ops.has_lowbit_op(torch.zeros(1)), reason="needs the zen_ext C++ op")

# Segment ends: empty, one value, a partial block, exactly one and two blocks, empty segments between,
# and counts one off the block boundaries.
ENDS = [[], [0], [1], [127], [128], [0, 128, 128, 256], [129, 129, 300], [255, 511, 512, 700], [3, 4, 40, 77]]


def _values(K, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, generator=g) * torch.exp(torch.randn(K, generator=g) * scale)
    return x.to(dtype)


def _equal(a, b):
    return torch.equal(_bits32(a), _bits32(b)) if a.dtype == torch.float32 else torch.equal(a, b)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("ends", ENDS, ids=str)
def test_quantize_sent_equals_oracle(dtype, bits, with_residual, ends):
    K = ends[-1] if ends else 0
    g = torch.Generator().manual_seed(K + bits)
    N = K + 5  # the SparseGrad's values: order picks K of them
    values = _values(N, dtype, seed=K)
    order = torch.randperm(N, generator=g)[:K]
    M = 3 * N + 1
    res_pos = torch.randperm(M, generator=g)[:N]
    R0 = torch.randn(M, generator=g)
    got_R, want_R = R0.clone(), R0.clone()
    got = ops.quantize_sent_(values, order, got_R if with_residual else None, res_pos if with_residual else None,
                             ends, bits, 128)
    want = ref.quantize_sent_(values, order, want_R if with_residual else None, res_pos if with_residual else None,
                              ends, bits, 128)
    for a, b in zip(got, want):
        assert _equal(a, b)
    assert _equal(got_R, want_R)
    # It is the unfused sequence: quantize the gathered values, feed back what they lost.
    codes, scales, deq = ref.quantize_blocks(values[order], ends, bits, 128)
    assert torch.equal(got[0], codes) and _equal(got[1], scales) and _equal(got[2], deq)
    if with_residual and K > 2:  # one value a block quantizes exactly: nothing to feed back
        assert not torch.equal(got_R, R0)


@needs_op
def test_quantize_sent_takes_int32_positions_and_float64_values():
    values = _values(300, torch.float64, seed=1)
    order = torch.arange(299, -1, -1)
    res_pos = torch.arange(300, dtype=torch.int32) * 2
    R1, R2 = torch.zeros(600), torch.zeros(600)
    got = ops.quantize_sent_(values, order, R1, res_pos, [100, 300], 4, 128)
    want = ref.quantize_sent_(values, order, R2, res_pos, [100, 300], 4, 128)
    assert all(_equal(a, b) for a, b in zip(got, want)) and _equal(R1, R2)


def _contributions(n, m, bits, seed, dtype=torch.float32):
    """n senders' quantized contributions to an owner of m positions: segment i is sender i's, positions
    unique within it, overlapping across them."""
    g = torch.Generator().manual_seed(seed)
    counts = [int(torch.randint(0, m + 1, (1,), generator=g)) for _ in range(n)]
    if n > 2:
        counts[1] = 0  # an empty sender
    pos = torch.cat([torch.randperm(m, generator=g)[:k] for k in counts]) if n else torch.zeros(0, dtype=torch.int64)
    ends = torch.tensor(counts).cumsum(0).tolist()
    codes, scales, _ = ref.quantize_blocks(_values(sum(counts), dtype, seed), ends, bits, 128)
    return pos, codes, scales, ends


@needs_op
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, m", [(0, 5), (1, 1), (3, 130), (4, 300), (16, 700)])
@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
def test_dequantize_add_blocks_equals_oracle(bits, n, m, idt):
    pos, codes, scales, ends = _contributions(n, m, bits, seed=n * 1000 + m)
    pos = pos.to(idt)
    g = torch.Generator().manual_seed(m)
    acc0 = torch.randn(m, generator=g)  # not zeros: the order of the adds shows
    touched0 = torch.rand(m, generator=g) < 0.1
    a1, t1, a2, t2 = acc0.clone(), touched0.clone(), acc0.clone(), touched0.clone()
    ops.dequantize_add_blocks_(a1, t1, pos, codes, scales, ends, bits, 128)
    ref.dequantize_add_blocks_(a2, t2, pos, codes, scales, ends, bits, 128)
    assert _equal(a1, a2) and torch.equal(t1, t2)
    # The unfused sequence (dequantize, index_add_, index_fill_) gives the same bits.
    a3, t3 = acc0.clone(), touched0.clone()
    if pos.numel():
        a3.index_add_(0, pos.long(), ref.dequantize_blocks(codes, scales, ends, bits, 128))
        t3.index_fill_(0, pos.long(), True)
    assert _equal(a1, a3) and torch.equal(t1, t3)


@needs_op
def test_dequantize_add_blocks_propagates_non_finite_contributions():
    codes, scales, _ = ref.quantize_blocks(torch.tensor([1.0, math.inf, 2.0, 3.0]), [2, 4], 8, 128)
    a1, a2 = torch.zeros(3), torch.zeros(3)
    t1, t2 = torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)
    pos = torch.tensor([0, 1, 1, 2])
    ops.dequantize_add_blocks_(a1, t1, pos, codes, scales, [2, 4], 8, 128)
    ref.dequantize_add_blocks_(a2, t2, pos, codes, scales, [2, 4], 8, 128)
    assert _equal(a1, a2) and torch.isnan(a1[:2]).all() and t1.all()


@needs_op
@pytest.mark.parametrize("applied_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("divisor", [1, 3, 16])
@pytest.mark.parametrize("ends", ENDS, ids=str)
def test_quantize_owned_equals_oracle(applied_dtype, bits, divisor, ends):
    K = ends[-1] if ends else 0
    m = K + 50
    g = torch.Generator().manual_seed(K * 7 + divisor)
    acc = _values(m, torch.float32, seed=K + 1, scale=2.0)
    if m > 10:
        acc[3], acc[7] = math.inf, math.nan  # non-finite sums: the residual keeps its old value there
    pos = torch.randperm(m, generator=g)[:K]
    R0 = torch.randn(m, generator=g) * 0.1
    for residual in (True, False):
        R1, R2 = R0.clone(), R0.clone()
        got = ops.quantize_owned_(acc, pos, R1 if residual else None, ends, bits, 128, applied_dtype, divisor)
        want = ref.quantize_owned_(acc, pos, R2 if residual else None, ends, bits, 128, applied_dtype, divisor)
        assert torch.equal(got[0], want[0]) and _equal(got[1], want[1])
        assert _equal(R1, R2)
        if not residual:
            assert torch.equal(R1, R0)
    # The old residual stays where the sum is not finite, and only the carried positions change.
    if m > 10:
        R1 = R0.clone()
        ops.quantize_owned_(acc, pos, R1, ends, bits, 128, applied_dtype, divisor)
        untouched = torch.ones(m, dtype=torch.bool)
        untouched[pos] = False
        untouched[3] = untouched[7] = True
        assert torch.equal(R1[untouched], R0[untouched])


@needs_op
def test_quantize_owned_keeps_the_casts_rounding_in_the_residual():
    """bf16 gradients: what the owner residual keeps includes the cast of the applied value, so
    s = applied + residual exactly (in fp32 here: the values are chosen so the difference is exact)."""
    acc = torch.tensor([1.0 + 2 ** -10, -3.0, 0.5 + 2 ** -12, 7.0])
    pos = torch.arange(4)
    R = torch.zeros(4)
    codes, scales = ops.quantize_owned_(acc, pos, R, [4], 8, 128, torch.bfloat16, 1)
    deq = ref.dequantize_blocks(codes, scales, [4], 8, 128)
    applied = deq.to(torch.bfloat16).float()
    assert torch.equal(applied + R, acc)


@pytest.mark.parametrize("fn", ["op", "reference"])
def test_bad_arguments_are_refused(fn):
    if fn == "op" and not ops.has_lowbit_op(torch.zeros(1)):
        pytest.skip("needs the zen_ext C++ op")
    lib = torch.ops.zen_ext if fn == "op" else ref
    x = torch.zeros(4)
    with pytest.raises(RuntimeError, match="order"):
        lib.quantize_sent_(x, torch.zeros(4), None, None, [4], 8, 128)
    with pytest.raises(RuntimeError, match="res_pos"):
        lib.quantize_sent_(x, torch.arange(4), torch.zeros(8), torch.arange(3), [4], 8, 128)
    with pytest.raises(RuntimeError, match="residual"):
        lib.quantize_sent_(x, torch.arange(4), torch.zeros(8, dtype=torch.float64), torch.arange(4), [4], 8, 128)
    with pytest.raises(RuntimeError, match="seg_ends"):
        lib.quantize_sent_(x, torch.arange(4), None, None, [3], 8, 128)
    codes, scales, _ = ref.quantize_blocks(x, [4], 4, 128)
    with pytest.raises(RuntimeError, match="touched"):
        lib.dequantize_add_blocks_(torch.zeros(5), torch.zeros(4, dtype=torch.bool), torch.arange(4), codes, scales,
                                   [4], 4, 128)
    with pytest.raises(RuntimeError, match="pos"):
        lib.dequantize_add_blocks_(torch.zeros(5), torch.zeros(5, dtype=torch.bool), torch.arange(3), codes, scales,
                                   [4], 4, 128)
    with pytest.raises(RuntimeError, match="codes"):
        lib.dequantize_add_blocks_(torch.zeros(5), torch.zeros(5, dtype=torch.bool), torch.arange(4), codes[:1],
                                   scales, [4], 4, 128)
    with pytest.raises(RuntimeError, match="acc"):
        lib.quantize_owned_(torch.zeros(5, dtype=torch.float64), torch.arange(4), None, [4], 8, 128, torch.float32, 1)
    with pytest.raises(RuntimeError, match="divisor"):
        lib.quantize_owned_(torch.zeros(5), torch.arange(4), None, [4], 8, 128, torch.float32, 0)
    with pytest.raises(RuntimeError, match="residual"):
        lib.quantize_owned_(torch.zeros(5), torch.arange(4), torch.zeros(4), [4], 8, 128, torch.float32, 1)
    with pytest.raises(RuntimeError, match="bits"):
        lib.quantize_owned_(torch.zeros(5), torch.arange(4), None, [4], 2, 128, torch.float32, 1)


@needs_op
def test_out_of_range_positions_are_refused():
    codes, scales, _ = ref.quantize_blocks(torch.ones(2), [2], 8, 128)
    with pytest.raises(RuntimeError, match="pos"):
        torch.ops.zen_ext.dequantize_add_blocks_(torch.zeros(3), torch.zeros(3, dtype=torch.bool),
                                                 torch.tensor([0, 3]), codes, scales, [2], 8, 128)
    with pytest.raises(RuntimeError, match="pos"):
        torch.ops.zen_ext.quantize_owned_(torch.zeros(3), torch.tensor([-1]), None, [1], 8, 128, torch.float32, 1)
    with pytest.raises(RuntimeError, match="order"):
        torch.ops.zen_ext.quantize_sent_(torch.zeros(3), torch.tensor([5]), None, None, [1], 8, 128)
