"""The low-bit value ops' CUDA kernels (``csrc/cuda/lowbit.cu``, ``csrc/cuda/lowbit_fused.cu``) on a GPU, against
the oracle (``ops/_reference_lowbit.py``) run on the same GPU, i.e. the torch ops the schemes ran before the
fusion, bit for bit; the ops without a division or an overlap also against the CPU op. Two documented
CUDA semantics: ``quantize_owned_`` divides as torch does on CUDA (times the fp32 reciprocal), and
``dequantize_add_blocks_`` adds with atomics (overlapping senders: the order of their adds is not fixed,
so there it is held to the CPU op within the sum's rounding). Run on a CUDA machine (docs/kernels.md)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_lowbit_fused import ENDS, _contributions, _equal, _values
from zen_ext import ops
from zen_ext.ops import _reference_lowbit as ref

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="zen_ext._C is not built"),
]


@pytest.fixture(scope="module", autouse=True)
def _require_cuda_kernels():
    if not ops.has_lowbit_op(torch.zeros(1, device="cuda")):
        pytest.fail("zen_ext._C has no CUDA low-bit kernels: rebuild with a CUDA torch (pip install --no-build-isolation -e .)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("ends", ENDS, ids=str)
def test_quantize_and_dequantize_equal_the_cpu_op(dtype, bits, ends):
    x = _values(ends[-1] if ends else 0, dtype, seed=bits)
    cpu = torch.ops.zen_ext.quantize_blocks(x, ends, bits, 128)
    gpu = torch.ops.zen_ext.quantize_blocks(x.cuda(), ends, bits, 128)
    assert all(_equal(a, b.cpu()) for a, b in zip(cpu, gpu))
    back = torch.ops.zen_ext.dequantize_blocks(gpu[0], gpu[1], ends, bits, 128)
    assert _equal(back.cpu(), cpu[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("ends", ENDS, ids=str)
def test_quantize_sent_equals_the_oracle_and_the_cpu_op(dtype, bits, ends):
    K = ends[-1] if ends else 0
    g = torch.Generator().manual_seed(K)
    values = _values(K + 5, dtype, seed=K)
    order = torch.randperm(K + 5, generator=g)[:K]
    res_pos = torch.randperm(3 * K + 16, generator=g)[:K + 5]
    R0 = torch.randn(3 * K + 16, generator=g)
    outs = {}
    for name, fn, dev in (("cpu", torch.ops.zen_ext.quantize_sent_, "cpu"), ("gpu", torch.ops.zen_ext.quantize_sent_, "cuda"),
                          ("oracle", ref.quantize_sent_, "cuda")):
        R = R0.clone().to(dev)
        got = fn(values.to(dev), order.to(dev), R, res_pos.to(dev), ends, bits, 128)
        outs[name] = [t.cpu() for t in got] + [R.cpu()]
    for name in ("cpu", "oracle"):
        assert all(_equal(a, b) for a, b in zip(outs["gpu"], outs[name])), name


@pytest.mark.parametrize("applied_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [1, 3, 16])
@pytest.mark.parametrize("ends", ENDS, ids=str)
def test_quantize_owned_equals_the_oracle_on_the_gpu(applied_dtype, divisor, ends):
    K = ends[-1] if ends else 0
    m = K + 50
    g = torch.Generator().manual_seed(K + divisor)
    acc = _values(m, torch.float32, seed=K + 1, scale=2.0).cuda()
    acc[3], acc[7] = float("inf"), float("nan")
    pos = torch.randperm(m, generator=g)[:K].cuda()
    R0 = (torch.randn(m, generator=g) * 0.1).cuda()
    R1, R2 = R0.clone(), R0.clone()
    got = torch.ops.zen_ext.quantize_owned_(acc, pos, R1, ends, 4, 128, applied_dtype, divisor)
    want = ref.quantize_owned_(acc, pos, R2, ends, 4, 128, applied_dtype, divisor)
    assert torch.equal(got[0], want[0]) and _equal(got[1].cpu(), want[1].cpu()) and _equal(R1.cpu(), R2.cpu())
    if divisor == 1:  # no division: the CPU op's bits too
        R3 = R0.cpu().clone()
        cpu = torch.ops.zen_ext.quantize_owned_(acc.cpu(), pos.cpu(), R3, ends, 4, 128, applied_dtype, divisor)
        assert torch.equal(cpu[0], got[0].cpu()) and _equal(R3, R1.cpu())


@pytest.mark.parametrize("n, m", [(1, 1), (3, 130), (16, 700)])
@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
def test_dequantize_add_blocks_equals_the_cpu_op(n, m, idt):
    pos, codes, scales, ends = _contributions(n, m, 4, seed=n * 1000 + m)
    pos = pos.to(idt)
    acc0 = torch.randn(m, generator=torch.Generator().manual_seed(m))
    a1, t1 = acc0.clone(), torch.zeros(m, dtype=torch.bool)
    torch.ops.zen_ext.dequantize_add_blocks_(a1, t1, pos, codes, scales, ends, 4, 128)
    a2, t2 = acc0.cuda(), torch.zeros(m, dtype=torch.bool, device="cuda")
    torch.ops.zen_ext.dequantize_add_blocks_(a2, t2, pos.cuda(), codes.cuda(), scales.cuda(), ends, 4, 128)
    assert torch.equal(t1, t2.cpu())
    if n == 1:  # one contribution a position: the same single rounding
        assert _equal(a1, a2.cpu())
    else:  # the order of overlapping adds is the atomics' (as torch's CUDA index_add_)
        torch.testing.assert_close(a2.cpu(), a1, rtol=4 * n * 2 ** -24, atol=1e-6)
