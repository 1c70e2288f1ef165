"""NCCL rules, enforced on any backend: a wrapper of torch.distributed that fails fast on what NCCL breaks.

CI has no GPU, so the multi-process tests run on gloo, which forgives two things NCCL does not:

1. **A lone point-to-point op.** ``isend``/``irecv``/``send``/``recv`` outside ``batch_isend_irecv``:
   NCCL queues the ops to one peer on one stream, so two ranks that each post a receive before their
   send wait for each other forever (and each lone pair lazily creates its own NCCL communicator).
2. **A tensor on the wrong device.** NCCL takes only tensors on the current CUDA device; gloo takes
   CPU tensors. A count or a flag built on the CPU passes on gloo and fails on the first NCCL call.

``install()`` replaces the point-to-point functions and the collectives in ``torch.distributed`` (and
``distributed_c10d``, which ``batch_isend_irecv`` and ``P2POp`` read) by checking wrappers:

* a point-to-point op runs only inside ``batch_isend_irecv``;
* every tensor handed to a collective or point-to-point op lives on the device the group's backend
  takes (``zen_ext.comm.base.backend_device``; ``TorchCommunicator.device`` is the same rule).

A violation raises ``NCCLGuardError`` naming the function and the tensor's device, before anything is
sent, and is remembered in ``violations``. It is enabled by ``ZEN_NCCL_GUARD=1``: ``tests/conftest.py``
sets it, ``zen_ext.comm.local.run_workers`` workers and ``import zen_ext.comm.torch_dist`` install it,
so spawned workers and engine adapters run under it. It is a test tool: it adds a Python check per
call, which is negligible next to a collective.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

ENV = "ZEN_NCCL_GUARD"

_P2P = ("isend", "irecv", "send", "recv")
# Collectives whose tensor arguments are checked (those present in this torch).
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_to_all_single", "all_gather_into_tensor", "all_gather_single",
    "all_gather", "reduce_scatter_tensor", "reduce_scatter", "all_to_all", "reduce", "gather", "scatter",
    "all_reduce_coalesced",
)

_state = threading.local()
_installed: dict[str, object] = {}
violations: list[str] = []


class NCCLGuardError(RuntimeError):
    """A torch.distributed call that NCCL would refuse or deadlock on."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "0") == "1"


def install() -> None:
    """Wrap torch.distributed's point-to-point ops and collectives (idempotent)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _installed:
        return
    for name in _P2P + _COLLECTIVES + ("batch_isend_irecv",):
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        if name == "batch_isend_irecv":
            wrapper = _wrap_batch(orig)
        elif name in _P2P:
            wrapper = _wrap_p2p(name, orig)
        else:
            wrapper = _wrap_collective(name, orig)
        _installed[name] = orig
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is orig:
            setattr(dist, name, wrapper)


def uninstall() -> None:
    """Restore the original functions (tests of the guard itself)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name, orig in _installed.items():
        if getattr(dist, name, None) is getattr(c10d, name):
            setattr(dist, name, orig)
        setattr(c10d, name, orig)
    _installed.clear()


def installed() -> bool:
    return bool(_installed)


def maybe_install() -> None:
    """``install()`` when ``ZEN_NCCL_GUARD=1``."""
    if enabled_by_env():
        install()


def _fail(msg: str) -> None:
    violations.append(msg)
    raise NCCLGuardError(f"zen nccl_guard: {msg}")


def _group_of(args, kwargs, pos: int):
    if "group" in kwargs:
        return kwargs["group"]
    return args[pos] if len(args) > pos else None


def _expected_device(group) -> torch.device:
    import torch.distributed as dist

    from .base import backend_device

    return backend_device(dist.get_backend(group))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def _check_devices(name: str, group, args, kwargs) -> None:
    try:
        want = _expected_device(group)
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return  # not a group torch.distributed knows (e.g. a launcher's own object): the call decides
    for t in _tensors(list(args) + list(kwargs.values())):
        if t.device != want:
            _fail(f"torch.distributed.{name} got a tensor on {t.device} (shape {tuple(t.shape)}, {t.dtype}); "
                  f"the group's backend ({dist_backend(group)}) takes tensors on {want}")


def dist_backend(group) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group))


# Where each collective's group argument sits positionally (after its tensors and op).
_GROUP_POS = {"all_reduce": 2, "broadcast": 2, "all_to_all_single": 4, "all_gather_into_tensor": 2,
              "all_gather_single": 2, "all_gather": 2, "reduce_scatter_tensor": 3, "reduce_scatter": 3,
              "all_to_all": 2, "reduce": 3, "gather": 3, "scatter": 3, "all_reduce_coalesced": 2}


def _wrap_collective(name: str, orig):
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if not getattr(_state, "inside", 0):  # nested calls (an alias calling the other) checked once
            _check_devices(name, _group_of(args, kwargs, _GROUP_POS.get(name, 99)), args, kwargs)
        _state.inside = getattr(_state, "inside", 0) + 1
        try:
            return orig(*args, **kwargs)
        finally:
            _state.inside -= 1

    return wrapper


def _wrap_p2p(name: str, orig):
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if not getattr(_state, "batch", 0):
            _fail(f"lone torch.distributed.{name} outside batch_isend_irecv: NCCL deadlocks when two ranks "
                  f"each wait on a receive queued before their send; post it in one batch_isend_irecv or use "
                  f"all_to_all_single")
        _check_devices(name, _group_of(args, kwargs, 2), args, kwargs)
        return orig(*args, **kwargs)

    return wrapper


def _wrap_batch(orig):
    @functools.wraps(orig)
    def wrapper(p2p_op_list):
        _state.batch = getattr(_state, "batch", 0) + 1
        try:
            return orig(p2p_op_list)
        finally:
            _state.batch -= 1

    return wrapper
