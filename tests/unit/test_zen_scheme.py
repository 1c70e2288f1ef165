"""``zen`` equals the dense all-reduce oracle on adversarial inputs, in SimWorld."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zen_ext import SimWorld, SparseGrad, build_scheme
from zen_ext.core.zen import ZenScheme, pull_costs


def run_both(inputs, op="sum", **zen_opts):
    n = len(inputs)
    zen, dense = build_scheme("zen", **zen_opts), build_scheme("dense")
    got = SimWorld(n).run(lambda c, x: zen.sync(c, x, op=op), inputs)
    want = SimWorld(n).run(lambda c, x: dense.sync(c, x, op=op), inputs)
    return got, want


def int_inputs(n, numel, nnz, seed=0, width=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, numel, (nnz,), generator=g)
        shape = (nnz,) if width == 1 else (nnz, width)
        out.append(SparseGrad(idx, torch.randint(-16, 17, shape, generator=g).to(dtype), numel))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("pull_format", ["auto", "coo", "bitmap", "dense"])
def test_zen_equals_dense_exactly(n, pull_format):
    inputs = int_inputs(n, numel=4099, nnz=200, seed=n)
    got, want = run_both(inputs, pull_format=pull_format)
    expected = sum(x.to_dense() for x in inputs)
    for g, w in zip(got, want):
        assert torch.equal(g, expected)
        assert torch.equal(w, expected)


def test_adversarial_index_sets():
    numel = 1000
    full = torch.arange(numel)
    cases = {
        "all_empty": [torch.empty(0, dtype=torch.int64)] * 4,
        "one_empty_rank": [full[:10], torch.empty(0, dtype=torch.int64), full[5:30], full[-3:]],
        "full_overlap": [full[100:200]] * 4,
        "no_overlap": [full[i::4] for i in range(4)],
        "first_and_last": [torch.tensor([0, numel - 1])] * 4,
        "duplicates_in_rank": [torch.tensor([7, 7, 7, 0, 0, numel - 1, numel - 1])] * 4,
        "fully_dense": [full] * 4,
    }
    for name, idx_sets in cases.items():
        inputs = [SparseGrad(idx, torch.full((idx.numel(),), float(r + 1)), numel) for r, idx in enumerate(idx_sets)]
        got, want = run_both(inputs)
        expected = sum(x.to_dense() for x in inputs)
        for g, w in zip(got, want):
            assert torch.equal(g, expected), name
            assert torch.equal(w, expected), name


def test_mean_divides_by_world_size():
    inputs = int_inputs(4, numel=500, nnz=60)
    got, _ = run_both(inputs, op="mean")
    expected = sum(x.to_dense() for x in inputs) / 4
    for g in got:
        assert torch.allclose(g, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype):
    g = torch.Generator().manual_seed(1)
    inputs = []
    for _ in range(3):
        idx = torch.randint(0, 3000, (400,), generator=g)
        inputs.append(SparseGrad(idx, torch.randn(400, generator=g).to(dtype), 3000))
    got, want = run_both(inputs, op="mean")
    ref = sum(x.to_dense().double() for x in inputs) / 3
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    for gz, gd in zip(got, want):
        assert gz.dtype == dtype
        assert torch.allclose(gz.double(), ref, atol=tol, rtol=tol)
        assert torch.allclose(gz.double(), gd.double(), atol=2 * tol, rtol=2 * tol)


def test_row_form_equals_dense():
    inputs = int_inputs(4, numel=777, nnz=50, width=16)
    got, want = run_both(inputs)
    expected = sum(x.to_dense() for x in inputs)
    for g, w in zip(got, want):
        assert g.shape == (777 * 16,)
        assert torch.equal(g, expected)
        assert torch.equal(w, expected)


def test_dense_tensor_input():
    g = torch.Generator().manual_seed(3)
    dense_inputs = [torch.randint(-3, 4, (2000,), generator=g).float() * (torch.rand(2000, generator=g) < 0.05)
                    for _ in range(3)]
    got, _ = run_both(dense_inputs)
    for out in got:
        assert torch.equal(out, sum(dense_inputs))


@pytest.mark.parametrize("scheme", ["zen", "zen_coo"])
def test_out_may_be_the_input_gradient(scheme):
    """The result written into the very tensor that holds the rank's gradient (what the engines do with
    their buckets): zen zeroes ``out`` while the pull travels, after the input was consumed."""
    g = torch.Generator().manual_seed(4)
    dense_inputs = [torch.randint(-3, 4, (3001,), generator=g).float() * (torch.rand(3001, generator=g) < 0.1)
                    for _ in range(5)]
    expected = sum(dense_inputs)
    zen = build_scheme(scheme)

    def fn(c, x):
        mine = x.clone()
        res = zen.sync(c, mine, out=mine)
        assert res.data_ptr() == mine.data_ptr()
        return mine

    for got in SimWorld(5).run(fn, dense_inputs):
        assert torch.equal(got, expected)


def test_above_2_pow_24_elements():
    # fp32 cannot represent every index above 2^24: indices must never travel as floats.
    numel = 2**24 + 1001
    idx = torch.tensor([0, 2**24 - 1, 2**24, 2**24 + 1, numel - 1])
    inputs = [SparseGrad(idx, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * (r + 1), numel) for r in range(3)]
    zen = build_scheme("zen")
    got = SimWorld(3).run(lambda c, x: zen.sync(c, x)[idx], inputs)
    for g in got:
        assert torch.equal(g, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * 6)


def test_out_of_range_index_raises():
    zen = build_scheme("zen")
    bad = SparseGrad(torch.tensor([5, 10]), torch.ones(2), 10)
    with pytest.raises(RuntimeError, match="must lie in"):
        SimWorld(1).run(lambda c, x: zen.sync(c, x), [bad])


def test_push_and_pull_bytes_are_balanced():
    # Zipf-skewed embedding rows: every rank sends and receives about the same number of bytes.
    g = torch.Generator().manual_seed(0)
    n, V = 8, 30522
    ranks = torch.arange(1, V + 1, dtype=torch.float64)
    probs = ranks.pow(-1.05)
    inputs = []
    for _ in range(n):
        idx = torch.multinomial(probs, 4000, replacement=True, generator=g).unique()
        inputs.append(SparseGrad(idx, torch.ones(idx.numel()), V))
    world = SimWorld(n)
    world.run(lambda c, x: build_scheme("zen").sync(c, x), inputs)
    sent = torch.tensor([s.bytes_sent for s in world.stats], dtype=torch.float64)
    recv = torch.tensor([s.bytes_recv for s in world.stats], dtype=torch.float64)
    assert float(sent.max() / sent.mean()) < 1.1
    assert float(recv.max() / recv.mean()) < 1.1


def test_zen_sends_fewer_bytes_than_dense_when_sparse():
    inputs = int_inputs(4, numel=100_000, nnz=1000)
    wz, wd = SimWorld(4), SimWorld(4)
    wz.run(lambda c, x: build_scheme("zen").sync(c, x), inputs)
    wd.run(lambda c, x: build_scheme("dense").sync(c, x), inputs)
    assert max(s.bytes_sent for s in wz.stats) < 0.2 * min(s.bytes_sent for s in wd.stats)


def test_pull_format_choice_follows_costs():
    # Few non-zeros → COO; about half the partition → bitmap; (almost) full → dense.
    assert min(pull_costs(10, 10_000, 4, 4).items(), key=lambda kv: kv[1])[0] == 0
    assert min(pull_costs(5_000, 10_000, 4, 4).items(), key=lambda kv: kv[1])[0] == 1
    assert min(pull_costs(9_990, 10_000, 4, 4).items(), key=lambda kv: kv[1])[0] == 2
    timings: dict = {}
    full = [SparseGrad(torch.arange(1000), torch.ones(1000), 1000)] * 2
    SimWorld(2).run(lambda c, x: ZenScheme().sync(c, x, timings=timings if c.rank == 0 else None), full)
    assert timings["pull_format"] == "dense"


def test_invalid_options_raise():
    with pytest.raises(ValueError, match=r"zen.pull_format \('csr'\) must be one of"):
        build_scheme("zen", pull_format="csr")
    with pytest.raises(ValueError, match=r"must be one of \["):
        build_scheme("nope")
    with pytest.raises(ValueError, match="valid options are"):
        build_scheme("zen", bogus=1)
    with pytest.raises(RuntimeError, match=r"op \('max'\) must be one of"):
        SimWorld(1).run(lambda c: build_scheme("zen").sync(c, torch.zeros(3), op="max"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 6),
    numel=st.integers(1, 3000),
    density=st.floats(0.0, 1.0),
    overlap=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_zen_equals_dense(n, numel, density, overlap, seed):
    g = torch.Generator().manual_seed(seed)
    k = int(density * numel)
    shared = torch.randperm(numel, generator=g)[:k]
    inputs = []
    for _ in range(n):
        own = torch.randperm(numel, generator=g)[:k]
        take_shared = torch.rand(k, generator=g) < overlap
        idx = torch.where(take_shared, shared, own)
        inputs.append(SparseGrad(idx, torch.randint(-9, 10, (k,), generator=g).float(), numel))
    got, want = run_both(inputs)
    expected = sum(x.to_dense() for x in inputs)
    for g_, w in zip(got, want):
        assert torch.equal(g_, expected)
        assert torch.equal(w, expected)


@pytest.mark.parametrize("n", [2, 5])
def test_dense_gradient_costs_no_more_than_dense_all_reduce(n):
    # A fully dense gradient switches push and pull to dense partitions: zen then moves the same
    # payload as a ring all-reduce, plus per-peer counts and 16-byte pull headers.
    numel = 10_000
    inputs = [SparseGrad(torch.arange(numel), torch.full((numel,), float(r)), numel) for r in range(n)]
    wz, wd = SimWorld(n), SimWorld(n)
    outs = wz.run(lambda c, x: build_scheme("zen").sync(c, x), inputs)
    wd.run(lambda c, x: build_scheme("dense").sync(c, x), inputs)
    for out in outs:
        assert torch.equal(out, torch.full((numel,), float(sum(range(n)))))
    overhead = (n - 1) * (8 + 8 + 16 + 4 * 8)  # counts, sizes, header, ring rounding slack
    for sz, sd in zip(wz.stats, wd.stats):
        assert sz.bytes_sent <= sd.bytes_sent + overhead


def test_agreement_check_catches_different_seeds():
    schemes = [build_scheme("zen", seed=1), build_scheme("zen", seed=2)]
    with pytest.raises(RuntimeError, match="differs across ranks.*seed"):
        SimWorld(2).run(lambda c: schemes[c.rank].check_agreement(c))
    same = build_scheme("zen", seed=7)
    world = SimWorld(3)
    world.run(lambda c: same.check_agreement(c))
    assert all(s.bytes_sent == 0 for s in world.stats)  # agreement traffic is not counted


def test_reference_path_without_the_cpp_op(monkeypatch):
    # The package must work (slower) when the compiled op is absent: same results, same bytes.
    from zen_ext import ops

    inputs = int_inputs(3, numel=3001, nnz=150, seed=5)
    w_op, w_ref = SimWorld(3), SimWorld(3)
    with_op = w_op.run(lambda c, x: build_scheme("zen").sync(c, x), inputs)
    monkeypatch.setattr(ops, "HAVE_CPP_OP", False)
    without = w_ref.run(lambda c, x: build_scheme("zen").sync(c, x), inputs)
    for a, b in zip(with_op, without):
        assert torch.equal(a, b)
    assert [s.as_dict() for s in w_op.stats] == [s.as_dict() for s in w_ref.stats]


def test_one_scheme_object_shared_by_ranks_and_reused_across_sizes():
    """The server's aggregation buffer is a workspace kept between calls (per thread): one scheme
    object shared by every SimWorld rank (threads), a large bucket, then smaller ones whose views
    hold the previous call's sums, then a row-form one, stay equal to the dense sum."""
    zen = build_scheme("zen", pull_format="coo")
    for numel, nnz, width in [(50_000, 3000, 1), (4099, 200, 1), (1000, 900, 1), (300, 40, 3)]:
        inputs = int_inputs(4, numel, nnz, seed=numel, width=width)
        got = SimWorld(4).run(lambda c, x: zen.sync(c, x, op="sum"), inputs)
        expected = sum(x.to_dense() for x in inputs)
        for g in got:
            assert torch.equal(g.view_as(expected), expected), (numel, width)
    import pickle

    assert isinstance(pickle.loads(pickle.dumps(zen)), ZenScheme)  # the workspace does not travel
