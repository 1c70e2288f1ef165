"""``zen.dgc.value_bits`` (zen_ext/core/lowbit.py, core/zen_lowbit.py): DGC's values in 8 and 4 bits on ZEN's
wire, with error feedback at both ends. What is checked:

* config and scheme errors before the first step; ``auto`` narrows its candidates to the schemes that carry it;
* the sender: DGC's residual after the push is the accumulated value minus the dequantized sent value (with
  the fp32, bf16 and 4-bit residuals), and non-finite values leave the memory alone;
* replicas bitwise identical at 3 and 4 ranks (SimWorld), owner feedback on and off, fp32 and bf16, sum and
  mean; the natural embedding rows and dense slices exactly as without value_bits;
* nothing is dropped: over all ranks, inputs = what was applied + every sender residual + every owner residual;
* a checkpoint round trip resumes bitwise with both residuals; the bytes fall as the bits say."""

from __future__ import annotations

import io

import pytest
import torch

from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs
from zen_ext import SimWorld, ops
from zen_ext.compress import DGCConfig, DGCSparsifier, NamedGrad
from zen_ext.compress.dgc.int4 import dequantize
from zen_ext.compress.dgc.sparsifier import OWNER_KEY
from zen_ext.core.registry import build_scheme
from zen_ext.reduction.scatter import reduce_scatter_flat
from zen_ext.reduction.synchronizer import Synchronizer
from zen_ext.reduction.scatter import reduce_scatter_flat

DGC_SLICES = [s for s in SLICES if KINDS[s.name] == "dgc"]


def _inputs(n, steps, seed, dtype, jitter):
    """``bucket_inputs`` per step; ``jitter`` > 0 makes them non-integer (fp32 sums then round)."""
    out = [bucket_inputs(n, seed=seed + s, dtype=torch.float32) for s in range(steps)]
    g = torch.Generator().manual_seed(seed + 99)
    return [[(x * (1 + jitter * torch.randn(x.shape, generator=g))).to(dtype) for x in xs] for xs in out]


def _run(n, steps, op="mean", bits=4, owner=True, dtype=torch.float32, scheme="zen", dgc=None, state=None,
         seed=0, jitter=0.0):
    cfg = dict(dgc or DGC, value_bits=bits, owner_error_feedback=owner)
    inputs = _inputs(n, steps, seed, dtype, jitter)

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme(scheme), param_kinds=KINDS, dgc=cfg, natural={})
        if state is not None:
            sync.load_state_dict(state[comm.rank])
        outs = []
        for x in inputs:
            outs.append(sync.sync_flat(x[comm.rank], SLICES, op).clone())
            sync.end_step()
        return outs, sync

    return SimWorld(n).run(fn), inputs


def test_config_errors():
    for bad in (3, 16, True, "4"):
        with pytest.raises((ValueError, TypeError), match="zen.dgc.value_bits"):
            DGCConfig.from_dict({"enabled": True, "value_bits": bad})
    with pytest.raises(TypeError, match="zen.dgc.owner_error_feedback"):
        DGCConfig.from_dict({"enabled": True, "value_bits": 4, "owner_error_feedback": 1})
    assert DGCConfig().value_bits is None and DGCConfig().owner_error_feedback is True


@pytest.mark.parametrize("scheme", ["dense", "sparcml", "omnireduce", "sparse_ps", "spardl", "agsparse"])
def test_schemes_that_cannot_carry_low_bits_are_refused_at_attach(scheme):
    comm = SimWorld(1).communicators()[0]
    with pytest.raises(ValueError, match=r"zen.dgc.value_bits \(4\) must go with a scheme that carries low-bit "
                                         r"values.*schemes that carry it: \['zen', 'zen_coo', 'auto'\]"):
        Synchronizer(dp_comm=comm, scheme=scheme, param_kinds={"w": "dgc"}, dgc=dict(DGC, value_bits=4))


def test_auto_chooses_only_among_the_carriers_and_a_dense_only_auto_is_refused():
    comm = SimWorld(1).communicators()[0]
    sync = Synchronizer(dp_comm=comm, scheme="auto", param_kinds={"w": "dgc"}, dgc=dict(DGC, value_bits=8))
    assert set(sync.scheme.candidates) <= {"zen", "zen_coo"} and "zen" in sync.scheme.candidates
    with pytest.raises(ValueError, match=r"zen.dgc.value_bits \(8\) must .*zen.candidates \['dense'\]"):
        Synchronizer(dp_comm=comm, scheme=build_scheme("auto", candidates=["dense"]), param_kinds={"w": "dgc"},
                     dgc=dict(DGC, value_bits=8))
    # Without value_bits nothing changes.
    assert "dense" in Synchronizer(dp_comm=comm, scheme="auto", param_kinds={"w": "dgc"}, dgc=DGC).scheme.candidates


@pytest.mark.parametrize("residual_dtype, dtype", [("float32", torch.float32), ("float32", torch.bfloat16),
                                                   ("bfloat16", torch.float32), ("int4", torch.float32)])
@pytest.mark.parametrize("bits", [8, 4])
def test_sender_residual_is_accumulated_minus_dequantized_sent(residual_dtype, dtype, bits):
    cfg = DGCConfig.from_dict({"enabled": True, "density": 0.1, "min_numel": 16, "residual_dtype": residual_dtype,
                               "value_bits": bits})
    sp = DGCSparsifier(cfg, dp_size=2)
    g = torch.Generator().manual_seed(bits)
    grads = [NamedGrad("a", (torch.randn(3000, generator=g) * 3).to(dtype)),
             NamedGrad("b", torch.randn(700, generator=g).to(dtype))]
    sp2 = DGCSparsifier(cfg, dp_size=2)
    sg = sp.compress(grads)
    sg2 = sp2.compress(grads)
    assert sg.lowbit.bits == bits and sg.lowbit.sender_feedback is not None
    # What a scheme does: quantize (here two owner segments), hand the dequantized values back.
    order = torch.randperm(sg.nnz, generator=g)
    cut = sg.nnz // 3
    _, _, deq = ops.quantize_blocks(sg.values[order], [cut, sg.nnz], bits, 128)
    sg.lowbit.sender_feedback(order, deq)
    # Or, where DGC's memory is one fp32 buffer, in the quantizing pass (ops.quantize_sent_): the same bits.
    fused = sg2.lowbit.sender_residual
    assert (fused is not None) == (residual_dtype == "float32")
    if fused is not None:
        R2, pos2, vals2 = fused()
        assert vals2 is sg2.values
        ops.quantize_sent_(sg2.values, order, R2, pos2, [cut, sg.nnz], bits, 128)
        for k in ("a", "b"):
            assert torch.equal(sp.state.params[k]["residual"], sp2.state.params[k]["residual"])
    acc = torch.cat([x.grad.float() for x in grads])  # step 0 without momentum correction: v = g
    sent = torch.zeros(3700)
    sent[sg.indices[order]] = deq
    if residual_dtype == "int4":
        R = torch.cat([dequantize(sp.state.params[k]["residual_codes"], sp.state.params[k]["residual_scales"], m)
                       for k, m in (("a", 3000), ("b", 700))])
        span = acc.abs().max() * 2
        assert ((sent + R) - acc).abs().max() <= span / 30 * 1.01
        assert (R[sg.indices[order]] - (acc - sent)[sg.indices[order]]).abs().max() <= span / 30 * 1.01
        return
    R = torch.cat([sp.state.params["a"]["residual"], sp.state.params["b"]["residual"]]).float()
    if residual_dtype == "float32" and dtype == torch.float32:
        # Exactly as the code defines it: at the sent positions residual = v - deq, elsewhere v.
        assert torch.equal(R[sg.indices], (acc - sent)[sg.indices])
        mask = torch.ones(3700, dtype=torch.bool)
        mask[sg.indices] = False
        assert torch.equal(R[mask], acc[mask])
    else:  # the wire cast's or the residual's own rounding
        tol = 2 ** -7 if residual_dtype == "bfloat16" else 2 ** -20
        assert ((sent + R) - acc).abs().max() <= tol * acc.abs().max()
    assert (sent != 0).sum() > 0 and not torch.equal(sent[sg.indices], acc[sg.indices])  # quantization did bite


def test_non_finite_values_travel_and_leave_the_memory_alone():
    sp = DGCSparsifier(DGCConfig.from_dict({"enabled": True, "density": 0.1, "min_numel": 16, "value_bits": 4}))
    sp.compress([NamedGrad("a", torch.ones(500))])
    before = sp.state.params["a"]["residual"].clone()
    bad = torch.ones(500)
    bad[7] = float("inf")
    sg = sp.compress([NamedGrad("a", bad)])
    assert sg.lowbit.sender_feedback is None and torch.equal(sp.state.params["a"]["residual"], before)
    comm = SimWorld(1).communicators()[0]
    out = build_scheme("zen").sync(comm, sg)
    assert not torch.isfinite(out).all()  # the engine sees the overflow


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("bits, owner, dtype, op", [(4, True, torch.float32, "mean"), (8, True, torch.bfloat16, "sum"),
                                                    (4, False, torch.float32, "sum"), (4, True, torch.bfloat16, "mean")])
def test_replicas_agree_bitwise_and_the_rest_of_the_bucket_is_as_today(n, bits, owner, dtype, op):
    res, inputs = _run(n, 4, op, bits, owner, dtype)
    plain, _ = _run(n, 4, op, None, owner, dtype)
    for step in range(4):
        outs = [res[r][0][step] for r in range(n)]
        for r in range(1, n):
            assert torch.equal(outs[0].view(torch.int16), outs[r].view(torch.int16)), (step, r)
        base = plain[0][0][step]
        for s in SLICES:
            a, b = outs[0][s.offset:s.offset + s.numel], base[s.offset:s.offset + s.numel]
            if KINDS[s.name] != "dgc":  # natural rows and dense slices: exactly as without value_bits
                assert torch.equal(a, b), s.name
            else:  # low-bit DGC: close to today's, not equal
                assert (a.float() - b.float()).abs().max() <= (12 if bits == 4 else 1.5) * (1 if op == "mean" else n), s.name
    assert any(not torch.equal(res[0][0][s], plain[0][0][s]) for s in range(4))


@pytest.mark.parametrize("bits", [8, 4])
def test_nothing_is_dropped_inputs_equal_applied_plus_both_residuals(bits):
    n, steps = 3, 5
    res, inputs = _run(n, steps, "sum", bits, True)
    applied = sum(res[0][0][s].double() for s in range(steps))
    total_in = sum(inputs[s][r].double() for s in range(steps) for r in range(n))
    residuals = torch.zeros(NUMEL, dtype=torch.float64)
    scheme = build_scheme("zen")
    for r in range(n):
        sync = res[r][1]
        for s in DGC_SLICES:
            residuals[s.offset:s.offset + s.numel] += sync.state.params[s.name]["residual"].double()
        owned = [k for k in sync.state.params if k.startswith(OWNER_KEY)]
        assert len(owned) == 1
        R_owner = sync.state.params[owned[0]]["owner_residual"].double()
        # w1 and w2 leave a gap in the bucket: the DGC SparseGrad spans their concatenation.
        concat = torch.cat([torch.arange(s.offset, s.offset + s.numel) for s in DGC_SLICES])
        part = scheme.partitioner(concat.numel(), n)
        assert R_owner.numel() == part.part_size(r)
        idx = part.indices_of(r, torch.arange(R_owner.numel()))
        residuals[concat[idx]] += R_owner
    dgc = torch.zeros(NUMEL, dtype=torch.bool)
    for s in DGC_SLICES:
        dgc[s.offset:s.offset + s.numel] = True
    err = (applied + residuals - total_in)[dgc].abs().max()
    assert err <= 1e-3, err  # fp32 roundings only
    # Without the owner residual the owner's rounding is lost: the same identity fails.
    res2, _ = _run(n, steps, "sum", bits, False)
    applied2 = sum(res2[0][0][s].double() for s in range(steps))
    residuals2 = torch.zeros(NUMEL, dtype=torch.float64)
    for r in range(n):
        for s in DGC_SLICES:
            residuals2[s.offset:s.offset + s.numel] += res2[r][1].state.params[s.name]["residual"].double()
        assert not any(k.startswith(OWNER_KEY) for k in res2[r][1].state.params)
    assert (applied2 + residuals2 - total_in)[dgc].abs().max() > 1e-2


def test_checkpoint_round_trip_resumes_bitwise_with_both_residuals():
    n, steps, cut = 3, 6, 3
    cfg = dict(DGC, momentum_correction=True)
    full, inputs = _run(n, steps, "mean", 4, True, dgc=cfg)
    first, _ = _run(n, cut, "mean", 4, True, dgc=cfg)
    states = []
    for r in range(n):
        buf = io.BytesIO()
        sd = first[r][1].state_dict()
        assert any(k.startswith(OWNER_KEY) for k in sd["sparsifiers"]["params"])
        torch.save(sd, buf)
        buf.seek(0)
        states.append(torch.load(buf))

    def resumed(state):
        cfg_b = dict(cfg, value_bits=4, owner_error_feedback=True)

        def fn(comm):
            sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=cfg_b, natural={})
            if state is not None:
                sync.load_state_dict(state[comm.rank])
            else:
                sync.state.step = cut
            outs = []
            for s in range(cut, steps):
                outs.append(sync.sync_flat(inputs[s][comm.rank], SLICES, "mean").clone())
                sync.end_step()
            return outs

        return SimWorld(n).run(fn)

    got = resumed(states)
    for r in range(n):
        for k, s in enumerate(range(cut, steps)):
            assert torch.equal(got[r][k], full[r][0][s]), (r, s)
    # Without the owner residuals (sender residuals restored) the run differs: the test can fail.
    no_owner = [dict(st, sparsifiers=dict(st["sparsifiers"], params={k: v for k, v in st["sparsifiers"]["params"].items()
                                                                     if not k.startswith(OWNER_KEY)})) for st in states]
    lost = resumed(no_owner)
    assert any(not torch.equal(lost[0][k], full[0][0][cut + k]) for k in range(steps - cut))


def test_bytes_fall_with_the_bits():
    n = 4
    sent = {}
    for bits in (None, 8, 4):
        def fn(comm, bits=bits):
            sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds={"w": "dgc"},
                                dgc={"enabled": True, "density": 0.02, "min_numel": 16, "value_bits": bits})
            from zen_ext.reduction.slices import GradSlice
            x = torch.randn(200_000, generator=torch.Generator().manual_seed(comm.rank))
            before = comm.stats.snapshot()
            sync.sync_flat(x, [GradSlice("w", 0, 200_000, (400, 500))], "mean")
            return (comm.stats - before).bytes_sent
        sent[bits] = max(SimWorld(n).run(fn))
    # At 4 ranks and 2 % the bitmap and the push positions are a large share: 8 bits halve, 4 bits a bit more.
    assert sent[8] < 0.6 * sent[None] and sent[4] < 0.9 * sent[8], sent


@pytest.mark.skipif(not ops.has_lowbit_op(torch.zeros(1)), reason="needs the zen_ext C++ op")
@pytest.mark.parametrize("path", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("dtype, op", [(torch.float32, "mean"), (torch.bfloat16, "sum")])
def test_fused_ops_leave_every_result_and_residual_bitwise_as_the_unfused_sequence(path, dtype, op):
    """The fused ops' oracles are the torch sequences the schemes ran before (gather, quantize, index_add_;
    dequantize, index_add_, index_fill_; index_select, add, quantize, cast, where, index_copy_): outputs and
    both residuals equal bit for bit with the compiled ops and with the oracles, at 4 ranks."""
    def run():
        res = (_run(4, 3, op, 4, True, dtype, jitter=0.3) if path == "all_reduce"
               else _run_rs(4, 3, op, 4, True, dtype=dtype, jitter=0.3))
        return [([o.view(torch.uint8) for o in outs], {k: {kk: t.view(torch.uint8) for kk, t in e.items()}
                                                         for k, e in sync.state.params.items()})
                for outs, sync in res[0]]

    fused = run()
    with ops.force_reference(*ops.FUSED_LOWBIT_OPS):
        unfused = run()
    assert len(fused) == 4
    for (o1, s1), (o2, s2) in zip(fused, unfused):
        assert all(torch.equal(a, b) for a, b in zip(o1, o2))
        assert s1.keys() == s2.keys() and any(k.startswith(OWNER_KEY) for k in s1)
        assert all(torch.equal(s1[k][kk], s2[k][kk]) for k in s1 for kk in s1[k])


# --- the reduce-scatter (ZeRO-2 reduce_scatter, ZeRO-3, FSDP2): core/rs_zen.py ------------------------------
def _run_rs(n, steps, op="sum", bits=4, owner=True, rs=None, seed=0, dtype=torch.float32, jitter=0.0):
    from zen_ext.core.rs_base import even_ranges

    cfg = dict(DGC, value_bits=bits, owner_error_feedback=owner)
    inputs = _inputs(n, steps, seed, dtype, jitter)
    ranges = even_ranges(NUMEL, n)

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=cfg, natural={},
                            reduce_scatter=rs)
        outs = []
        for x in inputs:
            outs.append(reduce_scatter_flat(sync, x[comm.rank].clone(), SLICES, ranges, op).clone())
            sync.end_step()
        return outs, sync

    return SimWorld(n).run(fn), inputs


@pytest.mark.parametrize("rs", ["direct", "dense"])
def test_reduce_scatters_that_cannot_carry_low_bits_are_refused(rs):
    comm = SimWorld(1).communicators()[0]
    sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"w": "dgc"}, dgc=dict(DGC, value_bits=4),
                        reduce_scatter=rs)
    with pytest.raises(ValueError, match=r"zen.dgc.value_bits \(4\) must go with a reduce-scatter that carries "
                                         r"low-bit values, not '" + rs + r"'; reduce-scatter schemes that carry it: "
                                         r"\['zen', 'auto'\]"):
        sync.rs_scheme
    auto = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"w": "dgc"}, dgc=dict(DGC, value_bits=4),
                        reduce_scatter="auto").rs_scheme
    assert auto.schemes == ("zen",)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("bits, owner", [(4, True), (8, True), (4, False)])
def test_reduce_scatter_is_close_to_today_and_drops_nothing(n, bits, owner):
    steps = 4
    res, inputs = _run_rs(n, steps, "sum", bits, owner)
    plain, _ = _run_rs(n, steps, "sum", None, owner)
    got = [torch.cat([res[r][0][s] for r in range(n)]) for s in range(steps)]
    want = [torch.cat([plain[r][0][s] for r in range(n)]) for s in range(steps)]
    dgc = torch.zeros(NUMEL, dtype=torch.bool)
    for s in DGC_SLICES:
        dgc[s.offset:s.offset + s.numel] = True
    for s in range(steps):
        assert torch.equal(got[s][~dgc], want[s][~dgc])  # natural rows and dense slices: exact
        assert (got[s][dgc] - want[s][dgc]).abs().max() <= (12 if bits == 4 else 1.5) * n
    assert any(not torch.equal(got[s], want[s]) for s in range(steps))
    # Inputs = applied + sender residuals + owner residuals (exactly up to fp32 roundings with owner feedback).
    residuals = torch.zeros(NUMEL, dtype=torch.float64)
    concat = torch.cat([torch.arange(s.offset, s.offset + s.numel) for s in DGC_SLICES])
    part = build_scheme("zen").partitioner(concat.numel(), n)
    for r in range(n):
        sync = res[r][1]
        for s in DGC_SLICES:
            residuals[s.offset:s.offset + s.numel] += sync.state.params[s.name]["residual"].double()
        for k, e in sync.state.params.items():
            if k.startswith(OWNER_KEY):
                R = e["owner_residual"].double()
                residuals[concat[part.indices_of(r, torch.arange(R.numel()))]] += R
    err = (sum(g.double() for g in got) + residuals - sum(x[r].double() for x in inputs for r in range(n)))[dgc]
    if owner:
        assert err.abs().max() <= 1e-3, err.abs().max()
    else:
        assert err.abs().max() > 1e-2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("density", [0.02, 0.3])
def test_auto_cost_model_predicts_the_low_bit_bytes_exactly(bits, n, density):
    """``ZenScheme.predict_traffic`` with ``value_bits`` equals SimWorld's bytes, messages and rounds."""
    from zen_ext.analysis import workloads as W
    from zen_ext.core.lowbit import LowBitValues
    from zen_ext.planner import cost_model as cm
    from zen_ext.planner.profile import profile_from_grads

    inputs = W.dgc_topk(n, numel=1 << 14, density=density)
    profile = profile_from_grads(inputs, sample_budget=10**9)
    for name in ("zen", "zen_coo"):
        scheme = build_scheme(name)
        world = SimWorld(n)
        world.run(lambda c, x: scheme.sync(c, type(x)(x.indices, x.values, x.numel, lowbit=LowBitValues(bits))), inputs)
        got = [(s.bytes_sent, s.bytes_recv, s.msgs_sent, s.msgs_recv, s.rounds) for s in world.stats]
        want = [(s.bytes_sent, s.bytes_recv, s.msgs_sent, s.msgs_recv, s.rounds)
                for s in cm.predict_stats(name, profile, {"value_bits": bits}, first_call=True)]
        assert got == want, name
        plain = cm.predict_stats(name, profile, {}, first_call=True)
        assert max(s.bytes_sent for s in world.stats) < max(s.bytes_sent for s in plain)


@pytest.mark.parametrize("pull_format", ["auto", "coo", "bitmap", "dense"])
def test_host_syncs_bounded_and_independent_of_n(pull_format):
    """The low-bit path reads the host a constant number of times per call whatever n (GPU rule)."""
    from tests.unit.test_zen_host_syncs import SyncCounter
    from tests.unit.test_zen_scheme import int_inputs
    from zen_ext.core.lowbit import LowBitValues

    per_n = {}
    for n in (4, 16):
        inputs = int_inputs(n, numel=50_003, nnz=400, seed=n)
        scheme = build_scheme("zen", pull_format=pull_format)

        def fn(comm, x):
            x = type(x)(x.indices, x.values, x.numel, lowbit=LowBitValues(4))
            scheme.sync(comm, x, op="mean")
            with SyncCounter() as c:
                scheme.sync(comm, x, op="mean")
            return c.calls

        got = SimWorld(n).run(fn, inputs)
        per_n[n] = max(len(c) for c in got)
        assert per_n[n] <= 8, got[0]
    assert per_n[4] == per_n[16], per_n


def test_composes_with_the_4bit_residual():
    """``residual_dtype: "int4"`` with ``value_bits: 4``: replicas agree bitwise, and nothing is dropped beyond
    the 4-bit residual's own rounding: inputs = applied + every sender's (dequantized) 4-bit residual + every
    owner residual, within the blocks' ``(max − min)/30`` per rank and step."""
    n, steps = 3, 4
    res, inputs = _run(n, steps, "sum", 4, True, dgc=dict(DGC, residual_dtype="int4"))
    for s in range(steps):
        for r in range(1, n):
            assert torch.equal(res[r][0][s], res[0][0][s])
    concat = torch.cat([torch.arange(s.offset, s.offset + s.numel) for s in DGC_SLICES])
    part = build_scheme("zen").partitioner(concat.numel(), n)
    total = sum(res[0][0][s].double() for s in range(steps))[concat]
    bound = 0.0
    for r in range(n):
        sync = res[r][1]
        for s in DGC_SLICES:
            e = sync.state.params[s.name]
            assert "residual_codes" in e
            at = int((concat == s.offset).nonzero())
            total[at:at + s.numel] += dequantize(e["residual_codes"], e["residual_scales"], s.numel).double()
            sc = e["residual_scales"].view(-1, 2)
            bound += steps * float((sc[:, 1] - sc[:, 0]).max()) / 30
        R = next(e["owner_residual"] for k, e in sync.state.params.items() if k.startswith(OWNER_KEY)).double()
        total[part.indices_of(r, torch.arange(R.numel()))] += R
    want = sum(x[r].double() for x in inputs for r in range(n))[concat]
    err = (total - want).abs()
    assert err.max() <= bound, (float(err.max()), bound)


def test_auto_runs_low_bit_values_through_its_carrier():
    """``auto`` narrowed to the carriers passes low-bit gradients to the one it chose: the same bits as ``zen``."""
    res, _ = _run(3, 2, "mean", 4, True, scheme="auto")
    ref, _ = _run(3, 2, "mean", 4, True, scheme="zen")
    for r in range(3):
        for s in range(2):
            assert torch.equal(res[r][0][s], res[0][0][s])
    assert res[0][1].scheme.carries_low_bits and set(res[0][1].scheme.candidates) <= {"zen", "zen_coo"}
    assert (res[0][0][1] - ref[0][0][1]).abs().max() <= 12


@pytest.mark.parametrize("bits,block", [(8, 128), (4, 16)])
def test_each_width_quantizes_in_its_own_block(monkeypatch, bits, block):
    """Per-step DGC values: blocks of 128 at 8 bits, 16 at 4 (``core/lowbit.py``: why), at the sender and the
    owner; the cost model counts the same scales (its bytes equal SimWorld's in the test above)."""
    from zen_ext.core import zen_lowbit

    seen = []
    for name in ("quantize_sent_", "quantize_owned_"):
        real = getattr(ops, name)

        def spy(*a, _real=real, _name=name):
            seen.append((_name, a[5] if _name == "quantize_sent_" else a[4], a[6] if _name == "quantize_sent_" else a[5]))
            return _real(*a)
        monkeypatch.setattr(zen_lowbit.ops, name, spy)
    _run(3, 2, bits=bits)
    assert {s[0] for s in seen} == {"quantize_sent_", "quantize_owned_"}
    assert {(b, k) for _, b, k in seen} == {(bits, block)}


def test_outer_low_bit_picks_keep_blocks_of_128(monkeypatch):
    """``zen.outer``'s picks keep blocks of 128 at 4 bits (``outer/average.py``: the block its bytes and quality
    were measured with), where per-step DGC uses 32."""
    from tests.unit.test_outer_lowbit import _rounds
    from zen_ext.core import zen_lowbit

    seen = []
    real = ops.quantize_sent_
    monkeypatch.setattr(zen_lowbit.ops, "quantize_sent_", lambda *a: seen.append(a[6]) or real(*a))
    _rounds(3, {"enabled": True, "every": 2, "density": 0.25, "value_bits": 4}, rounds=1)
    assert seen and set(seen) == {128}
