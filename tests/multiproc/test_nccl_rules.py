"""NCCL rules on gloo: the guard itself, agreed transports, and the call signature of ``scheme.sync``.

* The guard (``zen_ext/comm/nccl_guard.py``, on in every multi-process test through ``ZEN_NCCL_GUARD=1``)
  catches a lone ``isend``/``irecv`` and a tensor on a device the backend refuses, and lets a
  ``batch_isend_irecv`` through.
* Ranks built with different ``exchange_impl`` get a RuntimeError from the agreement checks (the
  scheme's and the Synchronizer's) instead of blocking until the process-group timeout.
* Ranks passing gradients of different numel (104 vs 107), dtype or op to ``scheme.sync`` get a
  RuntimeError naming both ranks' values from every scheme, 20 times in a row, never a wrong sum.
"""

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext import SparseGrad, build_scheme
from zen_ext.core.registry import available_schemes


def _guard_worker(rank, world_size):
    import torch.distributed as dist

    from zen_ext.comm import nccl_guard

    assert nccl_guard.installed(), "run_workers must install the guard under ZEN_NCCL_GUARD=1"
    caught = {}
    t = torch.arange(4, dtype=torch.float32)
    # A lone isend / irecv: refused before anything is sent (the peer is never left waiting).
    for name, fn in (("isend", lambda: dist.isend(t, dst=1 - rank)), ("irecv", lambda: dist.irecv(t, src=1 - rank)),
                     ("send", lambda: dist.send(t, dst=1 - rank))):
        try:
            fn()
        except nccl_guard.NCCLGuardError as exc:
            caught[name] = str(exc)
    # A tensor on a device gloo's CPU rule refuses (meta is the only non-CPU device CI has).
    try:
        dist.all_reduce(torch.empty(3, device="meta"))
    except nccl_guard.NCCLGuardError as exc:
        caught["device"] = str(exc)
    # The sanctioned form goes through and delivers.
    got = torch.empty(4)
    ops = [dist.P2POp(dist.irecv, got, 1 - rank), dist.P2POp(dist.isend, t + 10 * rank, 1 - rank)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return caught, got


def test_guard_catches_lone_p2p_and_wrong_device_and_passes_batches():
    for rank, (caught, got) in enumerate(run_workers(_guard_worker, 2, timeout_s=120)):
        for name in ("isend", "irecv", "send"):
            assert f"lone torch.distributed.{name} outside batch_isend_irecv" in caught.get(name, ""), caught
        assert "all_reduce got a tensor on meta" in caught.get("device", ""), caught
        assert torch.equal(got, torch.arange(4.0) + 10 * (1 - rank))


def _transport_worker(rank, world_size):
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    comm = TorchCommunicator(exchange_impl="p2p" if rank == 0 else "a2a")
    errors = []
    try:
        build_scheme("zen").check_agreement(comm)
    except RuntimeError as exc:
        errors.append(str(exc))
    sync = Synchronizer(dp_comm=comm, scheme="agsparse", param_kinds={"w": "dense"})
    try:
        sync.sync_flat(torch.ones(8), [GradSlice("w", 0, 8, (8,))], op="sum")
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_ranks_with_different_exchange_impl_fail_clearly_instead_of_hanging():
    for errors in run_workers(_transport_worker, 2, timeout_s=120):
        assert len(errors) == 2, errors
        assert "'transport', 'a2a'" in errors[0] and "'transport', 'p2p'" in errors[0], errors[0]
        assert "disagree on the bucket's comm" in errors[1] and "'a2a'" in errors[1] and "'p2p'" in errors[1]


def _grad(rank: int, numel: int, dtype=torch.float32) -> SparseGrad:
    idx = torch.tensor([0, 3, numel - 1, 3])
    return SparseGrad(idx, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype) * (rank + 1), numel)


def _signature_worker(rank, world_size, repeats):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    out = {}
    for name in available_schemes():
        scheme = build_scheme(name)
        msgs = []
        numel = 104 if rank == 0 else 107
        # The caller's buffer (an engine bucket: the gradient itself) is untouched by a refused call.
        bucket = torch.full((numel,), 7.0)
        for _ in range(repeats):
            try:
                res = scheme.sync(comm, _grad(rank, numel), out=bucket)
                msgs.append(f"no error, result of numel {res.numel()}")
            except RuntimeError as exc:
                msgs.append(str(exc))
        if not torch.equal(bucket, torch.full((numel,), 7.0)):
            msgs.append("a refused call wrote into the caller's buffer")
        for what, grad, op in (("dtype", _grad(rank, 50, torch.float32 if rank else torch.bfloat16), "sum"),
                               ("op", _grad(rank, 50), "sum" if rank else "mean")):
            try:
                scheme.sync(comm, grad, op=op)
                msgs.append(f"{what}: no error")
            except RuntimeError as exc:
                msgs.append(str(exc))
        # The group still works after the refused calls: a matching call sums correctly.
        ok = scheme.sync(comm, _grad(rank, 104))
        out[name] = (msgs, ok)
    return out


@pytest.mark.parametrize("repeats", [20])
def test_numel_dtype_or_op_mismatch_raises_from_every_scheme(repeats):
    got = run_workers(_signature_worker, 2, repeats, timeout_s=240)
    want = _grad(0, 104).to_dense() + _grad(1, 104).to_dense()
    for rank in range(2):
        assert set(got[rank]) == set(available_schemes())
        for name, (msgs, ok) in got[rank].items():
            assert len(msgs) == repeats + 2
            for m in msgs[:repeats]:
                assert "ranks disagree on the gradient passed to scheme" in m, (name, m)
                assert "numel 104" in m and "numel 107" in m, (name, m)
            assert "torch.bfloat16" in msgs[-2] and "torch.float32" in msgs[-2], (name, msgs[-2])
            assert "op 'mean'" in msgs[-1] and "op 'sum'" in msgs[-1], (name, msgs[-1])
            assert torch.equal(ok, want), name
