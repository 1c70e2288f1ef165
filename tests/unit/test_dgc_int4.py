"""``zen.dgc.residual_dtype: "int4"`` in the sparsifier (zen_ext/compress/dgc/int4.py): what is sent plus
the 4-bit residual equals the accumulated velocity up to the quantization bound; every path (torch
reference and compiled op, momentum correction, the flush, dense steps, fp32/bf16/fp16 gradients) agrees;
it converges on a tiny problem; config errors; checkpoints round-trip and convert; loss scaling; the
Synchronizer over SimWorld ranks; the memory it holds."""

from __future__ import annotations

import io
import math

import pytest
import torch

from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs, run_steps
from zen_ext import ops
from zen_ext.compress import DGCConfig, DGCSparsifier, NamedGrad
from zen_ext.compress.dgc.int4 import CODES, INT4_BLOCK, SCALES, dequantize

SHAPES = [("a", (300, 70)), ("b", (1000, 64)), ("c", (33, 33))]
INT4 = {"enabled": True, "density": 0.05, "residual_dtype": "int4", "min_numel": 256}


def _grads(step, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    return [NamedGrad(n, (torch.randn(math.prod(s), generator=g) * scale).to(dtype)) for n, s in SHAPES]


def _residual(sp, name, numel):
    e = sp.state.params[name]
    return dequantize(e[CODES], e[SCALES], numel)


def _block_range(sp, name):
    s = sp.state.params[name][SCALES].view(-1, 2)
    return (s[:, 1] - s[:, 0]).repeat_interleave(INT4_BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum, rounding", [(False, "nearest"), (True, "nearest"), (False, "stochastic")])
def test_sent_plus_residual_is_the_accumulation_within_the_bound(dtype, momentum, rounding):
    cfg = dict(INT4, momentum_correction=momentum, momentum_masking=momentum, flush_fraction=0.1,
               int4_rounding=rounding)
    sp = DGCSparsifier(cfg)
    numels = {n: math.prod(s) for n, s in SHAPES}
    offsets = dict(zip(numels, [0, *torch.tensor(list(numels.values())).cumsum(0).tolist()[:-1]]))
    prev = {n: torch.zeros(k) for n, k in numels.items()}
    vel = {n: torch.zeros(k) for n, k in numels.items()}
    for step in range(6):
        grads = _grads(step, dtype)
        out = sp.compress(grads)
        sp.state.step += 1
        sent = torch.zeros(sum(numels.values())).index_add_(0, out.indices, out.values.float())
        assert out.values.dtype == dtype and 0.04 < out.indices.numel() / sent.numel() < 0.2
        for g in grads:
            k, at = numels[g.name], offsets[g.name]
            if momentum:
                vel[g.name] = vel[g.name] * 0.9 + g.grad.float()
                add = vel[g.name]
            else:
                add = g.grad.float()
            a = prev[g.name] + add
            now = _residual(sp, g.name, k)
            # sent + kept = a, up to (Δ − δ)/30 per element of the block the element lies in (/15 when
            # rounding stochastically).
            err = (sent[at:at + k] + now - a).abs()
            bound = _block_range(sp, g.name)[:k] / (30 if rounding == "nearest" else 15) + 1e-6 * a.abs().max()
            assert (err <= bound).all(), (err - bound).max()
            if momentum:  # masked where sent; the velocity the sparsifier keeps
                vel[g.name] = sp.state.params[g.name]["momentum"].clone()
            prev[g.name] = now


@pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="zen_ext._C is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [{}, {"momentum_correction": True, "flush_fraction": 0.2},
                                 {"dense_steps": 2}, {"selection": "per_bucket"}, {"int4_rounding": "stochastic"}])
def test_compiled_ops_and_reference_agree_bit_for_bit(dtype, cfg):
    outs = []
    for force in [False, True]:
        sp = DGCSparsifier(dict(INT4, **cfg))
        with ops.force_reference(*(["dgc_int4_select", "dgc_int4_requantize_"] if force else [])):
            got = []
            for step in range(4):
                r = sp.compress(_grads(step, dtype))
                sp.state.step += 1
                got.append((r.indices, r.values))
        outs.append((got, {n: {k: v.clone() for k, v in e.items()} for n, e in sp.state.params.items()
                           if n != "threshold"}))
    (got0, st0), (got1, st1) = outs
    for (i0, v0), (i1, v1) in zip(got0, got1):
        assert torch.equal(i0, i1) and torch.equal(v0, v1)
    for n in st0:
        for k in (CODES, SCALES):
            assert torch.equal(st0[n][k], st1[n][k])


def test_config_errors():
    with pytest.raises(ValueError, match=r"zen.dgc.residual_dtype \('int8'\) must be one of \['float32', 'bfloat16', 'int4'\]"):
        DGCConfig(residual_dtype="int8")
    with pytest.raises(ValueError, match=r'zen.dgc.residual_dtype \("int4"\) must go with zen.dgc.threshold "sampled"'):
        DGCConfig(residual_dtype="int4", threshold="exact")
    with pytest.raises(ValueError, match=r'zen.dgc.residual_dtype \("int4"\) must go with zen.dgc.clip_norm null'):
        DGCConfig(residual_dtype="int4", clip_norm=1.0)
    with pytest.raises(ValueError, match=r"zen.dgc.int4_rounding \('up'\) must be one of \['nearest', 'stochastic'\]"):
        DGCConfig(residual_dtype="int4", int4_rounding="up")
    assert DGCConfig.from_dict({"residual_dtype": "int4"}).residual_dtype == "int4"


def test_non_finite_gradient_leaves_the_residual_alone():
    sp = DGCSparsifier(INT4)
    sp.compress(_grads(0))
    sp.state.step += 1
    before = {n: {k: v.clone() for k, v in e.items() if k in (CODES, SCALES)} for n, e in sp.state.params.items()}
    grads = _grads(1)
    grads[1].grad[7] = math.inf
    out = sp.compress(grads)
    assert out.indices.tolist() == [21000 + 7] and math.isinf(out.values[0])
    for n, e in before.items():
        for k, v in e.items():
            assert torch.equal(sp.state.params[n][k], v)


@pytest.mark.slow  # two 300-step runs of a 2048 × 400 least-squares problem: about a minute on one core
def test_converges_on_a_tiny_problem_like_the_fp32_residual():
    """Least squares, SGD on the DGC output (density 5 %): both residuals bring the loss down by five
    orders of magnitude, the 4-bit one's final loss within 10 % of the fp32 one's (measured: 4 % below)."""
    g = torch.Generator().manual_seed(0)
    A, w_true = torch.randn(2048, 400, generator=g), torch.randn(400, 300, generator=g)
    Y = A @ w_true

    def train(residual_dtype):
        sp = DGCSparsifier({"enabled": True, "density": 0.05, "residual_dtype": residual_dtype, "min_numel": 256})
        W = torch.zeros(400, 300)
        losses = []
        for step in range(300):
            err = A @ W - Y
            losses.append(float((err ** 2).mean()))
            grad = (A.T @ err) * (2 / err.numel())
            out = sp.compress([NamedGrad("W", grad.flatten())])
            sp.state.step += 1
            W.view(-1).index_add_(0, out.indices, out.values, alpha=-5.0)
        return losses

    fp32, int4 = train("float32"), train("int4")
    assert fp32[-1] < fp32[0] * 1e-4 and int4[-1] < int4[0] * 1e-4
    assert abs(int4[-1] - fp32[-1]) <= 0.1 * fp32[-1], (fp32[-1], int4[-1])


def test_state_dict_round_trip_continues_bit_for_bit():
    cfg = dict(INT4, momentum_correction=True, flush_fraction=0.1)
    straight = DGCSparsifier(cfg)
    for step in range(5):
        out_s = straight.compress(_grads(step))
        straight.state.step += 1
        if step == 2:
            buf = io.BytesIO()
            torch.save(straight.state.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    assert set(sd["params"]["a"]) == {CODES, SCALES, "momentum", "threshold"}
    assert sd["params"]["a"][CODES].dtype == torch.uint8 and sd["params"]["a"][CODES].numel() == 83 * 128
    resumed = DGCSparsifier(cfg)
    resumed.state.load_state_dict(sd)
    for step in range(3, 5):
        out_r = resumed.compress(_grads(step))
        resumed.state.step += 1
    assert torch.equal(out_r.indices, out_s.indices) and torch.equal(out_r.values, out_s.values)
    for n in ("a", "b", "c"):
        for k in (CODES, SCALES, "momentum"):
            assert torch.equal(resumed.state.params[n][k], straight.state.params[n][k])


@pytest.mark.parametrize("src, dst", [("float32", "int4"), ("bfloat16", "int4"), ("int4", "float32"),
                                      ("int4", "bfloat16")])
def test_a_checkpoint_of_another_residual_dtype_converts(src, dst, caplog):
    a = DGCSparsifier(dict(INT4, residual_dtype=src))
    for step in range(3):
        a.compress(_grads(step))
        a.state.step += 1
    sd = a.state.state_dict()
    ref = {n: (_residual(a, n, math.prod(s)) if src == "int4" else a.state.params[n]["residual"].float())
           for n, s in SHAPES}
    b = DGCSparsifier(dict(INT4, residual_dtype=dst))
    b.state.load_state_dict(sd)
    with caplog.at_level("INFO", logger="zen_ext.compress.dgc"):
        out = b.compress([NamedGrad(n, torch.zeros(math.prod(s))) for n, s in SHAPES])  # adds nothing
    assert "converted from a" in caplog.text
    sent = torch.zeros(out.numel).index_add_(0, out.indices, out.values.float())
    at = 0
    for n, s in SHAPES:
        k = math.prod(s)
        got = _residual(b, n, k) if dst == "int4" else b.state.params[n]["residual"].float()
        assert set(b.state.params[n]) & {"residual", CODES} == ({CODES} if dst == "int4" else {"residual"})
        # What the zero step sent plus what it kept is the restored residual: within two quantization
        # errors (a range is at most twice the largest value: 2·2/30) into int4, exactly into fp32, one
        # bf16 rounding into bf16.
        tol = {"int4": 4 / 30, "float32": 0.0, "bfloat16": 2.0 ** -8}[dst] * ref[n].abs().max() + 1e-7
        assert (sent[at:at + k] + got - ref[n]).abs().max() <= tol
        at += k


def test_loss_scale_rescales_the_scales_and_a_discarded_step_restores():
    sp = DGCSparsifier(INT4)
    sp.set_loss_scale(1024.0)
    sp.compress(_grads(0, scale=1024.0))
    sp.end_step()
    sp.state.step += 1
    codes, scales = sp.state.params["a"][CODES].clone(), sp.state.params["a"][SCALES].clone()
    sp.set_loss_scale(512.0)
    assert torch.equal(sp.state.params["a"][CODES], codes)
    assert torch.equal(sp.state.params["a"][SCALES], scales / 2)
    kept = {n: (sp.state.params[n][CODES].clone(), sp.state.params[n][SCALES].clone()) for n, _ in SHAPES}
    sp.compress(_grads(1, scale=512.0))
    assert not torch.equal(sp.state.params["a"][CODES], kept["a"][0])
    sp.discard_step()
    sp.end_step()
    for n, (c, s) in kept.items():
        assert torch.equal(sp.state.params[n][CODES], c) and torch.equal(sp.state.params[n][SCALES], s)


def test_bytes_per_element_with_int4_are_about_half_a_byte():
    """DGC's state per compressed element: fp32 4 bytes, bf16 2, int4 0.5 + scales (≤ 0.53 here)."""
    per_element = {}
    for rd in ("float32", "bfloat16", "int4"):
        sp = DGCSparsifier(dict(INT4, residual_dtype=rd))
        sp.compress(_grads(0, torch.bfloat16))
        held = sum(t.untyped_storage().nbytes() for t in {id(b): b for b in sp.state._flats.values()}.values())
        per_element[rd] = held / sum(math.prod(s) for _, s in SHAPES)
    assert per_element["float32"] == 4 and per_element["bfloat16"] == 2
    assert 0.5 < per_element["int4"] <= 0.54, per_element


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_synchronizer_over_simworld_ranks_sends_what_each_rank_selected(dtype):
    """Two ranks through the Synchronizer (the engines' shared path): the DGC part of the result is the
    mean of what each rank sent, and each rank's 4-bit residual is its input minus what it sent."""
    n = 2
    inputs = bucket_inputs(n, seed=3, dtype=dtype)
    res, _ = run_steps(n, [inputs], "mean", dgc=dict(DGC, residual_dtype="int4"))
    out = res[0][0][0].float()
    sent = []
    for r in range(n):
        sync = res[r][2]
        parts = []
        for s in SLICES:
            if KINDS[s.name] == "dgc":
                kept = dequantize(sync.state.params[s.name][CODES], sync.state.params[s.name][SCALES], s.numel)
                parts.append((s, inputs[r][s.offset:s.offset + s.numel].float() - kept))
        sent.append(parts)
    for j, (s, _) in enumerate(sent[0]):
        mean = sum(sent[r][j][1] for r in range(n)) / n
        got = out[s.offset:s.offset + s.numel]
        assert (got - mean).abs().max() <= 20 / 30 + 0.05, s.name  # inputs in [-9, 9]: a block range ≤ 18
        assert (got != 0).float().mean() < 0.3
    assert torch.equal(res[0][0][0], res[1][0][0])
    assert NUMEL == 2472


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_ranks_share_one_threshold_with_the_4bit_residual(tp):
    """Under tensor parallelism the samples are pooled over the TP group (the dequantizing gather feeds
    them): every TP rank gets the same per-layer thresholds and selects exactly ``|a| ≥ thr``."""
    from zen_ext import SimWorld

    gen = torch.Generator().manual_seed(tp)
    shards = [[torch.randn(2000 + 300 * r, generator=gen) * (r + 1), torch.randn(1500, generator=gen) * 0.1]
              for r in range(tp)]

    def fn(comm, grads):
        sp = DGCSparsifier(dict(INT4, momentum_correction=False))
        sp.compress([NamedGrad(f"p{i}", g) for i, g in enumerate(grads)], tp_comm=comm)
        sp.state.step += 1
        sg = sp.compress([NamedGrad(f"p{i}", g) for i, g in enumerate(grads)], tp_comm=comm)
        return sg, [sp.state.get(f"p{i}", "threshold") for i in range(2)]

    out = SimWorld(tp).run(fn, shards)
    for _, thr in out[1:]:
        assert torch.equal(thr[0], out[0][1][0]) and torch.equal(thr[1], out[0][1][1])
    assert not torch.equal(out[0][1][0], out[0][1][1])
    for sg, thr in out:
        assert sg.nnz and sg.values.abs().min() >= min(float(thr[0]), float(thr[1]))


def test_int4_is_refused_when_the_scheme_selects_its_own_entries():
    """SparDL writes DGC's accumulated memory back in place, which 4-bit codes cannot hold: building the
    Synchronizer (at attach, before the first step) refuses the pair, naming the residual dtypes it takes;
    the same DGC section runs with the other schemes and spardl takes the float residuals."""
    from zen_ext import SimWorld
    from zen_ext.reduction.synchronizer import Synchronizer

    comm = SimWorld(1).communicators()[0]
    dgc = {"enabled": True, "residual_dtype": "int4"}
    with pytest.raises(ValueError, match=r"zen\.dgc\.residual_dtype \('int4'\) must be \"float32\" or \"bfloat16\" "
                                         r"with a scheme that selects its own entries \(spardl\)"):
        Synchronizer(dp_comm=comm, scheme="spardl", param_kinds={"w": "dgc"}, dgc=dgc)
    for scheme in ("zen", "dense"):
        assert not Synchronizer(dp_comm=comm, scheme=scheme, param_kinds={"w": "dgc"}, dgc=dgc).sparsifiers["dgc"].hand_over
    sp = Synchronizer(dp_comm=comm, scheme="spardl", param_kinds={"w": "dgc"},
                      dgc={"enabled": True, "residual_dtype": "bfloat16"}).sparsifiers["dgc"]
    assert sp.hand_over
