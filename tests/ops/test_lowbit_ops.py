"""``zen_ext::quantize_blocks`` / ``dequantize_blocks`` (zen.dgc.value_bits), the CPU op against the pure-torch
reference (``ops/_reference_lowbit.py``) bit for bit, and the reference against the format's rules: empty
input and empty segments, a partial last block, an all-zero block (scale 0), extreme and non-finite values,
every input dtype, 8 and 4 bits, and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from zen_ext import ops
from zen_ext.ops import _reference_lowbit as ref

needs_op = pytest.mark.skipif(not ops.has_lowbit_op(torch.zeros(1)), reason="needs the zen_ext C++ op")


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN as one (a NaN's sign and payload are not part of the format)."""
    return torch.where(torch.isnan(t), torch.tensor(float("nan")), t).view(torch.int32)


def _cases():
    g = torch.Generator().manual_seed(0)
    yield "empty", torch.zeros(0), []
    yield "empty segments", torch.zeros(0), [0, 0, 0]
    yield "one", torch.tensor([-3.0]), [1]
    yield "partial last", torch.randn(300, generator=g), [300]
    yield "segments", torch.randn(1000, generator=g) * 10, [0, 129, 129, 500, 1000]
    yield "odd segments", torch.randn(77, generator=g), [3, 4, 40, 77]
    z = torch.randn(384, generator=g)
    z[128:256] = 0
    yield "zero block", z, [384]
    yield "extremes", torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, 1.0, 65504.0]), [8]
    yield "tiny block", torch.tensor([1e-45, -1e-45, 2e-45]), [3]
    yield "inf", torch.tensor([1.0, math.inf, 2.0, 3.0]), [2, 4]
    yield "nan", torch.tensor([1.0, 2.0, math.nan, 3.0, 4.0]), [5]
    yield "ties", torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 7.0]), [6]


CASES = list(_cases())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [128, 4])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_reference_rules(bits, block, case):
    _, x, ends = CASES[case]
    codes, scales, deq = ref.quantize_blocks(x, ends, bits, block)
    _, code, blk = ref.layout(ends, bits, block)
    assert codes.numel() == code[-1] and scales.numel() == blk[-1] and deq.dtype == torch.float32
    assert torch.equal(_bits32(ref.dequantize_blocks(codes, scales, ends, bits, block)), _bits32(deq))
    qmax = ref.QMAX[bits]
    # Per block: scale = amax / qmax (at 4 bits rounded up to bf16); |x - x̂| <= scale / 2 where the scale
    # quantizes; 0 where it is 0.
    elem = [0] + list(ends)
    for s in range(len(ends)):
        for j, b0 in enumerate(range(elem[s], elem[s + 1], block)):
            xb = x[b0: min(b0 + block, elem[s + 1])].float()
            sc = scales[blk[s] + j]
            if torch.isnan(xb).any() or torch.isinf(xb).any():
                assert not math.isfinite(sc.item()) and torch.isnan(deq[b0: b0 + xb.numel()]).all()
                continue
            exact = xb.abs().max() / qmax
            assert sc.item() == ref.wire_scale(exact.reshape(1), bits).item()
            if bits == 4:  # truncated to bf16: what travels is what every rank decodes with
                assert sc.item() == sc.to(torch.bfloat16).float().item() and sc <= exact
                assert sc > exact * (1 - 2 ** -7) or exact < 2 ** -126
            db = deq[b0: b0 + xb.numel()]
            if sc.item() == 0:
                assert torch.equal(_bits32(db), _bits32(torch.zeros_like(db)))  # +0.0, never -0.0
            else:
                assert ((xb - db).abs() <= sc / 2 * (1 + 1e-6)).all()
                assert (db.abs() <= xb.abs().max() * (1 + 1e-6)).all()  # qmax·(amax/qmax) may round up by an ulp
    assert not (_bits32(deq) == _bits32(torch.tensor(-0.0))).any()


def test_four_bit_scales_truncate_to_bf16():
    # 3 / 7 = 0.428571... in fp32; truncated to bf16 (8 significant bits): 219 / 512 = 0.427734375. x = 3 then
    # codes to rint(7.014) = 7, decoded 7 · 0.427734375 = 2.994140625 exactly (at or below amax: no overflow);
    # 7 / 7 = 1 is exact. At the fp32 maximum the 4-bit values stay finite.
    x = torch.tensor([3.0, 1.0, 0.5, 0.0, -7.0, 0.0, 0.0, 0.0])
    codes, scales, deq = ref.quantize_blocks(x, [8], 4, 4)
    assert scales.tolist() == [0.427734375, 1.0]
    assert deq.tolist() == [2.994140625, 0.85546875, 0.427734375, 0.0, -7.0, 0.0, 0.0, 0.0]
    _, scales8, _ = ref.quantize_blocks(x, [8], 8, 4)  # 8 bits keep the exact fp32 scale
    assert scales8[0].item() == (torch.tensor(3.0) / 127).item()
    big = torch.tensor([3.4e38, -3.4e38])
    _, _, deq = ref.quantize_blocks(big, [2], 4, 2)
    assert torch.isfinite(deq).all() and (deq.abs() <= 3.4e38).all()


def test_reference_ties_to_even_and_exact_codes():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 7.0])  # scale 1 at 4 bits
    codes, scales, deq = ref.quantize_blocks(x, [6], 4, 128)
    assert scales.tolist() == [1.0]
    assert deq.tolist() == [0.0, 2.0, 2.0, 0.0, -2.0, 7.0]
    assert codes.tolist() == [(0 + 8) | (2 + 8) << 4, (2 + 8) | (0 + 8) << 4, (-2 + 8) | (7 + 8) << 4]
    codes, _, deq = ref.quantize_blocks(torch.tensor([-127.0, 3.0, 127.0]), [3], 8, 128)
    assert codes.view(torch.int8).tolist() == [-127, 3, 127] and deq.tolist() == [-127.0, 3.0, 127.0]


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [128, 256, 6])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_cpu_op_equals_reference(dtype, bits, block, case):
    _, x, ends = CASES[case]
    x = x.to(dtype)
    got = torch.ops.zen_ext.quantize_blocks(x, ends, bits, block)
    want = ref.quantize_blocks(x, ends, bits, block)
    assert torch.equal(got[0], want[0])
    assert torch.equal(_bits32(got[1]), _bits32(want[1]))
    assert torch.equal(_bits32(got[2]), _bits32(want[2]))
    back = torch.ops.zen_ext.dequantize_blocks(got[0], got[1], ends, bits, block)
    assert torch.equal(_bits32(back), _bits32(want[2]))


@needs_op
@pytest.mark.parametrize("bits", [8, 4])
def test_cpu_op_random_segments_equal_reference(bits):
    g = torch.Generator().manual_seed(bits)
    for trial in range(20):
        K = int(torch.randint(0, 3000, (1,), generator=g))
        cuts = sorted(torch.randint(0, K + 1, (int(torch.randint(0, 17, (1,), generator=g)),), generator=g).tolist())
        ends = cuts + [K]
        x = torch.randn(K, generator=g) * torch.exp(torch.randn(K, generator=g) * 3)
        got = ops.quantize_blocks(x, ends, bits, 128)
        want = ref.quantize_blocks(x, ends, bits, 128)
        assert torch.equal(got[0], want[0]), trial
        assert torch.equal(_bits32(got[1]), _bits32(want[1])) and torch.equal(_bits32(got[2]), _bits32(want[2])), trial


@pytest.mark.parametrize("fn", ["op", "reference"])
def test_bad_arguments_are_refused(fn):
    if fn == "op" and not ops.has_lowbit_op(torch.zeros(1)):
        pytest.skip("needs the zen_ext C++ op")
    q = torch.ops.zen_ext.quantize_blocks if fn == "op" else ref.quantize_blocks
    with pytest.raises(RuntimeError, match="bits"):
        q(torch.zeros(4), [4], 2, 128)
    with pytest.raises(RuntimeError, match="block"):
        q(torch.zeros(4), [4], 8, 7)
    with pytest.raises(RuntimeError, match="seg_ends"):
        q(torch.zeros(4), [3], 8, 128)
    with pytest.raises(RuntimeError, match="seg_ends"):
        q(torch.zeros(4), [3, 2, 4], 8, 128)
    dq = torch.ops.zen_ext.dequantize_blocks if fn == "op" else ref.dequantize_blocks
    with pytest.raises(RuntimeError, match="codes"):
        dq(torch.zeros(3, dtype=torch.uint8), torch.zeros(1), [4], 4, 128)
    with pytest.raises(RuntimeError, match="scales"):
        dq(torch.zeros(2, dtype=torch.uint8), torch.zeros(2), [4], 4, 128)
