"""zen.outer on real gloo processes (3 and 4 ranks): the outer average of the picks equals a dense
all-reduce of them, averaged, exactly (integer values; contributors counted at ZEN's owners), replicas are bitwise equal after each outer step and apart
in between, and under DDP the inner steps reduce nothing (gradients are each replica's own)."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.launch import run_workers


def _lossless(rank, world, scheme, average):
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.outer import OuterSync

    picks = []

    class Recording(OuterSync):
        def _sparse_sum(self, i, b, idx_K, val_K):
            out = super()._sparse_sum(i, b, idx_K, val_K)
            picks.append((idx_K.clone(), val_K.clone(), b.numel, out[0].clone(),
                          None if out[1] is None else out[1].clone()))
            return out

    g = torch.Generator().manual_seed(0)
    params = [torch.randint(-9, 10, s, generator=g).float() for s in [(70,), (3, 50), (1,)]]
    named = [(f"p{i}", torch.nn.Parameter(p)) for i, p in enumerate(params)]
    cfg = dict(enabled=True, every=1, density=3 / 32, chunk=32, error_decay=0.5, average=average)
    outer = Recording(named, TorchCommunicator(), cfg, scheme=scheme, bucket_cap_mb=2e-4)
    ok = []
    for step in range(1, 4):
        gr = torch.Generator().manual_seed(10 * step + rank)
        with torch.no_grad():
            for _, p in named:
                p.sub_(torch.randint(-9, 10, p.shape, generator=gr).float())
        outer.maybe_step(step)
    for idx, val, numel, got, count in picks:
        dense = torch.zeros(numel).index_add_(0, idx, val)
        ones = torch.zeros(numel).index_add_(0, idx, torch.ones_like(val))
        dist.all_reduce(dense)
        dist.all_reduce(ones)
        # the average, exact on integer picks: per index over its senders (at ZEN's owners), or over R
        expect = dense / ones.clamp(min=1) if average == "contributors" else dense / world
        union = (expect.ne(0) if outer.form == "counted" else ones.gt(0)).sum()
        ok.append(torch.equal(got, expect) and (count is None or int(count) == int(union)))
    return ok, len(outer.buckets)


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("scheme, average", [("zen", "contributors"), ("zen", "mean"), ("agsparse", "contributors"),
                                             ("auto", "contributors")])
def test_outer_sum_equals_dense_allreduce_of_picks(world, scheme, average):
    out = run_workers(_lossless, world, scheme, average)
    for ok, buckets in out:
        assert buckets >= 2 and len(ok) == 3 * buckets and all(ok)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 40)
        self.b = torch.nn.Linear(40, 2)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def _ddp_replicas(rank, world):
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp_outer import register_outer

    alone = _Net()
    ddp = DDP(copy.deepcopy(alone), broadcast_buffers=False)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    outer = register_outer(ddp, {"scheme": "zen", "bucket_cap_mb": 1e-3,
                                 "outer": {"enabled": True, "every": 3, "density": 0.1, "chunk": 64,
                                           "lr": 0.7, "momentum": 0.9, "nesterov": True}}, optimizer=opt)
    params, grads_equal = [], []
    for step in range(1, 8):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp(x).backward()
        # the replica's own gradient: what the same module computes alone
        alone.load_state_dict(ddp.module.state_dict())
        alone.zero_grad()
        alone(x).backward()
        grads_equal.append(all(torch.equal(p.grad, q.grad) for p, q in zip(ddp.parameters(), alone.parameters())))
        opt.step()
        opt.zero_grad()
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()]))
    return params, grads_equal, outer.outer_steps, outer.pop_stats()


@pytest.mark.parametrize("world", [3, 4])
def test_ddp_inner_steps_local_outer_steps_equal(world):
    out = run_workers(_ddp_replicas, world)
    for params, grads_equal, outer_steps, stats in out:
        assert all(grads_equal) and outer_steps == 2
        assert stats["picks"] > 0 and 0 < stats["union"] <= world * stats["picks"] and stats["bytes_sent"] > 0
    for step in (3, 6):  # after each outer step: bitwise equal
        assert all(torch.equal(o[0][step - 1], out[0][0][step - 1]) for o in out)
    for step in (1, 4, 7):  # after an inner step on each replica's own data: apart
        assert not torch.equal(out[1][0][step - 1], out[0][0][step - 1])


def _refusals(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp_outer import register_outer

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    msgs = []
    for kwargs in ({}, {"broadcast_buffers": False, "find_unused_parameters": True}):
        try:
            register_outer(DDP(net, **kwargs), {"outer": {"enabled": True}})
        except ValueError as exc:
            msgs.append(str(exc))
    try:
        register_outer(DDP(net, broadcast_buffers=False), {"outer": {"enabled": False}})
    except ValueError as exc:
        msgs.append(str(exc))
    return msgs


def test_ddp_refuses_per_step_collectives():
    (msgs, _) = run_workers(_refusals, 2)
    assert msgs[0].startswith("DistributedDataParallel broadcast_buffers (True) must be False with zen.outer")
    assert msgs[1].startswith("DistributedDataParallel find_unused_parameters (True) must be False with zen.outer")
    assert msgs[2].startswith("zen.outer.enabled (False) must be true")


def _counted_adversarial(rank, world):
    """op="contributors" on gloo: rank 1 sends nothing, index 0 and the last from some ranks, one index
    from every rank, a duplicate within a rank; returns the result and every rank's input."""
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.core.registry import build_scheme
    from zen_ext.core.types import SparseGrad

    numel = 61
    g = torch.Generator().manual_seed(rank)
    if rank == 1:
        idx = torch.empty(0, dtype=torch.int64)
    else:
        idx = torch.cat([torch.tensor([0, numel - 1, 30, 30][rank % 2:], dtype=torch.int64),
                         torch.randint(1, numel - 1, (9,), generator=g)])
    vals = torch.randint(-5, 6, (idx.numel(),), generator=g).float()
    out = build_scheme("zen").sync(TorchCommunicator(), SparseGrad(idx, vals, numel), "contributors")
    return out, idx, vals


@pytest.mark.parametrize("world", [3, 4])
def test_contributors_counted_at_owners_on_gloo(world):
    out = run_workers(_counted_adversarial, world)
    total, count = torch.zeros(61), torch.zeros(61)
    for _, idx, vals in out:
        total.index_add_(0, idx, vals)
        count[idx.unique()] += 1
    expect = total / count.clamp(min=1)
    assert all(torch.equal(res, expect) for res, _, _ in out)


def _lowbit_replicas(rank, world, bits):
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.outer import OuterSync

    g = torch.Generator().manual_seed(0)
    named = [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g))) for i, s in enumerate([(70,), (3, 50), (1,)])]
    cfg = dict(enabled=True, every=1, density=3 / 32, chunk=32, value_bits=bits, momentum=0.9, nesterov=True, lr=0.7)
    outer = OuterSync(named, TorchCommunicator(), cfg, scheme="zen", bucket_cap_mb=2e-4)
    after = []
    for step in range(1, 4):
        gr = torch.Generator().manual_seed(10 * step + rank)
        with torch.no_grad():
            for _, p in named:
                p.add_(torch.randn(p.shape, generator=gr) * 0.1)
        outer.maybe_step(step)
        after.append(torch.cat([p.detach().reshape(-1).clone() for _, p in named]))
    return after, outer.form


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_low_bit_outer_replicas_bitwise_equal_on_gloo(world, bits):
    out = run_workers(_lowbit_replicas, world, bits)
    assert all(form == "counted" for _, form in out)
    for step in range(3):
        assert all(torch.equal(after[step], out[0][0][step]) for after, _ in out[1:])


# --- delay 1: the outer sum overlapped with the next round (Streaming DiLoCo) ------------------------------
DELAYED = {"scheme": "zen", "bucket_cap_mb": 1e-3,
           "outer": {"enabled": True, "every": 3, "density": 0.1, "chunk": 64, "lr": 0.7, "momentum": 0.9,
                     "nesterov": True, "delay": 1}}


def _ddp_delayed_run(rank, start, steps, stop_at=None, resume=None):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp_outer import register_outer

    ddp = DDP(_Net(), broadcast_buffers=False)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    outer = register_outer(ddp, DELAYED, optimizer=opt)
    if resume is not None:
        ddp.module.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        outer.load_state_dict(resume["outer"])
    params, thetas, ckpt = [], {}, None
    for step in range(start + 1, steps + 1):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = ddp(x)
        loss.backward()
        opt.step()  # every 3rd step: the outer step (its sum goes to the thread)
        opt.zero_grad()
        # the training thread keeps using the DDP group while the thread sums on its own group
        dist.all_reduce(loss.detach().clone(), group=ddp.process_group)
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()]))
        if step % 3 == 0:  # θ_global after this round's sum (state_dict waits for it; merges nothing)
            thetas[step] = torch.cat([b["theta"] for b in outer.state_dict()["buckets"]])
        if step == stop_at:
            import copy
            ckpt = {"model": copy.deepcopy(ddp.module.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                    "outer": outer.state_dict()}
    own_group = outer.sum_comm.group is not ddp.process_group and outer._worker._thread.name == "zen-outer"
    outer.finish()
    final = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
    theta = torch.cat([b.theta_N for b in outer.buckets])
    stats = outer.pop_stats()
    outer.close()
    return params, thetas, final, theta, own_group, stats, ckpt


def _ddp_delayed(rank, world):
    full = _ddp_delayed_run(rank, 0, 9, stop_at=4)  # checkpoint at 4: round 1 in flight, 1 step into round 2
    resumed = _ddp_delayed_run(rank, 4, 9, resume=full[-1])
    return full[:-1], resumed[:-1]


@pytest.mark.parametrize("world", [3, 4])
def test_ddp_delay_1_theta_equal_flushed_and_resumed_bitwise(world):
    out = run_workers(_ddp_delayed, world)
    for (params, thetas, final, theta, own_group, stats), (r_params, _, r_final, r_theta, *_) in out:
        assert own_group and sorted(thetas) == [3, 6, 9]
        assert stats["outer_steps"] == 3 and stats["bytes_sent"] > 0 and stats["picks"] > 0
        assert torch.equal(final, theta)  # finish right after the outer step at 9: the replica is θ_global
        assert torch.equal(r_final, final) and torch.equal(r_theta, theta)  # resumed == uninterrupted
        assert all(torch.equal(a, b) for a, b in zip(r_params, params[4:]))
    ref = out[0][0]
    for (params, thetas, final, theta, *_), _ in out[1:]:
        for step in (3, 6, 9):
            assert torch.equal(thetas[step], ref[1][step])  # θ_global bitwise equal after each applied round
            assert not torch.equal(params[step - 1], ref[0][step - 1])  # replicas carry their own round
        assert torch.equal(theta, ref[3])
