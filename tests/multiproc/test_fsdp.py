"""ZEN's FSDP2 reduce-scatter (``zen_ext.fsdp.attach``) on real gloo processes, against plain FSDP2.

* natural-only ZEN equals plain FSDP2 bitwise (losses, every step's gradient shard, parameters) at 2,
  3 and 4 ranks, fp32 and bf16, ops AVG, SUM and PREMUL_SUM. ``SplitLM``'s loss is linear in each
  parameter's own output, so gradients are integers whatever the weights: sums are exact in any
  order and equality is the test (a chained model at 2 ranks, where one addition commutes, too);
* parameter counts not divisible by n, ranks whose chunk holds only padding, embedding batches whose
  touched rows all fall in one rank's range (the first, the last), index 0 and the last, duplicates;
* with DGC, the configured scheme's reduce-scatter equals the ``dense`` one fed the same DGC output;
* ``state_dict`` round trip (DGC residuals keyed by name and chunk offset): a resumed run equals an
  uninterrupted one;
* clear errors for what is not served.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.fsdp_helpers import assert_same_run, caught, resume_into, train_sgd
from tests.multiproc.launch import run_workers

VOCAB, WIDTH, IN, HID = 11, 4, 6, 5
STEPS = 5
RS_SCHEME = "zen"
"""The lossless reduce-scatter under test (compared with ``dense``)."""


class SplitLM(torch.nn.Module):
    """An untied embedding (natural rows), a projection (DGC-able) and a one-row head (every rank but
    the first holds only padding of it); the loss is linear in each one's output, so gradients are
    integers for integer inputs."""

    def __init__(self, dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(IN, HID)
        self.head = torch.nn.Linear(HID, 1)
        self.to(dtype)

    def forward(self, ids, x):
        t_e = (torch.arange(ids.numel() * WIDTH).view(*ids.shape, WIDTH) % 5 - 2).to(self.embed.weight.dtype)
        t_p = (torch.arange(x.shape[0] * HID).view(-1, HID) % 3 - 1).to(x.dtype)
        return ((self.embed(ids) * t_e).sum() + (self.proj(x) * t_p).sum() + self.head(x[:, :HID]).sum()).float()


class ChainLM(torch.nn.Module):
    """Embedding → LayerNorm → Linear, gradients through the chain (compared at 2 ranks)."""

    def __init__(self, dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 3 * VOCAB)
        self.to(dtype)

    def forward(self, ids, x):
        return self.head(self.norm(self.embed(ids))).float().logsumexp(-1).mean()


class Partial(torch.nn.Module):
    """Two parameters, the second used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(3))
        self.b = torch.nn.Parameter(torch.ones(3))

    def forward(self, x, use_b=True):
        return (self.a * x + (self.b if use_b else 0)).sum()


def _batch(step: int, rank: int, world: int, dtype):
    """Token ids (adversarial per step) and an integer input."""
    per = -(-VOCAB // world)  # rows per rank chunk
    own = torch.arange(rank, VOCAB, world)
    ids = [own[torch.arange(4) % own.numel()],  # disjoint rows across ranks, duplicates
           torch.tensor([0, per - 1, 1, 0]) % per,  # every touched row in rank 0's range
           VOCAB - 1 - torch.tensor([0, 1, 0, 1]),  # every touched row in the last rank's range
           torch.tensor([3, 7, 3, 7]),  # full overlap, duplicates
           torch.tensor([0, VOCAB - 1, rank % VOCAB, 0])][step % 5]  # first and last row
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(-2, 3, (3, IN), generator=g).to(dtype)
    return ids.view(2, 2), x


def _shard(model, world, op: str, premul: float | None = None):
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        fully_shard(child)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            if op == "sum":
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
            elif op == "premul":
                m.set_gradient_divide_factor(premul)
    return model


def _train(model, rank, world, dtype, steps=STEPS, start=0, lr=0.25):
    return train_sgd(model, lambda i: _batch(i, rank, world, dtype), steps, start, lr)


def _run(model_cls, rank, world, dtype, op, zen, premul=None):
    import zen_ext.fsdp

    model = _shard(model_cls(dtype), world, op, premul)
    attachment = zen_ext.fsdp.attach(model, zen) if zen is not None else None
    out = _train(model, rank, world, dtype)
    if attachment is not None:
        out += (attachment.step, dict(attachment.sync.param_kinds), {**attachment.totals,
                                                                      "schemes": dict(attachment.stats.schemes)})
        attachment.close()
    return out


def _equal_runs(rank, world):
    """Every comparison of one world size: ``{case: (reference run, ZEN run)}``."""
    natural = {"scheme": RS_SCHEME, "natural": {"enabled": True}}
    dgc = {"natural": {"enabled": True}, "dgc": {"enabled": True, "density": 0.3, "min_numel": 8,
                                                  "momentum_correction": False, "warmup_steps": 0}}
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("avg", "sum"):
            cases[("natural", dtype, op)] = (_run(SplitLM, rank, world, dtype, op, None),
                                             _run(SplitLM, rank, world, dtype, op, natural))
        cases[("dgc", dtype, "avg")] = (_run(SplitLM, rank, world, dtype, "avg", {**dgc, "scheme": "dense"}),
                                        _run(SplitLM, rank, world, dtype, "avg", {**dgc, "scheme": RS_SCHEME}))
    # PREMUL_SUM(1/4): ZEN multiplies the input by 1/4 and sums; plain FSDP's SUM, scaled by the same
    # power of two, is the reference (gloo has no PREMUL_SUM).
    cases[("premul", torch.float32, "premul")] = (_run(SplitLM, rank, world, torch.float32, "sum", None),
                                                  _run(SplitLM, rank, world, torch.float32, "premul", natural, 4.0))
    if world == 2:
        for dtype in (torch.float32, torch.bfloat16):
            cases[("chain", dtype, "avg")] = (_run(ChainLM, rank, world, dtype, "avg", None),
                                              _run(ChainLM, rank, world, dtype, "avg", natural))
    return cases


@pytest.fixture(scope="module", params=[2, 3, 4])
def runs(request):
    return request.param, run_workers(_equal_runs, request.param, timeout_s=900)


def test_zen_reduce_scatter_equals_plain_fsdp2(runs):
    world, per_rank = runs
    for rank, cases in enumerate(per_rank):
        for (what, dtype, op), (ref, got) in cases.items():
            where = f"rank {rank}/{world} {what} {dtype} {op}"
            (ref_losses, ref_grads, ref_params), (losses, grads, params, steps, kinds, totals) = ref[:3], got
            assert steps == STEPS, where
            assert kinds["embed.weight"] == "natural", where
            if what == "dgc":
                assert kinds["proj.weight"] == "dgc", where
            if what == "premul":  # FSDP's premultiplied sum: a quarter of the gradient, so other weights
                for step, (r, g) in enumerate(zip(ref_grads, grads)):
                    for name in r:
                        assert torch.equal(g[name], r[name] * 0.25), f"{where} step {step} {name}"
            else:
                assert_same_run((ref_losses, ref_grads, ref_params), (losses, grads, params), where)
            if world > 1:
                assert totals["bytes_sent"] > 0 and totals["dense_bytes"] > 0, where
                # The embedding's chunks went through the scheme under test, every step.
                assert totals["schemes"][("embed.weight:natural", RS_SCHEME)] == STEPS, (where, totals["schemes"])


# --- checkpoints ----------------------------------------------------------------------------------------
def _resume(rank, world):
    import zen_ext.fsdp

    zen = {"scheme": RS_SCHEME, "dgc": {"enabled": True, "density": 0.3, "min_numel": 8, "momentum_correction": False}}
    whole = _shard(SplitLM(torch.float32), world, "avg")
    zen_ext.fsdp.attach(whole, zen)
    _, _, ref_params = _train(whole, rank, world, torch.float32, steps=6)
    first = _shard(SplitLM(torch.float32), world, "avg")
    a = zen_ext.fsdp.attach(first, zen)
    _train(first, rank, world, torch.float32, steps=3)
    sd = a.state_dict()
    second = _shard(SplitLM(torch.float32), world, "avg")
    b, restored = resume_into(second, first, zen, sd)
    _, _, params = _train(second, rank, world, torch.float32, steps=3, start=3)
    return sd, restored, ref_params, params, b.step


def test_state_dict_round_trip_resumes_exactly():
    for rank, (sd, restored, ref_params, params, step) in enumerate(run_workers(_resume, 3)):
        assert str(sd["sync"]) == str(restored["sync"]) and sd["step"] == 3 and step == 6
        assert "proj.weight@" in str(sd["sync"]["sparsifiers"])  # residuals keyed by name and chunk offset
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), (rank, name)


# --- errors ---------------------------------------------------------------------------------------------
def _errors(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zen_ext.fsdp

    out = {"plain": caught(lambda: zen_ext.fsdp.attach(SplitLM(torch.float32), {}))}
    hsdp = SplitLM(torch.float32)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")))
    out["hsdp"] = caught(lambda: zen_ext.fsdp.attach(hsdp, {}))
    # Two parameter groups in one FSDP module: a per-parameter mesh over another process group.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"), shard_mesh_dim=0)
    groups = SplitLM(torch.float32)
    fully_shard(groups, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p is groups.head.weight
                else None)
    out["groups"] = caught(lambda: zen_ext.fsdp.attach(groups, {}))
    dim1 = SplitLM(torch.float32)
    fully_shard(dim1, shard_placement_fn=lambda p: Shard(1) if p is dim1.proj.weight else None)
    out["dim1"] = caught(lambda: zen_ext.fsdp.attach(dim1, {}))
    ok = _shard(SplitLM(torch.float32), world, "avg")
    out["disabled"] = caught(lambda: zen_ext.fsdp.attach(ok, {"enabled": False}))
    out["scheme"] = caught(lambda: zen_ext.fsdp.attach(ok, {"scheme": "sparcml"}))
    ef21 = {"scheme": RS_SCHEME, "dgc": {"enabled": True, "feedback": "ef21"}}
    out["ef21"] = caught(lambda: zen_ext.fsdp.attach(ok, ef21))
    zen_ext.fsdp.attach(ok, {"scheme": RS_SCHEME})
    out["twice"] = caught(lambda: zen_ext.fsdp.attach(ok, {}))
    # A parameter without a gradient: FSDP reduces fewer elements than the layout; every rank raises.
    partial = Partial()
    fully_shard(partial)
    zen_ext.fsdp.attach(partial, {"scheme": RS_SCHEME})
    out["unused"] = caught(lambda: partial(torch.ones(3), use_b=False).backward())
    dist.barrier()
    return out


def test_unsupported_setups_raise_clear_errors():
    out = run_workers(_errors, 2)[0]
    assert out["plain"][0] == "ValueError" and "fully_shard" in out["plain"][1]
    assert out["hsdp"][0] == "NotImplementedError" and "2-D mesh" in out["hsdp"][1]
    assert "1-D device mesh" in out["hsdp"][1]
    assert out["groups"][0] == "NotImplementedError" and "2 parameter groups" in out["groups"][1]
    assert out["dim1"][0] == "NotImplementedError" and "Shard(1)" in out["dim1"][1]
    assert out["disabled"][0] == "ValueError" and "zen.enabled" in out["disabled"][1]
    assert out["scheme"][0] == "NotImplementedError" and "'zen'" in out["scheme"][1]
    assert out["ef21"][0] == "ValueError" and "zen.dgc.feedback was removed" in out["ef21"][1]
    assert out["twice"][0] == "NotImplementedError" and "already has a custom reduce-scatter" in out["twice"][1]
    assert out["unused"][0] == "RuntimeError" and "set_reduce_scatter_unused_params(True)" in out["unused"][1]


def _world_of_one(rank, world):
    import zen_ext.fsdp

    model = _shard(SplitLM(torch.float32), world, "avg")
    a = zen_ext.fsdp.attach(model, {"scheme": RS_SCHEME})
    ref = _train(_shard(SplitLM(torch.float32), world, "avg"), rank, world, torch.float32)
    got = _train(model, rank, world, torch.float32)
    return ref, got, a.step


def test_world_of_one_trains_without_calls():
    ref, got, steps = run_workers(_world_of_one, 1)[0]
    assert steps == 0  # FSDP skips the reduce-scatter on one rank
    assert ref[0] == got[0]


# --- gradient accumulation, the non-finite guard ----------------------------------------------------------
def _accumulate_and_guard(rank, world):
    import zen_ext.fsdp

    def accumulate(zen):
        model = _shard(SplitLM(torch.float32), world, "avg")
        a = zen_ext.fsdp.attach(model, zen) if zen is not None else None
        for micro in range(3):  # FSDP reduces only on the last micro-batch
            model.set_requires_gradient_sync(micro == 2)
            model(*_batch(micro, rank, world, torch.float32)).backward()
        return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}, a.step if a else None

    ref, _ = accumulate(None)
    got, steps = accumulate({"scheme": RS_SCHEME})
    guarded = _shard(SplitLM(torch.float32), world, "avg")
    g = zen_ext.fsdp.attach(guarded, {"scheme": RS_SCHEME, "dgc": {"enabled": True, "min_numel": 8,
                                                                  "momentum_correction": False}},
                            guard_nonfinite=True)
    loss = guarded(*_batch(0, rank, world, torch.float32))
    (loss * float("nan") if rank == 1 else loss).backward()
    all_nan = all(bool(p.grad.to_local().isnan().all()) for p in guarded.parameters() if p.grad.to_local().numel())
    return ref, got, steps, all_nan, g.totals["nonfinite_steps"]


def test_accumulation_and_nonfinite_guard():
    for rank, (ref, got, steps, all_nan, nonfinite) in enumerate(run_workers(_accumulate_and_guard, 2)):
        assert steps == 1  # one backward pass reduced
        for name in ref:
            assert torch.equal(got[name], ref[name]), (rank, name)
        assert all_nan and nonfinite >= 1, rank  # a NaN on rank 1 reaches every rank's shard
