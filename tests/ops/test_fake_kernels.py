"""Every zen_ext op has a fake (meta) kernel (zen_ext/ops/_fake.py) whose output shapes and dtypes are
the CPU op's: ``torch.library.opcheck``'s schema and FakeTensor checks on one real call of each, and a
list that must name every op the library registers (a new op without a fake kernel fails here)."""

from __future__ import annotations

import math

import pytest
import torch

from zen_ext import ops

pytestmark = pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="zen_ext._C is not built")

KEYS = ops.derive_keys(7)


def _coo(pos, vals):
    return torch.cat([torch.tensor(pos, dtype=torch.int32).view(torch.uint8),
                      torch.tensor(vals, dtype=torch.float32).view(torch.uint8)])


def _search_args():
    from tests.ops.test_dgc_ops import _search_case

    lay, consts, sorted_S, v_C, unit_C, t_low = _search_case(torch.float32, [64, 300, 5], 0.05, seed=3)
    return (sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U, v_C, unit_C, t_low, 2)


def _sample_args(with_u: bool):
    from tests.ops.test_dgc_ops import _sample_case

    R, U, g_T, lay = _sample_case(torch.bfloat16, (7, 1, 4096), seed=2)
    grid_S, _, stride_U, unit_S, hash_U = lay.sample_grid(0.01, 0.01, "cpu")
    return (R, U if with_u else None, g_T, 0.9, grid_S, unit_S, hash_U, stride_U, 5)


def _cases():
    """(op name, args) pairs: one real call of every op, its edge cases where the shapes differ."""
    payloads = [_coo([3, 0, 9], [1.0, 2.0, 3.0]), _coo([3], [4.0])]
    acc, words, count = torch.ops.zen_ext.aggregate_push(payloads, 10, 1, torch.float32, 4)
    n = int(count[0])
    msgs = {fmt: torch.ops.zen_ext.encode_pull(acc, words, n, fmt, 1, torch.float32, 4) for fmt in (0, 1, 2)}
    g = torch.Generator().manual_seed(1)
    R, U = torch.randn(20, generator=g), torch.randn(20, generator=g)
    g_T = [torch.randn(12, generator=g), torch.randn(8, generator=g)]
    thr_U, ends_U = torch.tensor([0.5, 1.0]), torch.tensor([10, 20])
    keep_C = torch.tensor([True, False, True, True, False])
    pos_C = torch.tensor([1, 4, 6, 9, 11])
    keys = torch.ops.zen_ext.dgc_sample_keys(*_sample_args(True))
    p = [torch.randn(6, generator=g), torch.randn(3, 2, generator=g).to(torch.bfloat16)]
    # The 4-bit residual of g_T (12 and 8 elements: one block each).
    codes, scales = torch.randint(0, 256, (2 * 128,), dtype=torch.uint8, generator=g), torch.tensor([-1.0, 1, -2, 2])
    e_T, b_T = torch.tensor([12, 20]), torch.tensor([1, 2])
    return [
        ("permute", (torch.tensor([0, 9, 3, 3]), 10, KEYS, False)),
        ("hash_partition", (torch.tensor([0, 9, 3, 3]), 10, 3, KEYS, 3, 2.0, 0.1)),
        ("hash_partition", (torch.empty(0, dtype=torch.int64), 10, 3, KEYS, 3, 2.0, 0.1)),
        ("aggregate_push", (payloads, 10, 1, torch.float32, 4)),
        ("aggregate_push", ([torch.arange(4).to(torch.bfloat16).view(torch.uint8)], 2, 2, torch.bfloat16, 4)),
        ("aggregate_push_into", (torch.zeros(10, 1), torch.zeros(1, dtype=torch.int64), payloads, 1, torch.float32, 4)),
        *[("encode_pull", (acc, words, n, fmt, 2, dt, 4)) for fmt in (0, 1, 2) for dt in (torch.float32, torch.float16)],
        *[("decode_pull_", (torch.zeros(10), msgs[fmt], 0, 1, KEYS, 4)) for fmt in (0, 1, 2)],
        ("zero_", (torch.ones(5),)),
        ("dgc_accumulate_select_", (R.clone(), U.clone(), g_T, 0.9, thr_U, ends_U, None, 8)),
        ("dgc_accumulate_select_", (R.clone(), None, g_T, 0.0, thr_U, ends_U, torch.tensor(True), 0)),
        ("dgc_threshold_search", _search_args()),
        ("dgc_gather_kept", (keep_C, pos_C, torch.randn(5, generator=g), None, torch.tensor([5]))),
        ("dgc_gather_kept", (keep_C, pos_C, torch.randn(5, generator=g).half(), torch.tensor(True), torch.tensor([5]))),
        ("dgc_sample_keys", _sample_args(True)),
        ("dgc_sample_keys", _sample_args(False)),
        ("dgc_sort_unkey", (keys, torch.tensor([0, 3]), 1e-30, 34)),
        ("dgc_int4_select", (codes, scales, U.clone(), g_T, 0.9, True, e_T, b_T, thr_U, ends_U, None, 8)),
        ("dgc_int4_select", (codes, scales, None, [t.half() for t in g_T], 0.0, False, e_T, b_T, thr_U, ends_U,
                             torch.tensor(True), 0)),
        ("dgc_int4_requantize_", (codes.clone(), scales.clone(), U.clone(), g_T, e_T, b_T, thr_U, ends_U, 3, 1)),
        ("dgc_all_finite", ([torch.randn(4, generator=g), torch.tensor([1.0, math.inf])],)),
        ("catch_up_adamw_", (p, [torch.randn_like(t) for t in p], [torch.zeros_like(t) for t in p],
                             [torch.zeros_like(t) for t in p], [torch.zeros(t.shape) for t in p],
                             1e-3, 0.9, 0.95, 1e-8, 0.01, 3, True)),
        ("gather_list", (g_T, torch.tensor([19, 0, 12, 11]))),
        ("quantize_blocks", (torch.randn(300, generator=g), [0, 7, 300], 4, 128)),
        ("quantize_blocks", (torch.randn(9, generator=g).half(), [9], 8, 128)),
        ("dequantize_blocks", (torch.zeros(151, dtype=torch.uint8), torch.ones(4), [0, 7, 300], 4, 128)),
        ("quantize_sent_", (torch.randn(10, generator=g).bfloat16(), torch.tensor([9, 0, 3]), torch.zeros(40),
                            torch.arange(10) * 4, [1, 3], 4, 128)),
        ("quantize_sent_", (torch.randn(10, generator=g), torch.tensor([2, 5]), None, None, [2], 8, 128)),
        ("dequantize_add_blocks_", (torch.zeros(10), torch.zeros(10, dtype=torch.bool), torch.tensor([3, 0, 3]),
                                    torch.zeros(2, dtype=torch.uint8), torch.ones(2), [1, 3], 4, 128)),
        ("quantize_owned_", (torch.randn(10, generator=g), torch.tensor([4, 1, 7]), torch.zeros(10), [2, 3], 4, 128,
                             torch.bfloat16, 3)),
        ("quantize_owned_", (torch.randn(10, generator=g), torch.tensor([4]), None, [1], 8, 128, torch.float32, 1)),
        ("decode_pulls_lowbit_", (torch.zeros(10, dtype=torch.bfloat16), _lowbit_pulls(), KEYS, 4, 4, 128, 2)),
    ]


def _lowbit_pulls():
    """Two owners' low-bit pull messages over 10 elements: owner 0 COO positions 0 and 4, owner 1 a bitmap."""
    from zen_ext.core.wire import pack

    codes, scales, _ = torch.ops.zen_ext.quantize_blocks(torch.tensor([1.5, -2.0]), [2], 4, 128)
    scales = scales.to(torch.bfloat16)  # 4-bit scales travel as bf16 (core/lowbit.py SCALE_BYTES)
    coo = pack(torch.tensor([0, 2], dtype=torch.int64), torch.tensor([0, 4], dtype=torch.int32), scales, codes)
    bitmap = pack(torch.tensor([1, 2], dtype=torch.int64), torch.tensor([0b10001], dtype=torch.int64), scales, codes)
    return [coo, bitmap]


def _library_ops() -> set[str]:
    return {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("zen_ext::")}


def test_every_op_has_a_case_here():
    assert {name for name, _ in _cases()} == _library_ops()


@pytest.mark.parametrize("i", range(len(_cases()) if ops.HAVE_CPP_OP else 0))
def test_fake_kernel_matches_the_cpu_op(i):
    name, args = _cases()[i]
    op = getattr(torch.ops.zen_ext, name).default
    result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_accumulate_select_without_capacity_has_a_data_dependent_size():
    """Without a capacity the candidates' number is known only after the pass: an unbacked size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        R = torch.empty(20)
        pos, val, run, count = torch.ops.zen_ext.dgc_accumulate_select_(
            R, None, [torch.empty(20)], 0.0, torch.empty(2), torch.empty(2, dtype=torch.int64))
    assert isinstance(pos.shape[0], torch.SymInt) and val.shape == pos.shape == run.shape and count.shape == (1,)
    assert pos.dtype == run.dtype == torch.int64 and val.dtype == torch.float32
