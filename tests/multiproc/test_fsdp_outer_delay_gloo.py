"""zen.outer.delay 1 (Streaming DiLoCo's overlap) on FSDP2 HSDP (``zen_ext.engines.fsdp_outer``), real gloo
processes:

* 2 replicas × 2 shards: θ_global bitwise equal across each replicate group after every round, the shards
  apart after the outer steps (each replica carries its own round in flight), ``finish()`` right after an
  outer step leaves every shard at θ_global; the sums run on the ``zen-outer`` thread over a group of their
  own while the training thread all-reduces on the replicate group;
* density 1, ``average: "mean"`` at 2 × 2 equals delayed DiLoCo written directly on the full parameters
  (the merge of ``outer/sync.py``'s docstring), bitwise on integer-valued data with dyadic rates, at every
  step and after a ``finish()`` mid-round;
* 3 replicas × 1 shard, SparseLoCo's picks with 8-bit values and Nesterov momentum: every step's
  parameters, every round's θ_global and the flushed parameters equal the DDP delay-1 path's
  (``engines/ddp_outer.py``) on the same model, data and seeds, bitwise;
* runs resumed from per-rank checkpoints taken at an outer step and mid-round (a round in flight) equal
  the uninterrupted run bitwise;
* ``finish()`` refuses parameters left unsharded (the merge writes the shards).
"""

from __future__ import annotations

import io

import torch

from tests.multiproc.launch import run_workers
from tests.multiproc.test_fsdp_outer_gloo import (DILOCO, _flat, _inner_opt, _inner_step_full, _loss, _mesh, _model,
                                                  _shard, _train)


def _locals(model):
    return torch.cat([p.to_local().detach().reshape(-1).clone() for p in model.parameters()])


def _theta(outer):
    """θ_global after the round in flight (``state_dict`` waits for its sum; it merges nothing)."""
    return torch.cat([b["theta"] for b in outer.state_dict()["buckets"]])


# --- 2 × 2: θ_global equal, shards apart after outer steps, flushed equal ----------------------------------
SPARSE = {"scheme": "zen", "outer": {"enabled": True, "every": 3, "density": 0.25, "chunk": 8, "momentum": 0.5,
                                     "nesterov": True, "delay": 1}}


def _replicas(rank, world):
    import torch.distributed as dist

    from zen_ext.engines.fsdp_outer import register_outer
    from zen_ext.outer.sync import state_bytes_per_param

    mesh = _mesh()
    model = _shard(_model("mlp"), mesh)
    opt = _inner_opt("mlp", model.parameters())
    outer = register_outer(model, SPARSE, opt)
    replicate = mesh.get_group("replicate")
    shards, thetas = [], {}
    for step in range(1, 10):
        _train(model, opt, "mlp", rank, 1, start=step - 1)  # steps 3, 6, 9: the outer step, its sum to the thread
        # the training thread keeps using the replicate group while the thread sums on its own copy
        dist.all_reduce(torch.ones(1), group=replicate)
        shards.append(_locals(model))
        if step % 3 == 0:
            thetas[step] = _theta(outer)
    own = outer.sum_comm.group is not replicate and outer._worker._thread.name == "zen-outer"
    own = own and dist.get_process_group_ranks(outer.sum_comm.group) == dist.get_process_group_ranks(replicate)
    outer.finish()
    final, theta = _locals(model), torch.cat([b.theta_N for b in outer.buckets])
    stats = outer.pop_stats()
    state = (outer.state_bytes(), state_bytes_per_param(outer.cfg) * sum(p.to_local().numel()
                                                                         for p in model.parameters()))
    outer.close()
    return shards, thetas, final, theta, own, stats, state


def test_delay_1_theta_equal_shards_apart_flushed_equal_2x2():
    out = run_workers(_replicas, 4)
    for shards, thetas, final, theta, own, stats, (state, formula) in out:
        assert own and sorted(thetas) == [3, 6, 9]
        assert stats["outer_steps"] == 3 and stats["bytes_sent"] > 0 and stats["picks"] > 0
        assert state == formula and formula == 16 * (final.numel())  # θ_global, e, momentum, anchor: fp32
        assert torch.equal(final, theta)  # finish right after the outer step at 9: the shards are θ_global
    for shard in (0, 1):  # ranks shard and shard + 2 hold the same shard (mesh [[0, 1], [2, 3]])
        a, b = out[shard], out[shard + 2]
        for step in (3, 6, 9):
            assert torch.equal(a[1][step], b[1][step]), (shard, step)  # θ_global bitwise equal
            assert not torch.equal(a[0][step - 1], b[0][step - 1]), (shard, step)  # each its own round
        assert torch.equal(a[2], b[2])  # flushed: equal across the replicas
    assert not torch.equal(out[0][2], out[1][2])  # the two shards are different halves


# --- 2 × 2, density 1: delayed DiLoCo written directly on the full parameters -------------------------------
DELAYED_DILOCO = dict(DILOCO, delay=1)
STEPS, EVERY = 7, 2  # outer steps at 2, 4, 6; finish() after step 7, one step into a round


def _delayed_reference(kind, shape=(2, 2)):
    """Per replica r: x (its parameters, the mean gradient of ranks r·L + s) and the anchor a. At an outer
    step Δ_r = a_r − x_r; with a round in flight x_r ← (x_r − a_r) + θ (θ already moved by it); a_r ← x_r;
    then θ takes the outer SGD step on the mean of the Δ_r (the round now in flight). Returns the replicas'
    parameters after every step and after the final flush."""
    replicas, shard = shape
    theta = [p.detach().clone() for p in _model(kind).parameters()]
    mom = [torch.zeros_like(t) for t in theta]
    models = [_model(kind) for _ in range(replicas)]
    anchors = [[t.clone() for t in theta] for _ in range(replicas)]
    opts = [_inner_opt(kind, m.parameters()) for m in models]
    in_flight, after = False, []
    for step in range(1, STEPS + 1):
        _inner_step_full(kind, models, opts, step, shard)
        if step % EVERY == 0:
            with torch.no_grad():
                deltas = [[a - p for a, p in zip(anchors[r], m.parameters())] for r, m in enumerate(models)]
                for r, m in enumerate(models):
                    for i, p in enumerate(m.parameters()):
                        if in_flight:
                            p.copy_((p - anchors[r][i]) + theta[i])
                        anchors[r][i] = p.detach().clone()
                for i, t in enumerate(theta):
                    avg = sum(d[i] for d in deltas) / replicas
                    mom[i].mul_(DELAYED_DILOCO["momentum"]).add_(avg)
                    t.sub_(avg.add(mom[i], alpha=DELAYED_DILOCO["momentum"]), alpha=DELAYED_DILOCO["lr"])
                in_flight = True
        after.append([[p.detach().clone() for p in m.parameters()] for m in models])
    flushed = [[(p.detach() - a) + t for p, a, t in zip(m.parameters(), anchors[r], theta)]
               for r, m in enumerate(models)]
    return after, flushed


def _delayed_diloco(rank, world):
    from zen_ext.engines.fsdp_outer import register_outer

    model = _shard(_model("linear"), _mesh())
    opt = _inner_opt("linear", model.parameters())
    outer = register_outer(model, {"outer": DELAYED_DILOCO}, opt)
    after = []
    for step in range(1, STEPS + 1):
        _train(model, opt, "linear", rank, 1, start=step - 1)
        after.append([p.full_tensor() for p in model.parameters()])  # gathers over the shard dim: the replica's
    outer.finish()
    flushed = [p.full_tensor() for p in model.parameters()]
    outer.close()
    return after, flushed


def test_delay_1_density_one_is_delayed_diloco_on_full_parameters():
    out = run_workers(_delayed_diloco, 4)
    ref, ref_flushed = _delayed_reference("linear")
    for rank, (after, flushed) in enumerate(out):
        r = rank // 2  # mesh [[0, 1], [2, 3]]: ranks 0, 1 are replica 0
        for step in range(STEPS):  # integer-valued data, dyadic rates: every sum is exact
            assert all(torch.equal(g, w) for g, w in zip(after[step], ref[step][r])), (rank, step + 1)
        assert all(torch.equal(g, w) for g, w in zip(flushed, ref_flushed[r])), rank
    # after an outer step the replicas are apart (each carries its own round in flight)
    assert not all(torch.equal(a, b) for a, b in zip(out[0][0][3], out[2][0][3]))


# --- 3 × 1: the DDP delay-1 path on the same model, data and seeds --------------------------------------------
LOWBIT = {"scheme": "zen", "bucket_cap_mb": 1e-4,
          "outer": {"enabled": True, "every": 3, "density": 0.25, "chunk": 8, "error_decay": 0.95, "lr": 0.7,
                    "momentum": 0.9, "nesterov": True, "value_bits": 8, "delay": 1}}


def _run_delayed(model, opt, outer, rank, params):
    after, thetas = [], []
    for step in range(1, 9):  # outer steps at 3, 6; finish after 8
        _loss("mlp", model, step, rank).backward()
        opt.step()
        opt.zero_grad()
        after.append(torch.cat([t.detach().reshape(-1).clone() for t in params()]))
        if step % 3 == 0:
            thetas.append(_theta(outer))
    outer.finish()
    flushed = torch.cat([t.detach().reshape(-1).clone() for t in params()])
    buckets = len(outer.buckets)
    outer.close()
    return after, thetas, flushed, buckets


def _hsdp_vs_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines import ddp_outer, fsdp_outer

    ddp = DDP(_model("mlp"), broadcast_buffers=False)
    opt = _inner_opt("mlp", ddp.parameters())
    ref = _run_delayed(ddp, opt, ddp_outer.register_outer(ddp, LOWBIT, opt), rank, ddp.module.parameters)
    model = _shard(_model("mlp"), _mesh((world, 1)))
    opt = _inner_opt("mlp", model.parameters())
    outer = fsdp_outer.register_outer(model, LOWBIT, opt)
    got = _run_delayed(model, opt, outer, rank, lambda: [p.to_local() for p in model.parameters()])
    return ref, got


def test_delay_1_3x1_equals_the_ddp_delay_1_path_bitwise():
    out = run_workers(_hsdp_vs_ddp, 3)
    for (r_after, r_thetas, r_flushed, r_buckets), (after, thetas, flushed, buckets) in out:
        assert buckets == r_buckets == 4 and len(after) == 8 and len(thetas) == 2
        assert all(torch.equal(a, b) for a, b in zip(after, r_after))
        assert all(torch.equal(a, b) for a, b in zip(thetas, r_thetas))
        assert torch.equal(flushed, r_flushed)
    got = [o[1] for o in out]
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(got[rank][1], got[0][1]))  # θ_global equal
        assert not torch.equal(got[rank][0][2], got[0][0][2])  # replicas apart after the outer step at 3


# --- checkpoints: at an outer step and mid-round, resumed bitwise ------------------------------------------------
RESUME = {"outer": {"enabled": True, "every": 2, "density": 0.3, "chunk": 8, "momentum": 0.5, "delay": 1}}


def _resume(rank, world):
    from zen_ext.engines.fsdp_outer import load_local_state_dict, local_state_dict, register_outer

    def fresh():
        model = _shard(_model("mlp"), _mesh())
        opt = _inner_opt("mlp", model.parameters())
        return model, opt, register_outer(model, RESUME, opt)

    def finished(model, opt, outer):
        whole = (local_state_dict(model, opt), outer.state_dict())
        outer.finish()
        return whole, _locals(model)

    model, opt, outer = fresh()
    saved = {}
    for step in range(1, 9):  # outer steps at 2, 4, 6, 8
        _train(model, opt, "mlp", rank, 1, start=step - 1)
        if step in (4, 5):  # 4: at an outer step, its round just started; 5: one step into the next round
            buf = io.BytesIO()
            torch.save({"local": local_state_dict(model, opt), "outer": outer.state_dict()}, buf)
            saved[step] = buf.getvalue()
    whole = finished(model, opt, outer)
    outer.close()
    resumed, flags = {}, {}
    for step, blob in saved.items():
        model, opt, outer = fresh()
        sd = torch.load(io.BytesIO(blob), weights_only=True)
        flags[step] = [b["in_flight"] for b in sd["outer"]["buckets"]]
        load_local_state_dict(model, sd["local"], opt)
        outer.load_state_dict(sd["outer"])
        _train(model, opt, "mlp", rank, 8 - step, start=step)
        resumed[step] = finished(model, opt, outer)
        outer.close()
    return whole, resumed, flags


def test_delay_1_resume_at_an_outer_step_and_mid_round_equals_uninterrupted_bitwise():
    for whole, resumed, flags in run_workers(_resume, 4):
        assert flags == {4: [True], 5: [True]}  # the round started at step 4 in flight in both checkpoints
        (sd, outer_sd), final = whole
        assert outer_sd["outer_steps"] == 4 and outer_sd["buckets"][0]["anchor"] is not None
        a = _flat(whole)
        assert sum(isinstance(t, torch.Tensor) for t in a) == 21  # 4 shards, 12 AdamW, 4 outer, the flushed
        for step in (4, 5):
            b = _flat(resumed[step])
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, step


# --- refusal: finish() on unsharded parameters ----------------------------------------------------------------
def _unsharded(rank, world):
    from zen_ext.engines.fsdp_outer import register_outer

    model = _shard(_model("mlp"), _mesh())
    opt = _inner_opt("mlp", model.parameters())
    outer = register_outer(model, RESUME, opt)
    _train(model, opt, "mlp", rank, 2)  # the outer step at 2: its round in flight
    model[0].unshard()  # the first Linear's FSDP module (the root holds no parameters of its own)
    try:
        outer.finish()
        msg = None
    except RuntimeError as exc:
        msg = str(exc)
    model[0].reshard()
    outer.finish()
    theta = torch.cat([b.theta_N for b in outer.buckets])
    ok = torch.equal(_locals(model), theta)
    outer.close()
    return msg, ok


def test_delay_1_finish_refuses_unsharded_parameters():
    for msg, ok in run_workers(_unsharded, 4):
        assert msg is not None and "holds unsharded parameters at finish()" in msg and ok
