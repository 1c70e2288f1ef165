"""``zen_ext::decode_pulls_lowbit_`` (zen.dgc.value_bits' pull, ``core/zen_lowbit.py`` step 5): the CPU op
against its pure-torch oracle (``ops/_reference_lowbit.py``) bit for bit, and the oracle against a direct
computation (each carried value ``q · scale / divisor``, cast, at ``P⁻¹(p·n + i)``, the values in ascending
order of those indices): every format (COO in
int32 and int64 positions, hash bitmap, dense), 8 and 4 bits, partial and several blocks, owners that carry
nothing, empty messages, index 0 and the last, non-power-of-two and size-1 worlds, unaligned messages,
fp32/bf16/fp16 results, a divisor (mean), and malformed messages refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from zen_ext import ops
from zen_ext.core.wire import pack
from zen_ext.ops import _reference as R
from zen_ext.ops import _reference_lowbit as ref

KEYS = ops.derive_keys(7)
needs_op = pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="needs the zen_ext C++ op")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _messages(numel, n, bits, block, fmt_of, idt, seed, density=0.3):
    """Every owner's pull message (positions drawn per owner, index 0 and the last always among the
    carried ones when their owner carries COO or bitmap) and the expected fp64 value at every index."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty(0, dtype=idt).element_size()
    want = {}  # global index -> (code, scale) of what the owner sent
    msgs = []
    first_last = ops.permute(torch.tensor([0, numel - 1]), numel, KEYS)
    for i in range(n):
        m, fmt = R.part_size(numel, i, n), fmt_of(i)
        if fmt == R.FMT_DENSE:
            pos = torch.arange(m)
        else:
            keep = torch.rand(m, generator=g) < density
            for y in first_last.tolist():
                if y % n == i:
                    keep[y // n] = True
            pos = keep.nonzero().flatten()
        # The owner sends its sums in ascending global-index order (core/zen_lowbit.py, step 4).
        pos = pos[torch.argsort(ops.permute(pos * n + i, numel, KEYS, inverse=True))]
        k = pos.numel()
        vals = torch.randn(k, generator=g) * 3
        codes, scales, deq = ref.quantize_blocks(vals, [k], bits, block)
        if fmt == R.FMT_BITMAP:
            mask = torch.zeros(m, dtype=torch.bool)
            mask[pos] = True
            index = R.mask_to_words(mask)
        elif fmt == R.FMT_COO:
            index = pos.to(idt)
        else:
            index = torch.empty(0, dtype=torch.uint8)
        msg = pack(torch.tensor([fmt, k], dtype=torch.int64), index, scales.to(ref.SCALE_DTYPE[bits]), codes)
        # Pulled messages sit at any byte offset of a receive buffer: misalign each.
        shifted = torch.empty(msg.numel() + 1, dtype=torch.uint8)[1:]
        shifted.copy_(msg)
        msgs.append(shifted)
        gidx = ops.permute(pos * n + i, numel, KEYS, inverse=True)
        for j, gi in enumerate(gidx.tolist()):
            want[gi] = deq[j]
    return msgs, want, isz


def _direct(numel, want, divisor, dtype):
    out = torch.zeros(numel, dtype=dtype)
    for gi, v in want.items():
        out[gi] = (v / divisor if divisor != 1 else v).to(dtype)
    return out


FMTS = {"coo": lambda i: R.FMT_COO, "bitmap": lambda i: R.FMT_BITMAP, "dense": lambda i: R.FMT_DENSE,
        "mixed": lambda i: (R.FMT_COO, R.FMT_BITMAP, R.FMT_DENSE)[i % 3]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("numel,n,block", [(1, 1, 128), (2, 3, 128), (1000, 5, 4), (4099, 4, 128), (777, 1, 6)])
def test_oracle_equals_direct_and_op_equals_oracle(dtype, bits, fmt, numel, n, block):
    for divisor, idt in ((1, torch.int32), (n, torch.int64)):
        msgs, want, isz = _messages(numel, n, bits, block, FMTS[fmt], idt, seed=numel + n + bits)
        expect = _direct(numel, want, divisor, dtype)
        got_ref = torch.zeros(numel, dtype=dtype)
        ref.decode_pulls_lowbit_(got_ref, msgs, KEYS, isz, bits, block, divisor)
        assert torch.equal(got_ref.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expect.view(torch.int16 if dtype != torch.float32 else torch.int32))
        if ops.HAVE_CPP_OP:
            got = torch.zeros(numel, dtype=dtype)
            torch.ops.zen_ext.decode_pulls_lowbit_(got, msgs, KEYS, isz, bits, block, divisor)
            assert torch.equal(got, got_ref)


@needs_op
def test_above_2_pow_22_elements_the_op_equals_the_oracle():
    """Past 2^22 elements the decode's radix sort of the global indices takes three 11-bit passes."""
    numel, n, bits, block = (1 << 22) + 4099, 3, 4, 32
    msgs, _, isz = _messages(numel, n, bits, block, FMTS["coo"], torch.int32, seed=22, density=0.002)
    got_ref, got = torch.zeros(numel), torch.zeros(numel)
    ref.decode_pulls_lowbit_(got_ref, msgs, KEYS, isz, bits, block, 1)
    torch.ops.zen_ext.decode_pulls_lowbit_(got, msgs, KEYS, isz, bits, block, 1)
    assert torch.equal(got, got_ref) and int((got != 0).sum()) > 1000


@needs_op
def test_owners_carrying_nothing_and_empty_messages_leave_out_alone():
    numel, n = 300, 4
    msgs, want, isz = _messages(numel, n, 4, 128, FMTS["coo"], torch.int32, seed=1, density=0.0)
    # Owner 0 sends nothing at all (a zero-byte message): its positions stay as the caller left them.
    msgs[0] = torch.empty(0, dtype=torch.uint8)
    base = torch.full((numel,), 5.0)
    for fn in (ref.decode_pulls_lowbit_, torch.ops.zen_ext.decode_pulls_lowbit_):
        got = base.clone()
        fn(got, msgs, KEYS, isz, 4, 128, 1)
        owner0 = set(ops.permute(torch.arange(R.part_size(numel, 0, n)) * n, numel, KEYS, inverse=True).tolist())
        for gi in range(numel):
            if gi in owner0 or gi not in want:
                assert got[gi] == 5.0
            else:
                assert got[gi] == want[gi]


@needs_op
def test_dispatch_runs_the_op_and_agrees_with_the_oracle_forced():
    numel, n = 4099, 5
    msgs, _, isz = _messages(numel, n, 8, 128, FMTS["mixed"], torch.int32, seed=3)
    a, b = torch.zeros(numel), torch.zeros(numel)
    ops.decode_pulls_lowbit_(a, msgs, KEYS, isz, 8, 128, n)
    with ops.force_reference():
        ops.decode_pulls_lowbit_(b, msgs, KEYS, isz, 8, 128, n)
    assert torch.equal(a, b) and a.count_nonzero() > 0


@needs_op
@pytest.mark.parametrize("break_it,match", [
    (lambda m: m[:-1], "does not match format"),
    (lambda m: torch.cat([m, torch.zeros(1, dtype=torch.uint8)]), "does not match format"),
    (lambda m: m[:8], "has no header"),
])
def test_malformed_messages_raise_before_writing(break_it, match):
    numel, n = 500, 2
    msgs, _, isz = _messages(numel, n, 4, 128, FMTS["coo"], torch.int32, seed=4)
    msgs = [msgs[0], break_it(msgs[1].clone())]
    out = torch.zeros(numel)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.zen_ext.decode_pulls_lowbit_(out, msgs, KEYS, isz, 4, 128, 1)


@needs_op
def test_bad_header_and_arguments_raise():
    numel = 100
    bad_fmt = pack(torch.tensor([2, 3], dtype=torch.int64), torch.ones(1), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="bad format 2 with count 3"):
        torch.ops.zen_ext.decode_pulls_lowbit_(torch.zeros(numel), [bad_fmt], KEYS, 4, 4, 128, 1)
    bad_count = pack(torch.tensor([0, 101], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="count"):
        torch.ops.zen_ext.decode_pulls_lowbit_(torch.zeros(numel), [bad_count], KEYS, 4, 4, 128, 1)
    with pytest.raises(RuntimeError, match="bits"):
        torch.ops.zen_ext.decode_pulls_lowbit_(torch.zeros(numel), [], KEYS, 4, 3, 128, 1)
    with pytest.raises(RuntimeError, match="out must be a contiguous 1-D"):
        torch.ops.zen_ext.decode_pulls_lowbit_(torch.zeros(10, 10), [], KEYS, 4, 4, 128, 1)
