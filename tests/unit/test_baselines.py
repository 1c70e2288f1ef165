"""The baselines ``agsparse``, ``sparcml``, ``omnireduce``, ``sparse_ps`` equal the dense oracle in SimWorld
and count the bytes their wire formats imply."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zen_ext import SimWorld, SparseGrad, available_schemes, build_scheme
from zen_ext.core.coo import decode_coo, encode_coo

BASELINES = ["agsparse", "sparcml", "omnireduce", "sparse_ps"]


def run(name, inputs, op="sum", gather_impl="auto", **opts):
    """Per-rank outputs and stats of ``name`` and of ``dense`` on the same inputs (``gather_impl``: the
    all-gather's round structure, ``comm/gather.py``; the byte tests pin ``direct``, one message per peer)."""
    n = len(inputs)
    scheme, dense = build_scheme(name, **opts), build_scheme("dense")
    world = SimWorld(n, gather_impl=gather_impl)
    got = world.run(lambda c, x: scheme.sync(c, x, op=op), inputs)
    want = SimWorld(n).run(lambda c, x: dense.sync(c, x, op=op), inputs)
    return got, want, world.stats


def int_inputs(n, numel, nnz, seed=0, width=1, dtype=torch.float32, empty_rank=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        k = 0 if r == empty_rank else nnz
        idx = torch.randint(0, numel, (k,), generator=g)
        if k >= 2 and r == 0:
            idx[0], idx[1] = 0, numel - 1  # the first and the last index
        shape = (k,) if width == 1 else (k, width)
        out.append(SparseGrad(idx, torch.randint(-16, 17, shape, generator=g).to(dtype), numel))
    return out


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
def test_equals_dense_exactly(name, n):
    inputs = int_inputs(n, numel=2053, nnz=150, seed=n, empty_rank=1 if n > 2 else None)
    got, want, _ = run(name, inputs)
    expected = sum(x.to_dense() for x in inputs)
    for g, w in zip(got, want):
        assert torch.equal(g, expected)
        assert torch.equal(w, expected)


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("n", [1, 3, 4, 6, 7])
def test_row_form_equals_dense(name, n):
    inputs = int_inputs(n, numel=301, nnz=40, seed=10 + n, width=3)
    got, _, _ = run(name, inputs)
    expected = sum(x.to_dense() for x in inputs)
    assert expected.numel() == 301 * 3
    for g in got:
        assert torch.equal(g, expected)


@pytest.mark.parametrize("name", BASELINES)
def test_adversarial_index_sets(name):
    numel = 1000
    full = torch.arange(numel)
    empty = torch.empty(0, dtype=torch.int64)
    cases = {
        "all_empty": [empty] * 4,
        "one_empty_rank": [full[:10], empty, full[5:30], full[-3:]],
        "full_overlap": [full[100:200]] * 4,
        "no_overlap": [full[i::4] for i in range(4)],
        "first_and_last": [torch.tensor([0, numel - 1])] * 4,
        "duplicates_in_rank": [torch.tensor([7, 7, 7, 0, 0, numel - 1, numel - 1])] * 4,
        "fully_dense": [full] * 4,
        "one_block_only": [torch.tensor([3, 5]), torch.tensor([255]), empty, torch.tensor([0, 0])],
    }
    for case, idx_sets in cases.items():
        inputs = [SparseGrad(idx, torch.full((idx.numel(),), float(r + 1)), numel) for r, idx in enumerate(idx_sets)]
        got, _, _ = run(name, inputs)
        expected = sum(x.to_dense() for x in inputs)
        for g in got:
            assert torch.equal(g, expected), case


@pytest.mark.parametrize("name", BASELINES)
def test_dense_tensor_input(name):
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randint(-3, 4, (257,), generator=g).float() for _ in range(3)]
    got, _, _ = run(name, inputs)
    for out in got:
        assert torch.equal(out, sum(inputs))


@pytest.mark.parametrize("name", BASELINES)
def test_mean_is_the_dense_mean(name):
    inputs = int_inputs(3, numel=500, nnz=60, seed=4)
    got, want, _ = run(name, inputs, op="mean")
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # exact sums, then the same division


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(name, dtype):
    # Small integers sum exactly in every dtype: equality with dense is exact, and so is the dtype.
    inputs = int_inputs(5, numel=777, nnz=90, seed=5, dtype=dtype)
    got, want, _ = run(name, inputs)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert torch.equal(g, w)
    # Real-valued inputs: close to the float64 reference, and bit-identical on every rank.
    gen = torch.Generator().manual_seed(6)
    inputs = [SparseGrad(torch.randint(0, 777, (90,), generator=gen), torch.randn(90, generator=gen).to(dtype), 777)
              for _ in range(5)]
    got, _, _ = run(name, inputs, op="mean")
    ref = sum(x.to_dense().double() for x in inputs) / 5
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    for g in got:
        assert torch.equal(g, got[0])
        assert torch.allclose(g.double(), ref, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(BASELINES), n=st.integers(1, 6), numel=st.integers(1, 600),
       data=st.data())
def test_property_equals_dense(name, n, numel, data):
    inputs = []
    for _ in range(n):
        idx = data.draw(st.lists(st.integers(0, numel - 1), max_size=80))
        vals = data.draw(st.lists(st.integers(-9, 9), min_size=len(idx), max_size=len(idx)))
        inputs.append(SparseGrad(torch.tensor(idx, dtype=torch.int64), torch.tensor(vals, dtype=torch.float32), numel))
    got, _, _ = run(name, inputs)
    expected = sum(x.to_dense() for x in inputs)
    for g in got:
        assert torch.equal(g, expected)


def test_agsparse_bytes_are_one_coo_message_per_peer():
    n, nnz, numel = 4, 50, 10_000
    inputs = int_inputs(n, numel, nnz, empty_rank=2)
    _, _, stats = run("agsparse", inputs, gather_impl="direct")
    entry = 4 + 4  # int32 index + fp32 value
    for r, s in enumerate(stats):
        mine = 0 if r == 2 else nnz
        others = sum(0 if j == 2 else nnz for j in range(n) if j != r)
        assert s.bytes_sent == (n - 1) * (8 + mine * entry)
        assert s.bytes_recv == (n - 1) * 8 + others * entry
        # the empty rank sends sizes only: no empty payload ever travels
        assert s.msgs_sent == (n - 1) * (2 if mine else 1)


def test_sparse_ps_first_owner_carries_a_skewed_gradient():
    n, numel = 4, 4000
    idx = torch.arange(0, 400)  # all in the first range of 1000
    inputs = [SparseGrad(idx, torch.ones(400), numel) for _ in range(n)]
    _, _, stats = run("sparse_ps", inputs, gather_impl="direct")
    assert stats[0].bytes_recv == (n - 1) * (8 + 8) + (n - 1) * 400 * 8  # counts, sizes, 3 pushes of 400
    assert stats[0].bytes_sent == (n - 1) * 8 + (n - 1) * (8 + 400 * 8)  # counts, then its aggregate to all
    for s in stats[1:]:
        assert s.bytes_sent == (n - 1) * 8 + 400 * 8 + (n - 1) * 8  # counts, one push, sizes of an empty pull


def test_omnireduce_sends_only_nonzero_blocks():
    n, numel = 4, 4 * 1024  # 16 blocks of 256, 4 per owner
    inputs = [SparseGrad(torch.tensor([r * 1024 + 5]), torch.ones(1), numel) for r in range(n)]
    _, _, stats = run("omnireduce", inputs)
    block = 4 + 256 * 4
    for s in stats:
        # the block lies in the rank's own range: no push payload; one aggregated block to 3 peers
        assert s.bytes_sent == 3 * 8 + 3 * (8 + block)
        assert s.bytes_recv == 3 * 8 + 3 * 8 + 3 * block


def test_omnireduce_row_form_and_block_size_option():
    inputs = int_inputs(3, numel=100, nnz=20, width=5, seed=8)
    got, _, _ = run("omnireduce", inputs, block_size=7)
    for g in got:
        assert torch.equal(g, sum(x.to_dense() for x in inputs))
    with pytest.raises(ValueError, match=r"zen.block_size \(0\) must be an int >= 1"):
        build_scheme("omnireduce", block_size=0)
    with pytest.raises(ValueError, match=r"valid options are \['block_size'\]"):
        build_scheme("omnireduce", blocks=3)


def test_sparcml_switches_to_dense_messages():
    n, numel = 4, 1000
    inputs = [SparseGrad(torch.arange(numel), torch.ones(numel), numel) for _ in range(n)]
    _, _, stats = run("sparcml", inputs)
    for s in stats:  # two rounds, each: counts to 3 peers + one dense message (smaller than COO)
        assert s.bytes_sent == 2 * (3 * 8 + numel * 4)
        assert s.msgs_sent == 2 * (3 + 1)


def test_sparcml_sparse_rounds_grow_with_the_union():
    n, numel = 4, 100_000
    inputs = [SparseGrad(torch.tensor([r]), torch.ones(1), numel) for r in range(n)]  # no overlap
    _, _, stats = run("sparcml", inputs)
    for s in stats:  # round 1 sends 1 entry, round 2 the pair's 2 entries
        assert s.bytes_sent == 2 * 3 * 8 + (1 + 2) * 8


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_sparcml_folding_moves_the_folded_ranks_data_once(n):
    numel = 64
    inputs = [SparseGrad(torch.tensor([r]), torch.ones(1), numel) for r in range(n)]
    got, _, stats = run("sparcml", inputs)
    for g in got:
        assert torch.equal(g, sum(x.to_dense() for x in inputs))
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    steps = (p.bit_length() - 1) + 2  # rounds + fold + unfold: every rank joins every exchange_v
    assert all(s.msgs_sent >= steps * (n - 1) for s in stats)
    # rank 0 (folded away) sends its stream once, to rank 1, and receives only the final result
    assert stats[0].bytes_sent == steps * (n - 1) * 8 + 1 * 8
    assert rem >= 1


def test_coo_wire_format_uses_int64_indices_past_2_31():
    idx = torch.tensor([0, 2**31 + 5, 2**33])
    vals = torch.tensor([1.0, 2.0, 3.0])
    buf = encode_coo(idx, vals, numel=2**34)
    assert buf.numel() == 3 * (8 + 4)
    i, v = decode_coo(buf, 2**34, (), torch.float32)
    assert torch.equal(i, idx) and torch.equal(v, vals)
    buf32 = encode_coo(idx[:1], vals[:1], numel=1000)
    assert buf32.numel() == 4 + 4


def test_schemes_are_registered_and_lossless():
    from zen_ext import available_schemes

    for name in BASELINES:
        assert name in available_schemes()
        assert build_scheme(name).lossless


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("scheme", sorted(available_schemes()))
def test_out_may_be_the_input_gradient_for_every_scheme(scheme, op, dtype):
    """The result written into the tensor that holds the rank's own gradient (the engines' buckets):
    every scheme consumes its input before it writes the result (fp32: AGsparse and Sparse PS sum
    straight into ``out``; bf16: AGsparse sums in fp32 and copies)."""
    g = torch.Generator().manual_seed(11)
    n, numel = 5, 3001
    dense_inputs = [(torch.randint(-3, 4, (numel,), generator=g) * (torch.rand(numel, generator=g) < 0.1)).to(dtype)
                    for _ in range(n)]
    dense_inputs[1].zero_()  # an empty rank
    dense_inputs[2][0], dense_inputs[2][-1] = 1, 2  # index 0 and the last index
    expected = sum(x.double() for x in dense_inputs)
    if op == "mean":
        expected = expected / n
    built = build_scheme(scheme)

    def fn(c, x):
        mine = x.clone()
        res = built.sync(c, mine, op=op, out=mine)
        assert res.data_ptr() == mine.data_ptr()
        return mine

    for got in SimWorld(n).run(fn, dense_inputs):
        torch.testing.assert_close(got.double(), expected.to(dtype).double(), rtol=0, atol=0.01 if op == "mean" else 0)
