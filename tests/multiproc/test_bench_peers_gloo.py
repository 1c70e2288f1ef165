"""The peers benchmark's own implementations on real gloo processes (``benchmarks/quality/``): the ZeRO++ qgZ
emulation against a direct float reference of the same quantization, SparseLoCo's outer step against a
direct computation of its published algorithm, and the zen_outer method's wiring of zen_ext's own
``register_outer`` (density 1 with outer lr 1 is the replicas' mean after H local steps)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

import qgz_emulation as qgz  # noqa: E402
import sparseloco as sl  # noqa: E402
from peers_ddp import ring_allreduce_bytes  # noqa: E402


def _qgz_inputs(world: int):
    g = torch.Generator().manual_seed(7)
    out = []
    for r in range(world):
        a = torch.randn(8, 12, generator=g) * (r + 1)
        a[0, :] = 0.0  # an all-zero group (scale 1)
        a[1, 0] = 50.0  # one large value: the rest of its group rounds coarsely
        b = torch.randn(16, generator=g)  # 1-D: DeepSpeed's fallback
        c = torch.randn(3, 5, generator=g)  # 15 elements, not a multiple of 2·world: fallback
        out.append([a, b, c])
    return out


def _qgz_worker(rank, world, inputs, local):
    os.environ["LOCAL_SIZE"] = str(local)  # the CPU accelerator's device_count: ranks per emulated node
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    groups._ALL_TO_ALL_GROUP.clear()
    a2a = groups._get_local_all_to_all_group()
    mine = [t.clone() for t in inputs[rank]]
    out = qgz.all_to_all_quant_reduce(mine, a2a)
    return [o.clone() for o in out], dict(qgz.stats)


def test_qgz_emulation_matches_reference():
    local, nodes = 2, 2
    world = local * nodes
    inputs = _qgz_inputs(world)
    results = run_workers(_qgz_worker, world, inputs, local)
    ref = qgz.reference([x[0] for x in inputs], local)
    part = inputs[0][0].numel() // world
    for r, (out, st) in enumerate(results):
        # The quantized path equals the float reference bit for bit (same fp16 steps, same groups).
        assert out[0].dtype == torch.float32 and out[0].numel() == part
        assert torch.equal(out[0], ref[r].float()), f"rank {r}"
        # It is lossy and `local` times the mean (DeepSpeed's intra-node sum is not divided); a group's
        # absmax maps to code 8, clamped to 7: the largest value shrinks by 7/8 at each of the two quantizations.
        true_mean = sum(x[0] for x in inputs).reshape(-1)[r * part:(r + 1) * part] / world
        assert not torch.equal(out[0], true_mean * local)
        if r == 0:
            assert out[0][12].item() == 50.0 * local * (7 / 8) ** 2
        # The fallbacks are DeepSpeed's reduce-scatter: the exact mean (chunk r of ceil(numel / world)).
        for i, t in ((1, 16), (2, 15)):
            chunk = -(-t // world)
            flat = (sum(x[i] for x in inputs) / world).reshape(-1)
            want = flat[r * chunk:(r + 1) * chunk]
            assert torch.allclose(out[i][:want.numel()], want, atol=1e-6)
        assert st["quantized_tensors"] == 1 and st["fallback_tensors"] == 2
        # Bytes: the two all-to-alls' codes (numel/2 bytes) and fp32 scales, (peers - 1) / peers of each.
        groups = max(8, 12, world)
        want_bytes = (local - 1) * (96 // 2 + 4 * groups) // local + \
            (nodes - 1) * (96 // local // 2 + 4 * groups // local) // nodes
        assert st["bytes_sent"] == want_bytes


def test_qgz_int4_rules():
    x = torch.tensor([0.0, 1.0, -2.0, 8.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float16)
    q, sc = qgz.quantize_int4(x, 2)
    # absmax 8 → scale 1; 8 rounds to 8 and is clamped to 7; an all-zero group keeps scale 1.
    assert q.tolist() == [0, 1, -2, 7, 0, 0, 0, 0] and sc.tolist() == [1.0, 1.0]
    assert torch.equal(qgz.unpack_int4(qgz.pack_int4(q)), q)
    with pytest.raises(NotImplementedError, match="multiple of the world size"):
        qgz.check_shape(96, 6, 4)
    with pytest.raises(NotImplementedError, match="at most 40960"):
        qgz.check_shape(2 * 40961 * 4, 8, 4)


def test_sparseloco_packing_and_chunks():
    for bits, hi in ((2, 4), (12, 4096)):
        v = torch.randint(0, hi, (37,))
        v[0], v[-1] = 0, hi - 1
        assert torch.equal(sl.unpack_bits(sl.pack_bits(v, bits), bits, 37), v)
    assert sl.pack_bits(torch.zeros(37, dtype=torch.long), 12).numel() == 57  # 19 pairs × 3 bytes
    x = torch.arange(128 * 192, dtype=torch.float32).view(128, 192)
    c = sl.to_chunks(x, 64)
    assert c.shape == (6, 4096) and torch.equal(c[1], x[:64, 64:128].reshape(-1))
    assert torch.equal(sl.from_chunks(c, x.shape, 64), x)
    assert sl.smaller_split(1000, 64) == 50 and sl.smaller_split(97, 64) == 1 and sl.smaller_split(128, 64) == 64


def _sparseloco_worker(rank, world, inits, locals_, steps):
    model = torch.nn.Linear(64, 128, bias=True)
    with torch.no_grad():
        model.weight.copy_(inits[0])
        model.bias.copy_(inits[1])
    outer = sl.SparseLoCo(model, sync_every=steps, topk=16)
    synced = []
    for s in range(steps):
        with torch.no_grad():
            model.weight.copy_(locals_[rank][s][0])
            model.bias.copy_(locals_[rank][s][1])
        synced.append(outer.after_inner_step())
    return model.weight.detach().clone(), model.bias.detach().clone(), outer.bytes_sent, synced, \
        [e.clone() for e in outer.errors]


def _direct(inits, finals, topk, beta=0.95):
    """SparseLoCo's outer step written out directly: e = Δ (first round), top-k per 64×64 tile (1-D: per
    64-chunk), 2-bit over ±6σ through bin means, mean over the replicas that picked each index."""
    outs, errs = [], []
    for i, init in enumerate(inits):
        shape = init.shape
        chunks = [sl.to_chunks(init - f[i], 64) for f in finals]
        k = min(topk, chunks[0].shape[1])
        total = torch.zeros_like(chunks[0])
        count = torch.zeros_like(chunks[0])
        e_out = []
        for c in chunks:
            e = beta * 0 + c
            idx = e.abs().topk(k, dim=1).indices
            val = e.gather(1, idx)
            mu = val.mean()
            cen = val - mu
            sigma = cen.norm() / (cen.numel() - 1) ** 0.5
            scale = 6 * sigma / 4
            code = (cen / scale + 2).round().clamp(0, 3).long()
            means = torch.stack([cen[code == b].mean() if (code == b).any() else torch.tensor(0.0) for b in range(4)])
            deq = means[code] + mu
            sent = torch.zeros_like(e).scatter_(1, idx, deq)
            e_out.append(sl.from_chunks(e - sent, shape, 64))
            total.scatter_add_(1, idx, deq)
            count.scatter_add_(1, idx, torch.ones_like(deq))
        agg = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
        outs.append(init - sl.from_chunks(agg, shape, 64))
        errs.append(e_out)
    return outs, errs


def test_sparseloco_outer_step_matches_direct_computation():
    world, steps = 3, 2
    g = torch.Generator().manual_seed(3)
    inits = [torch.randn(128, 64, generator=g), torch.randn(128, generator=g)]
    locals_ = [[[inits[0] + 0.1 * torch.randn(128, 64, generator=g), inits[1] + 0.1 * torch.randn(128, generator=g)]
                for _ in range(steps)] for _ in range(world)]
    results = run_workers(_sparseloco_worker, world, inits, locals_, steps)
    finals = [locals_[r][-1] for r in range(world)]
    want, want_err = _direct(inits, finals, topk=16)
    for r, (w, b, sent, synced, errs) in enumerate(results):
        assert synced == [False, True]
        assert torch.allclose(w, want[0], atol=1e-6) and torch.allclose(b, want[1], atol=1e-6)
        assert torch.allclose(errs[0], want_err[0][r], atol=1e-6) and torch.allclose(errs[1], want_err[1][r], atol=1e-6)
        # Packed message: weight 2 tiles × 16 picks, bias 2 chunks of 64 × 16; 12-bit indices, 2-bit values,
        # 5 fp32 per tensor; an all-gather forwards the other replicas' messages.
        msg = (32 // 2 * 3 + 32 // 2 * 3) + (32 // 4 + 32 // 4) + 2 * 5 * 4
        assert sent == (world - 1) * msg
    # Every replica restarts from the same parameters.
    assert all(torch.equal(results[0][0], x[0]) for x in results)


def _zen_outer_worker(rank, world, variant, sync_every, steps, inputs):
    """peers_ddp's zen_outer wiring (DDP without buffer broadcasts, start_zen_outer with the inner AdamW) beside
    the same model trained alone on the same batches: the parameters after every step, and the bytes."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from peers_ddp import start_zen_outer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    alone = copy.deepcopy(net)
    ddp = DDP(net, broadcast_buffers=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    opt_alone = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    outer, _ = start_zen_outer(ddp, opt, variant, sync_every)
    flat = (lambda m: torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    params, alone_params, sent = [], [], []
    for step in range(steps):
        x, y = inputs[rank][step]
        for model, o in ((ddp, opt), (alone, opt_alone)):
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad()
        params.append(flat(net))
        alone_params.append(flat(alone))
        sent.append(outer.pop_stats()["bytes_sent"])
    outer.close()
    return params, alone_params, sent


def _zen_outer_inputs(world, steps):
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(steps)]
            for _ in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_zen_outer_density_1_lr_1_is_the_replicas_mean_after_h_steps(world):
    # "average": density 1, outer SGD lr 1 without momentum, mean: θ_global − (θ_global − mean θ_local) = the
    # mean of the replicas' parameters, each trained alone for H steps.
    h = 3
    out = run_workers(_zen_outer_worker, world, "average", h, h + 1, _zen_outer_inputs(world, h + 1))
    numel = out[0][0][0].numel()
    mean = sum(o[1][h - 1] for o in out) / world
    for params, alone, sent in out:
        for step in range(h - 1):  # inner steps: the replica's own training, bit for bit
            assert torch.equal(params[step], alone[step])
        assert torch.allclose(params[h - 1], mean, atol=1e-6, rtol=0)
        assert not torch.equal(params[h - 1], alone[h - 1])
        # one fp32 ring all-reduce at the outer step, nothing at inner steps (what peers_ddp counts)
        assert sent == [0] * (h - 1) + [ring_allreduce_bytes(numel, 4, world), 0]
    assert all(torch.equal(o[0][h - 1], out[0][0][h - 1]) for o in out)
    assert not torch.equal(out[0][0][h], out[1][0][h])  # after the sync, apart again


def test_zen_outer_sparse_4bit_replicas_equal_after_sync():
    world, steps = 3, 5
    out = run_workers(_zen_outer_worker, world, "outer_d25_h5_4bit", None, steps, _zen_outer_inputs(world, steps))
    numel = out[0][0][0].numel()
    for params, alone, sent in out:
        assert torch.equal(params[0], alone[0])
        assert sent[:4] == [0] * 4 and 0 < sent[4] < ring_allreduce_bytes(numel, 4, world)
    assert all(torch.equal(o[0][4], out[0][0][4]) for o in out)  # bitwise θ_global on every replica
    assert not torch.equal(out[0][0][3], out[1][0][3])
