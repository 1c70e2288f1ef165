"""ZEN as FSDP2 HSDP's cross-replica all-reduce (``zen_ext.fsdp.attach`` on a 2-D ``(replicate, shard)``
mesh) on real gloo processes, against plain HSDP.

* natural-only ZEN equals plain HSDP bitwise (losses, every step's gradient shard, parameters) on a 2×2
  mesh: fp32 and bf16, a bf16 ``MixedPrecisionPolicy``, FSDP's sum (a gradient divide factor with
  sum-only comms), gradient accumulation with ``set_requires_all_reduce(False)``; and on 2×3 and 3×2;
  sum-only comms without a divide factor on 2×3, 3×2 and 3×3;
  ``SplitLM`` (tests/multiproc/test_fsdp.py) has integer gradients, so equality is the test;
* with DGC, every lossless scheme (``zen``, ``agsparse``) equals ``dense`` fed the same DGC output, and
  DGC's state is the shard's: ``P / L`` elements a rank where 1-D FSDP keeps ``P``;
* ``state_dict`` round trip: a resumed run equals an uninterrupted one; ``close()`` hands the all-reduce
  back to FSDP; ``guard_nonfinite`` turns a NaN on one rank into NaN on every rank's shard;
* clear errors for what is not served, and for ranks that attach differently.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.fsdp_helpers import assert_same_run, caught, resume_into, state_bytes, tensors, train_sgd
from tests.multiproc.launch import run_workers
from tests.multiproc.test_fsdp import SplitLM, _batch

STEPS = 4
NATURAL = {"scheme": "zen", "natural": {"enabled": True}}
DGC = {"natural": {"enabled": True}, "dgc": {"enabled": True, "density": 0.3, "min_numel": 8,
                                              "momentum_correction": False, "warmup_steps": 0}}


def _mesh(shape, names=("replicate", "shard")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _shard(model, mesh, op="avg", mp=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp)
    for child in model.children():
        fully_shard(child, **kw)
    fully_shard(model, **kw)
    if op in ("sum", "sum-only"):  # FSDP's sum: a divide factor of 1; sum-only: FSDP's own divisions by sums
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
                if op == "sum":
                    m.set_gradient_divide_factor(1.0)
    return model


def _train(model, rank, world, dtype, steps=STEPS, start=0, accumulate=1):
    """SGD steps; with ``accumulate`` > 1, micro-batches reduce-scatter only and the last all-reduces."""
    return train_sgd(model, lambda i: _batch(i, rank, world, dtype), steps, start, accumulate=accumulate)


def _run(rank, world, shape, zen, dtype=torch.float32, op="avg", mp=None, accumulate=1):
    import zen_ext.fsdp

    model = _shard(SplitLM(dtype), _mesh(shape), op, mp)
    a = zen_ext.fsdp.attach(model, zen) if zen is not None else None
    out = _train(model, rank, world, dtype, accumulate=accumulate)
    if a is not None:
        out += (a.step, dict(a.sync.param_kinds), a.totals, state_bytes(a.state_dict()["sync"]["sparsifiers"]))
        a.close()
    return out


def _equal_runs(rank, world, shape, full):
    """``{case: (reference run, ZEN run)}``; ``full`` adds the dtypes, ops and accumulation."""
    cases = {("natural", "fp32"): (_run(rank, world, shape, None), _run(rank, world, shape, NATURAL))}
    if full:
        bf16 = torch.bfloat16
        cases[("natural", "bf16")] = (_run(rank, world, shape, None, bf16), _run(rank, world, shape, NATURAL, bf16))
        cases[("natural", "mp-bf16")] = (_run(rank, world, shape, None, mp=bf16),
                                         _run(rank, world, shape, NATURAL, mp=bf16))
        cases[("natural", "sum")] = (_run(rank, world, shape, None, op="sum"),
                                     _run(rank, world, shape, NATURAL, op="sum"))
        cases[("natural", "accumulate")] = (_run(rank, world, shape, None, accumulate=3),
                                            _run(rank, world, shape, NATURAL, accumulate=3))
    dense = _run(rank, world, shape, {**DGC, "scheme": "dense"})
    for scheme in ("zen", "agsparse") if full else ("zen",):
        cases[("dgc", scheme)] = (dense, _run(rank, world, shape, {**DGC, "scheme": scheme}))
    return cases


def _check(per_rank, world):
    for rank, cases in enumerate(per_rank):
        for (what, how), (ref, got) in cases.items():
            where = f"rank {rank}/{world} {what} {how}"
            losses, grads, params, steps, kinds, totals, _ = got
            assert steps == STEPS, where
            assert kinds["embed.weight"] == "natural", where
            if what == "dgc":
                assert kinds["proj.weight"] == "dgc", where
            assert_same_run(ref, got, where)
            assert totals["bytes_sent"] > 0 and totals["dense_bytes"] > 0, where


def test_natural_and_dgc_equal_plain_hsdp_2x2():
    _check(run_workers(_equal_runs, 4, (2, 2), True, timeout_s=900), 4)


@pytest.mark.parametrize("shape", [(2, 3), (3, 2)])
def test_natural_and_dgc_equal_plain_hsdp_six_ranks(shape):
    _check(run_workers(_equal_runs, 6, shape, False, timeout_s=900), 6)


def _sum_only_runs(rank, world, shape):
    """Plain HSDP and natural-only ZEN with sum-only communication and no gradient divide factor; the divide
    factors of FSDP's parameter groups while ZEN is attached and after ``close()``."""
    import zen_ext.fsdp
    from zen_ext.engines.fsdp_hsdp import hsdp_param_groups

    ref = _run(rank, world, shape, None, op="sum-only")
    model = _shard(SplitLM(torch.float32), _mesh(shape), "sum-only")
    a = zen_ext.fsdp.attach(model, NATURAL)
    attached = {pg.gradient_divide_factor for _, _, pg in hsdp_param_groups(model)}
    got = _train(model, rank, world, torch.float32)
    got += (a.step, dict(a.sync.param_kinds), a.totals, 0)
    a.close()
    closed = {pg.gradient_divide_factor for _, _, pg in hsdp_param_groups(model)}
    return {("natural", "sum-only"): (ref, got)}, attached, closed


@pytest.mark.parametrize("shape", [(2, 3), (3, 2), (3, 3)])
def test_sum_only_without_a_factor_equals_plain_hsdp(shape):
    """Sum-only communication (``set_force_sum_reduction_for_comms``) without a divide factor: plain HSDP divides
    the sum by ``N·L`` once; ZEN's hook sets that factor on FSDP's parameter groups, so FSDP divides as plain
    HSDP and ZEN sums (a mean over the replicas would give ``sum/N/L``: different roundings at 3×3, where
    neither is a power of two). Integer gradients: equal bit for bit; ``close()`` clears the factor."""
    world = shape[0] * shape[1]
    per_rank = run_workers(_sum_only_runs, world, shape, timeout_s=900)
    _check([cases for cases, _, _ in per_rank], world)
    for rank, (_, attached, closed) in enumerate(per_rank):
        assert attached == {float(world)} and closed == {None}, (rank, attached, closed)


# --- DGC's state is the shard's ---------------------------------------------------------------------------
def _dgc_state(rank, world):
    import zen_ext.fsdp
    from torch.distributed.fsdp import fully_shard

    zen = {**DGC, "natural": {"enabled": False}, "scheme": "zen"}
    hsdp = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    a = zen_ext.fsdp.attach(hsdp, zen)
    _train(hsdp, rank, world, torch.float32, steps=2)
    flat = SplitLM(torch.float32)
    for child in flat.children():
        fully_shard(child)
    fully_shard(flat)
    b = zen_ext.fsdp.attach(flat, zen)
    _train(flat, rank, world, torch.float32, steps=2)
    kinds = a.sync.param_kinds
    return a.state_dict(), b.state_dict(), sorted(n for n, k in kinds.items() if k == "dgc")


def test_dgc_state_is_shard_sized():
    """HSDP 2×2 keeps DGC's residual for the rank's shard (``P / 2``, whole rows of each chunk), 1-D FSDP at 4
    ranks for all of ``P``: fp32 residual, 4 bytes an element."""
    from zen_ext.fsdp import shard_layout

    for rank, (hsdp, flat, dgc) in enumerate(run_workers(_dgc_state, 4)):
        assert dgc == ["embed.weight", "proj.weight"], dgc
        shapes = {"embed.weight": (11, 4), "proj.weight": (5, 6)}
        params = [(n, shapes[n]) for n in dgc]
        mine = sum(s.numel for n in dgc for s in shard_layout([(n, shapes[n])], 2, rank % 2)[0])
        whole = sum(torch.Size(s).numel() for _, s in params)
        res_h = sum(t.numel() for t in tensors(hsdp["sync"]["sparsifiers"]) if t.numel() > 1)
        res_f = sum(t.numel() for t in tensors(flat["sync"]["sparsifiers"]) if t.numel() > 1)
        assert res_h == mine and res_f == whole, (rank, res_h, mine, res_f, whole)
        assert hsdp["mesh"] == [2, 2] and hsdp["dp_size"] == 4


# --- checkpoints, close -----------------------------------------------------------------------------------
def _resume(rank, world):
    import zen_ext.fsdp

    zen = {**DGC, "scheme": "zen"}
    whole = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    zen_ext.fsdp.attach(whole, zen)
    _, _, ref_params = _train(whole, rank, world, torch.float32, steps=6)
    first = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    a = zen_ext.fsdp.attach(first, zen)
    _train(first, rank, world, torch.float32, steps=3)
    sd = a.state_dict()
    second = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    b, restored = resume_into(second, first, zen, sd)
    _, _, params = _train(second, rank, world, torch.float32, steps=3, start=3)
    # close() hands the all-reduce back to FSDP: the model then trains as plain HSDP.
    plain = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    closed = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    zen_ext.fsdp.attach(closed, zen).close()
    # guard_nonfinite: a NaN on rank 1 reaches its shard group's shards through FSDP's reduce-scatter, and the
    # other node's through the guard (over every rank), which NaN-fills instead of synchronizing.
    guarded = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    g = zen_ext.fsdp.attach(guarded, zen, guard_nonfinite=True)
    loss = guarded(*_batch(0, rank, world, torch.float32))
    (loss * float("nan") if rank == 1 else loss).backward()
    all_nan = all(bool(p.grad.to_local().isnan().all()) for p in guarded.parameters() if p.grad.to_local().numel())
    return sd, restored, ref_params, params, b.step, _train(plain, rank, world, torch.float32)[2], \
        _train(closed, rank, world, torch.float32)[2], (all_nan, g.totals["nonfinite_steps"])


def test_state_dict_round_trip_close_and_guard():
    for rank, (sd, restored, ref_params, params, step, plain, closed, guard) in enumerate(run_workers(_resume, 4)):
        assert guard[0] and guard[1] >= 1, (rank, guard)
        assert str(sd["sync"]) == str(restored["sync"]) and sd["step"] == 3 and step == 6
        assert sd["mesh"] == [2, 2] and "proj.weight" in str(sd["sync"]["sparsifiers"])
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), (rank, name)
            assert torch.equal(closed[name], plain[name]), (rank, name)


# --- errors ---------------------------------------------------------------------------------------------
def _errors(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import zen_ext.fsdp

    out = {}
    # FSDP itself refuses an unnamed 2-D mesh; one named the other way round it would replicate over "shard".
    reversed_ = SplitLM(torch.float32)
    fully_shard(reversed_, mesh=_mesh((2, 1), ("shard", "replicate")))
    out["reversed"] = caught(lambda: zen_ext.fsdp.attach(reversed_, {}))
    mixed = SplitLM(torch.float32)
    fully_shard(mixed.proj)
    fully_shard(mixed, mesh=_mesh((2, 1)))
    out["mixed"] = caught(lambda: zen_ext.fsdp.attach(mixed, {}))
    ok = _shard(SplitLM(torch.float32), _mesh((2, 1)))
    out["hierarchical"] = caught(lambda: zen_ext.fsdp.attach(ok, {"hierarchical": True}))
    out["disabled"] = caught(lambda: zen_ext.fsdp.attach(ok, {"enabled": False}))
    # Ranks that attach with different sections: every rank raises (none waits in a later collective).
    out["disagree"] = caught(lambda: zen_ext.fsdp.attach(ok, {"bucket_cap_mb": 1 + rank}))
    zen_ext.fsdp.attach(ok, NATURAL)
    out["twice"] = caught(lambda: zen_ext.fsdp.attach(ok, {}))
    # A shard dim of size 1 (plain replication) is served: FSDP skips its reduce-scatter, ZEN averages.
    out["replicate-only"] = (_train(_shard(SplitLM(torch.float32), _mesh((2, 1))), rank, world, torch.float32),
                             _train(ok, rank, world, torch.float32))
    # Sum-only communication switched on after attach: FSDP no longer divides as ZEN's op was chosen for.
    for m in ok.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    out["switched"] = caught(lambda: ok(*_batch(0, rank, world, torch.float32)).backward())
    dist.barrier()
    return out


def test_unsupported_setups_raise_clear_errors():
    for out in run_workers(_errors, 2):
        assert out["reversed"][0] == "NotImplementedError" and "(\"replicate\", \"shard\")" in out["reversed"][1]
        assert out["mixed"][0] == "NotImplementedError" and "not on the 2-D (HSDP) mesh" in out["mixed"][1]
        assert out["hierarchical"][0] == "NotImplementedError" and "zen.hierarchical" in out["hierarchical"][1]
        assert out["disabled"][0] == "ValueError" and "zen.enabled" in out["disabled"][1]
        assert out["disagree"][0] == "RuntimeError" and "another zen than rank 0" in out["disagree"][1]
        assert out["twice"][0] == "NotImplementedError" and "already has an all-reduce hook" in out["twice"][1]
        assert "1-D device mesh" in out["mixed"][1] and "HSDP" in out["mixed"][1]  # SUPPORTED names both
        assert out["switched"][0] == "RuntimeError" and "set_force_sum_reduction_for_comms before" in out["switched"][1]
        ref, got = out["replicate-only"]
        assert ref[0] == got[0] and all(torch.equal(got[2][n], ref[2][n]) for n in ref[2])


# --- gradient accumulation (zen_ext/engines/fsdp_steps.py) ----------------------------------------------
def _accumulate(rank, world, zen, all_reduce_off: bool, micro=3, steps=2):
    """``steps`` SGD steps of ``micro`` micro-batches each; ``all_reduce_off``: HSDP's own accumulation
    (``set_requires_all_reduce(False)`` but for the last); else every micro-batch reduces (gradient sync on).
    Returns ``(params, ZEN steps, DGC steps)``, or the error and the optimizer steps done before it."""
    import zen_ext.fsdp

    model = _shard(SplitLM(torch.float32), _mesh((2, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    a = zen_ext.fsdp.attach(model, zen) if zen is not None else None
    done = 0
    try:
        for step in range(steps):
            for m in range(micro):
                if all_reduce_off:
                    model.set_requires_all_reduce(m == micro - 1)
                model(*_batch(micro * step + m, rank, world, torch.float32)).backward()
            opt.step()
            opt.zero_grad()
            done += 1
        out = ({n: p.detach().to_local().clone() for n, p in model.named_parameters()},
               a.step if a else None, a.sync.state.step if a else None)
    except NotImplementedError as exc:
        out = {"error": str(exc), "done": done, "zen_steps": a.step}
    if a is not None:
        a.close()
    return out


def _accumulation(rank, world):
    dgc = {**DGC, "scheme": "zen"}
    return {"dgc_every": _accumulate(rank, world, dgc, False), "dgc_off": _accumulate(rank, world, dgc, True),
            "natural_every": _accumulate(rank, world, NATURAL, False),
            "plain_every": _accumulate(rank, world, None, False)}


def test_accumulation_with_dgc_is_refused_or_one_step():
    """Under HSDP, FSDP calls ZEN's all-reduce hook in every backward pass with gradient sync on and adds the
    result to the sharded gradient: DGC is refused at the second micro-batch (before any optimizer step, as on
    a 1-D mesh); with ``set_requires_all_reduce(False)`` FSDP sums the shards first and calls ZEN once a step.
    Natural rows (lossless) are served either way and equal plain HSDP accumulating alike (integer gradients)."""
    for rank, out in enumerate(run_workers(_accumulation, 4, timeout_s=900)):
        err = out["dgc_every"]
        assert isinstance(err, dict) and err["done"] == 0 and err["zen_steps"] == 1, (rank, err)
        for part in ("all-reduced across the replicas", "zen.dgc must see one gradient per optimizer step",
                     "set_requires_gradient_sync(False)", "set_requires_all_reduce(False)"):
            assert part in err["error"], (rank, part, err["error"])
        _, zen_steps, dgc_steps = out["dgc_off"]
        assert zen_steps == 2 and dgc_steps == 2, (rank, zen_steps, dgc_steps)  # one per optimizer step
        params, zen_steps, _ = out["natural_every"]
        assert zen_steps == 2 * 3, (rank, zen_steps)  # every reducing backward pass
        for name, ref in out["plain_every"][0].items():
            assert torch.equal(params[name], ref), (rank, name)


# --- docs/fsdp.md's HSDP snippet ---------------------------------------------------------------------------
def _snippet(rank, world):
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "fsdp.md")).read()
    block = doc.split("<!-- snippet: fsdp-hsdp ", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(block, "docs/fsdp.md#fsdp-hsdp", "exec"), scope)  # noqa: S102 - the documented lines, as written
    model, optimizer, zen = scope["model"], scope["optimizer"], scope["zen"]
    for step in range(2):
        tokens = torch.randint(0, 1000, (8, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    sd = zen.state_dict()
    zen.close()
    return type(zen).__name__, sd["step"], sd["mesh"], state_bytes(sd["sync"]["sparsifiers"])


def test_docs_snippet_runs():
    """The snippet attaches DGC to both Linear weights (16,384 and 256,000 elements, min_numel 1024): each rank
    keeps the fp32 residual of its shard, half of each (whole rows: 128 of 256 rows, 500 of 1000)."""
    for kind, step, mesh, state in run_workers(_snippet, 4):
        assert (kind, step, mesh) == ("ZenHSDP", 2, [2, 2])
        assert 4 * (16_384 + 256_000) // 2 <= state < 4 * (16_384 + 256_000) // 2 + 64, state  # + thresholds
