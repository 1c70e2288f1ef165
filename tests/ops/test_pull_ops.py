"""The fused ZEN pull ops (``csrc/cpu/pull_kernel.cpp``) against the pure-torch reference.

``zen_ext::aggregate_push``, ``encode_pull`` and ``decode_pull_`` must equal
``zen_ext/ops/_reference.py`` bit for bit on adversarial inputs: empty payloads and partitions, a full
partition, position 0 and the last position, duplicates, ``numel`` not a multiple of ``n``, fp32 /
fp64 / bf16 / fp16 values, row form of width ``W``, int32 and int64 positions, and every pull format;
and malformed messages must raise instead of writing out of bounds. A round trip (aggregate → encode
→ decode of every partition) must equal a dense ``index_add_`` of the pushed entries.
"""

from __future__ import annotations

import pytest
import torch

from zen_ext import ops
from zen_ext.core.wire import pack
from zen_ext.ops import _reference

needs_op = pytest.mark.skipif(
    not (ops.HAVE_CPP_OP and hasattr(torch.ops.zen_ext, "decode_pull_")),
    reason="zen_ext._C with the pull ops is not built (pip install -e . builds it)")
KEYS = ops.derive_keys(77)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _payloads(m, width, dtype, idx_dtype, ranks, k, seed, dense_ranks=(), edges=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(ranks):
        shape = (m, width) if width > 1 else (m,)
        if r in dense_ranks and m:
            out.append(pack(torch.randn(shape, generator=g).to(dtype)))
            continue
        kk = 0 if m == 0 else k
        pos = torch.randint(0, max(m, 1), (kk,), generator=g)
        if edges and kk >= 4:
            pos[:4] = torch.tensor([0, m - 1, 0, m - 1])  # first and last position, duplicated
        vals = torch.randn((kk, width) if width > 1 else (kk,), generator=g).to(dtype)
        out.append(pack(pos.to(idx_dtype), vals) if kk else torch.empty(0, dtype=torch.uint8))
    return out


CASES = [
    # (m, width, ranks, k, dense ranks)
    (0, 1, 3, 0, ()),  # an empty partition
    (1, 1, 2, 5, ()),  # one position, hit by every entry
    (1000, 1, 4, 300, ()),
    (1000, 1, 4, 0, ()),  # nobody pushed anything
    (1000, 1, 3, 50, (1,)),  # a dense payload among COO ones
    (64, 1, 2, 200, ()),  # m a multiple of 64: every bit of the last word used
    (65, 3, 3, 40, ()),  # row form, m one past a word
    (777, 4, 2, 2000, (0, 1)),  # only dense payloads: a full bitmap
]


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_aggregate_and_encode_match_reference(dtype, idx_dtype, case):
    m, width, ranks, k, dense = CASES[case]
    isz = torch.empty(0, dtype=idx_dtype).element_size()
    pl = _payloads(m, width, dtype, idx_dtype, ranks, k, seed=case, dense_ranks=dense)
    acc, words, count = torch.ops.zen_ext.aggregate_push(pl, m, width, dtype, isz)
    r_acc, r_words, r_count = _reference.aggregate_push(pl, m, width, dtype, isz)
    assert acc.dtype == _reference.acc_dtype(dtype)
    assert torch.equal(acc, r_acc) and torch.equal(words, r_words) and torch.equal(count, r_count)
    if dense:
        assert int(count) == m
    for fmt in (0, 1, 2):
        for divisor in (1, 3):
            msg = torch.ops.zen_ext.encode_pull(acc, words, int(count), fmt, divisor, dtype, isz)
            ref = _reference.encode_pull(r_acc, r_words, int(r_count), fmt, divisor, dtype, isz)
            assert torch.equal(msg, ref), (fmt, divisor)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aggregate_into_reused_buffers_equals_aggregate(dtype):
    """``aggregate_push_into`` on one workspace reused across every case, largest first, then smaller
    views of it full of the previous case's sums: zeroed by the op, equal to ``aggregate_push``."""
    adt = _reference.acc_dtype(dtype)
    big_acc = torch.full((1000 * 4,), float("nan"), dtype=adt)
    big_words = torch.full((16,), -1, dtype=torch.int64)
    for case in sorted(range(len(CASES)), key=lambda c: -CASES[c][0] * CASES[c][1]):
        m, width, ranks, k, dense = CASES[case]
        pl = _payloads(m, width, dtype, torch.int32, ranks, k, seed=case, dense_ranks=dense)
        acc, words = big_acc[: m * width].view(m, width), big_words[: (m + 63) // 64]
        count = ops.aggregate_push_into(acc, words, pl, width, dtype, 4)
        r_acc, r_words, r_count = torch.ops.zen_ext.aggregate_push(pl, m, width, dtype, 4)
        assert torch.equal(acc, r_acc) and torch.equal(words, r_words) and torch.equal(count, r_count), case


@needs_op
def test_aggregate_into_refuses_wrong_buffers():
    pl = _payloads(100, 1, torch.float32, torch.int32, 2, 10, seed=1)
    with pytest.raises(RuntimeError, match=r"acc must be a contiguous \[part_size, 1\] CPU tensor of Float"):
        ops.aggregate_push_into(torch.zeros(100, 1, dtype=torch.float64), torch.zeros(2, dtype=torch.int64), pl,
                                1, torch.float32, 4)
    with pytest.raises(RuntimeError, match="words must hold 2 contiguous int64 words"):
        ops.aggregate_push_into(torch.zeros(100, 1), torch.zeros(3, dtype=torch.int64), pl, 1, torch.float32, 4)
    with pytest.raises(RuntimeError, match=r"position 100 outside \[0, 100\)"):
        ops.aggregate_push_into(torch.zeros(100, 1), torch.zeros(2, dtype=torch.int64),
                                [pack(torch.tensor([100], dtype=torch.int32), torch.ones(1))], 1, torch.float32, 4)


def _round_trip(numel, n, width, dtype, idt, fmt_of, seed, use_op):
    """Every rank's entries pushed to their servers, aggregated, encoded and decoded; vs index_add_."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty(0, dtype=idt).element_size()
    idx = torch.randint(0, numel, (3 * n + 20,), generator=g)
    idx[:3] = torch.tensor([0, numel - 1, 0])
    vals = torch.randint(-8, 9, (idx.numel(), width) if width > 1 else (idx.numel(),), generator=g).to(dtype)
    want = torch.zeros((numel, width) if width > 1 else numel, dtype=torch.float64)
    want.index_add_(0, idx, vals.to(torch.float64))
    y = ops.permute(idx, numel, KEYS)
    out = torch.full((numel, width) if width > 1 else (numel,), float("nan"), dtype=dtype).zero_()
    agg = torch.ops.zen_ext.aggregate_push if use_op else _reference.aggregate_push
    enc = torch.ops.zen_ext.encode_pull if use_op else _reference.encode_pull
    dec = torch.ops.zen_ext.decode_pull_ if use_op else _reference.decode_pull_
    for part in range(n):
        sel = y % n == part
        m = _reference.part_size(numel, part, n)
        payload = pack((y[sel] // n).to(idt), vals[sel]) if sel.any() else torch.empty(0, dtype=torch.uint8)
        acc, words, count = agg([payload], m, width, dtype, isz)
        msg = enc(acc, words, int(count), fmt_of(part), 1, dtype, isz)
        # Misalign the message: pulled messages sit at any byte offset of a receive buffer.
        shifted = torch.empty(msg.numel() + 1, dtype=torch.uint8)[1:]
        shifted.copy_(msg)
        dec(out, shifted, part, n, KEYS, isz)
    return out, want.to(dtype)


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,n,width", [(1, 1, 1), (2, 3, 1), (4099, 4, 1), (1000, 7, 2), (65, 1, 3), (130, 5, 1)])
def test_round_trip_every_format(dtype, numel, n, width):
    for fmt_of in (lambda p: 0, lambda p: 1, lambda p: 2, lambda p: p % 3):
        got, want = _round_trip(numel, n, width, dtype, torch.int32, fmt_of, seed=numel + n, use_op=True)
        ref, _ = _round_trip(numel, n, width, dtype, torch.int32, fmt_of, seed=numel + n, use_op=False)
        assert torch.equal(got, want)
        assert torch.equal(got, ref)


@needs_op
def test_int64_positions_above_2_pow_31():
    # numel >= 2^31 uses int64 positions on the wire; a sparse decode touches only its own entries.
    # 64 servers: each partition's buffer is 134 MB, not the 2.9 GB of 3 (36 s of zeroing per run).
    numel, n = 2**31 + 11, 64
    y = torch.tensor([0, 5, numel - 1, 2**31 + 2], dtype=torch.int64)
    idx = ops.permute(y, numel, KEYS, inverse=True)
    for part in range(n):
        m = _reference.part_size(numel, part, n)
        sel = y % n == part
        payload = pack(y[sel] // n, torch.arange(1, 1 + int(sel.sum()), dtype=torch.float32))
        if not sel.any():
            continue
        acc, words, count = torch.ops.zen_ext.aggregate_push([payload], m, 1, torch.float32, 8)
        msg = torch.ops.zen_ext.encode_pull(acc, words, int(count), 0, 1, torch.float32, 8)
        assert torch.equal(msg, _reference.encode_pull(acc, words, int(count), 0, 1, torch.float32, 8))
        # Decode into a small window: only check the header/positions path via the reference on a view.
        pos = msg[16:16 + 8 * int(count)].clone().view(torch.int64)
        assert torch.equal(torch.sort(pos).values, torch.sort(y[sel] // n).values)
    assert idx.numel() == 4


@needs_op
def test_malformed_messages_raise():
    out = torch.zeros(100)
    m = _reference.part_size(100, 0, 2)
    payload = pack(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1.0, 2.0]))
    acc, words, count = torch.ops.zen_ext.aggregate_push([payload], m, 1, torch.float32, 4)
    good = torch.ops.zen_ext.encode_pull(acc, words, int(count), 1, 1, torch.float32, 4)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.zen_ext.decode_pull_(out, good[:-1], 0, 2, KEYS, 4)
    bad_count = good.clone()
    bad_count[8:16] = torch.tensor([1], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(RuntimeError):
        torch.ops.zen_ext.decode_pull_(out, bad_count, 0, 2, KEYS, 4)
    coo = torch.ops.zen_ext.encode_pull(acc, words, int(count), 0, 1, torch.float32, 4).clone()
    coo[16:20] = torch.tensor([m], dtype=torch.int32).view(torch.uint8)  # position past the partition
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.zen_ext.decode_pull_(out, coo, 0, 2, KEYS, 4)
    with pytest.raises(RuntimeError, match="position"):
        torch.ops.zen_ext.aggregate_push([pack(torch.tensor([m], dtype=torch.int32), torch.tensor([1.0]))], m, 1,
                                         torch.float32, 4)
    with pytest.raises(RuntimeError, match="neither dense"):
        torch.ops.zen_ext.aggregate_push([torch.zeros(7, dtype=torch.uint8)], m, 1, torch.float32, 4)
    assert torch.equal(out, torch.zeros(100)), "a rejected message writes nothing"


@needs_op
def test_fake_kernels_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pl = [torch.empty(40, dtype=torch.uint8)]
        acc, words, count = torch.ops.zen_ext.aggregate_push(pl, 130, 2, torch.bfloat16, 4)
        assert acc.shape == (130, 2) and acc.dtype == torch.float32 and words.shape == (3,) and count.shape == (1,)
        msg = torch.ops.zen_ext.encode_pull(acc, words, 5, 1, 1, torch.bfloat16, 4)
        assert msg.shape == (16 + 24 + 5 * 2 * 2,)


def test_read_aggregate_count_raises_on_skipped_positions():
    """The CUDA op skips pushed positions outside the partition and counts them in a second word
    (raising there would need a host read of its own); reading the count raises as the CPU op does."""
    assert ops.read_aggregate_count(torch.tensor([7])) == 7
    assert ops.read_aggregate_count(torch.tensor([7, 0])) == 7
    with pytest.raises(RuntimeError, match="2 pushed position"):
        ops.read_aggregate_count(torch.tensor([7, 2]))


@pytest.mark.skipif(not torch.cuda.is_available() or not ops.HAVE_CPP_OP
                    or not torch._C._dispatch_has_kernel_for_dispatch_key("zen_ext::decode_pull_", "CUDA"),
                    reason="needs a GPU and zen_ext._C built with CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_match_cpu(dtype):
    for case in range(len(CASES)):
        m, width, ranks, k, dense = CASES[case]
        pl = _payloads(m, width, dtype, torch.int32, ranks, k, seed=case, dense_ranks=dense)
        if not pl:
            continue
        acc, words, count = torch.ops.zen_ext.aggregate_push(pl, m, width, dtype, 4)
        g_acc, g_words, g_count = torch.ops.zen_ext.aggregate_push([p.cuda() for p in pl], m, width, dtype, 4)
        # CUDA counts [count, positions outside the partition]: none here.
        assert torch.equal(g_words.cpu(), words) and g_count.tolist() == [int(count), 0]
        torch.testing.assert_close(g_acc.cpu(), acc)  # atomics: order of additions differs
        for fmt in (0, 1, 2):
            msg = torch.ops.zen_ext.encode_pull(acc, words, int(count), fmt, 3, dtype, 4)
            g_msg = torch.ops.zen_ext.encode_pull(acc.cuda(), words.cuda(), int(count), fmt, 3, dtype, 4)
            assert torch.equal(g_msg.cpu(), msg)
    # Widths 9 and 64: rows wider than 16 bytes take decode_rows_kernel (a block per 64 slots); the
    # messages are decoded at byte offsets 0, 2 and 5 of a receive buffer, as they arrive.
    for numel, n, width, off in [(4099, 4, 1, 0), (1000, 7, 2, 0), (2, 3, 1, 0), (3001, 3, 9, 2), (700, 5, 64, 5),
                                 (700, 5, 64, 0)]:
        for fmt_of in (lambda p: 0, lambda p: 1, lambda p: 2):
            want, _ = _round_trip(numel, n, width, dtype, torch.int32, fmt_of, seed=1, use_op=True)
            out = torch.zeros_like(want).cuda()
            g = torch.Generator().manual_seed(1)
            # Re-encode on the CPU, decode on the GPU.
            idx = torch.randint(0, numel, (3 * n + 20,), generator=g)
            idx[:3] = torch.tensor([0, numel - 1, 0])
            vals = torch.randint(-8, 9, (idx.numel(), width) if width > 1 else (idx.numel(),), generator=g).to(dtype)
            y = ops.permute(idx, numel, KEYS)
            for part in range(n):
                sel = y % n == part
                m = _reference.part_size(numel, part, n)
                payload = pack((y[sel] // n).to(torch.int32), vals[sel]) if sel.any() else torch.empty(0, dtype=torch.uint8)
                acc, words, count = torch.ops.zen_ext.aggregate_push([payload], m, width, dtype, 4)
                msg = torch.ops.zen_ext.encode_pull(acc, words, int(count), fmt_of(part), 1, dtype, 4)
                buf = torch.zeros(msg.numel() + off, dtype=torch.uint8, device="cuda")
                buf[off:].copy_(msg)
                torch.ops.zen_ext.decode_pull_(out, buf[off:], part, n, KEYS.cuda(), 4)
            assert torch.equal(out.cpu(), want), (numel, n, width, off)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 1001, (3 << 20) + 7])  # the last: several 4 MiB memset chunks
def test_zero_op_zeroes_every_element_and_nothing_beside(dtype, numel):
    base = torch.full((numel + 2,), 3, dtype=dtype)
    view = base[1:-1]  # contiguous, not at the allocation's start
    assert ops.zero_(view) is view
    assert int((view != 0).sum()) == 0
    assert base[0] == 3 and base[-1] == 3


@needs_op
def test_zero_op_on_a_strided_view():
    base = torch.full((6, 8), 5.0)
    ops.zero_(base[:, ::2])
    assert torch.equal(base[:, ::2], torch.zeros(6, 4)) and torch.equal(base[:, 1::2], torch.full((6, 4), 5.0))
