"""zen.outer on FSDP2 HSDP (``zen_ext.engines.fsdp_outer``) on real gloo processes, 4 ranks as 2 replicas ×
2 shards:

* inner steps reduce inside the replica group only: the replicas' gradients and shards differ between
  outer steps; after each outer step every rank's shard is bitwise equal across its replicate group;
* density 1 with ``average: "mean"`` is DiLoCo: the shards equal a direct computation of DiLoCo on the full
  parameters (two replicas, each the mean gradient of its two shard ranks' batches), exactly on
  integer-valued data with dyadic learning rates, and to 1e-6 for a tanh MLP under AdamW;
* θ_global, error feedback and momentum are shard-sized: ``state_bytes() == formula × local elements``;
* a run resumed from per-rank checkpoints (``local_state_dict`` + ``outer.state_dict()``) equals the
  uninterrupted one bitwise;
* clear errors for a 1-D mesh, registering twice, ZEN's per-step attach after it, another mesh's state.

``delay: 1`` on FSDP2 HSDP: tests/multiproc/test_fsdp_outer_delay_gloo.py.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.multiproc.launch import run_workers

SHAPE = (2, 2)


def _mesh(shape=SHAPE):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else ("shard",))


def _model(kind: str):
    """``linear``: two Linears, integer weights / 4 (gradients stay dyadic); ``mlp``: a tanh MLP."""
    g = torch.Generator().manual_seed(0)
    if kind == "linear":
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randint(-4, 5, p.shape, generator=g).float() / 4)
    else:
        m = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return m


def _loss(kind, model, step, rank):
    """Batch of ``rank`` at ``step``: integer-valued inputs; ``linear``'s loss is linear in the outputs."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(-3, 4, (4, 5), generator=g).float()
    if kind == "linear":
        return (model(x) * torch.tensor([1.0, -2.0, 3.0])).sum()
    return model(x).square().mean()


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for child in model:
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _inner_opt(kind, params):
    return torch.optim.SGD(params, lr=1 / 64) if kind == "linear" else torch.optim.AdamW(params, lr=0.01)


def _train(model, opt, kind, rank, steps, start=0, record=None):
    for step in range(start + 1, start + steps + 1):
        _loss(kind, model, step, rank).backward()
        if record is not None:
            record.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        if record is not None:
            record.append({n: p.to_local().clone() for n, p in model.named_parameters()})


# --- replicas: apart between outer steps, equal after them; shard-sized state -----------------------------
def _replicas(rank, world):
    from zen_ext.engines.fsdp_outer import register_outer
    from zen_ext.outer.sync import state_bytes_per_param

    model = _shard(_model("mlp"), _mesh())
    opt = _inner_opt("mlp", model.parameters())
    cfg = {"outer": {"enabled": True, "every": 3, "density": 0.25, "chunk": 8, "momentum": 0.5, "nesterov": True}}
    outer = register_outer(model, cfg, opt)
    record = []
    _train(model, opt, "mlp", rank, 6, record=record)
    local = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    return record, outer.state_bytes(), state_bytes_per_param(outer.cfg) * local, local, full, outer.outer_steps


def test_replicas_apart_between_outer_steps_equal_after():
    out = run_workers(_replicas, 4)
    for shard in (0, 1):  # ranks shard and shard + 2 hold the same shard (mesh [[0, 1], [2, 3]])
        a, b = out[shard][0], out[shard + 2][0]
        for i, (x, y) in enumerate(zip(a, b)):
            step, after = i // 2 + 1, i % 2 == 1
            same = all(torch.equal(x[n], y[n]) for n in x)
            if after and step % 3 == 0:
                assert same, f"shard {shard}: replicas differ after outer step {step}"
            elif after:  # shards between outer steps are each replica's own (AdamW's first step moves by about
                assert not same, f"shard {shard}: replicas equal after inner step {step}"  # ±lr: some agree)
            else:  # every step's gradients are the replica's own: nothing all-reduced across the replicas
                assert not any(torch.equal(x[n], y[n]) for n in x), f"shard {shard}: step {step} gradients"
    for state, formula, local, full, steps in (o[1:] for o in out):
        assert state == formula == 12 * local and steps == 2  # θ_global + error feedback + momentum, fp32
    assert out[0][3] + out[1][3] == out[0][4]  # two shards make the parameters: P / 2 a rank (about)


# --- DiLoCo: a direct computation on the full parameters ------------------------------------------------
DILOCO = {"enabled": True, "every": 2, "density": 1, "average": "mean", "lr": 0.5, "momentum": 0.5, "nesterov": True}


def _inner_step_full(kind, models, opts, step, shard):
    """One inner step of every replica on full parameters: replica r's gradient is the mean of ranks
    ``r·L + s``' gradients (what HSDP's reduce-scatter inside the replica group gives)."""
    for r, (m, opt) in enumerate(zip(models, opts)):
        grads = []
        for s in range(shard):
            m.zero_grad()
            _loss(kind, m, step, r * shard + s).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for i, p in enumerate(m.parameters()):
            p.grad = sum(g[i] for g in grads) / shard
        opt.step()


def _reference(kind, steps, every, shape=SHAPE):
    """DiLoCo on full parameters: replica r's gradient is the mean of ranks ``r·L + s``' gradients."""
    replicas, shard = shape
    theta = [p.detach().clone() for p in _model(kind).parameters()]
    mom = [torch.zeros_like(t) for t in theta]
    models = [_model(kind) for _ in range(replicas)]
    opts = [_inner_opt(kind, m.parameters()) for m in models]
    for step in range(1, steps + 1):
        _inner_step_full(kind, models, opts, step, shard)
        if step % every == 0:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    avg = sum(t - list(m.parameters())[i] for m in models) / replicas
                    mom[i].mul_(DILOCO["momentum"]).add_(avg)
                    t.sub_(avg.add(mom[i], alpha=DILOCO["momentum"]), alpha=DILOCO["lr"])
                for m in models:
                    for p, t in zip(m.parameters(), theta):
                        p.copy_(t)
    return theta


def _diloco(rank, world, kind):
    from zen_ext.engines.fsdp_outer import register_outer

    model = _shard(_model(kind), _mesh())
    opt = _inner_opt(kind, model.parameters())
    register_outer(model, {"outer": DILOCO}, opt)
    _train(model, opt, kind, rank, 4)
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_density_one_mean_is_diloco_on_full_parameters(kind):
    out = run_workers(_diloco, 4, kind)
    ref = _reference(kind, 4, DILOCO["every"])
    for got in out:
        for g, r in zip(got, ref):
            if kind == "linear":  # integer-valued data, dyadic rates: every sum is exact
                assert torch.equal(g, r)
            else:  # reduction orders differ (gloo's reduce-scatter vs a local sum)
                torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


# --- checkpoints ---------------------------------------------------------------------------------------
RESUME = {"outer": {"enabled": True, "every": 2, "density": 0.3, "chunk": 8, "momentum": 0.5}}


def _resume(rank, world):
    from zen_ext.engines.fsdp_outer import load_local_state_dict, local_state_dict, register_outer

    def fresh():
        model = _shard(_model("mlp"), _mesh())
        opt = _inner_opt("mlp", model.parameters())
        return model, opt, register_outer(model, RESUME, opt)

    model, opt, outer = fresh()
    _train(model, opt, "mlp", rank, 5)  # saved after step 5: between outer steps, replicas apart
    buf = io.BytesIO()
    torch.save({"local": local_state_dict(model, opt), "outer": outer.state_dict()}, buf)
    _train(model, opt, "mlp", rank, 3, start=5)
    whole = (local_state_dict(model, opt), outer.state_dict())
    outer.close()

    model, opt, outer = fresh()
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    load_local_state_dict(model, sd["local"], opt)
    outer.load_state_dict(sd["outer"])
    _train(model, opt, "mlp", rank, 3, start=5)
    return whole, (local_state_dict(model, opt), outer.state_dict())


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _flat(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return [x]


def test_resume_equals_uninterrupted_bitwise():
    for whole, resumed in run_workers(_resume, 4):
        a, b = _flat(whole), _flat(resumed)
        assert len(a) == len(b) and sum(isinstance(t, torch.Tensor) for t in a) == 19  # 4 shards, 12 AdamW, 3 outer
        for x, y in zip(a, b):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert whole[1]["outer_steps"] == 4 and whole[1]["buckets"][0]["error"] is not None


# --- refusals ------------------------------------------------------------------------------------------
def _refusals(rank, world):
    import zen_ext.fsdp
    from zen_ext.engines.fsdp_outer import register_outer

    cfg = {"outer": {"enabled": True, "every": 2}}
    msgs = []
    flat = _shard(_model("mlp"), _mesh((world,)))
    try:
        register_outer(flat, cfg)
    except NotImplementedError as exc:
        msgs.append(str(exc))
    model = _shard(_model("mlp"), _mesh())
    try:
        register_outer(model, {"outer": {"enabled": False}})
    except ValueError as exc:
        msgs.append(str(exc))
    outer = register_outer(model, cfg)
    for again in (lambda: register_outer(model, cfg), lambda: zen_ext.fsdp.attach(model, {"scheme": "zen"})):
        try:
            again()
        except NotImplementedError as exc:
            msgs.append(str(exc))
    sd = outer.state_dict()
    sd["shard_rank"] = 1 - sd["shard_rank"]
    try:
        outer.load_state_dict(sd)
    except ValueError as exc:
        msgs.append(str(exc))
    outer.close()
    return msgs


def test_refusals_name_what_is_served():
    for msgs in run_workers(_refusals, 4):
        assert len(msgs) == 5, msgs
        assert msgs[0].startswith("zen.outer on FSDP2 serves HSDP") and "no FSDP module on a 2-D mesh" in msgs[0]
        assert msgs[1].startswith("zen.outer.enabled (False) must be true")
        assert "already replaced" in msgs[2] and "already replaced" in msgs[3]
        assert "(replicate, shard) mesh by shard rank" in msgs[4]
