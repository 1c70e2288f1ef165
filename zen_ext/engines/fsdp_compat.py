"""The torch internals the FSDP2 adapter (``engines/fsdp.py``) reads, and the check that they are there.

FSDP2 offers a public hook for the reduce-scatter (``FSDPModule.set_custom_reduce_scatter``), but its
argument's base class and everything the adapter needs to lay out FSDP's flat input (parameter groups,
their meshes, each parameter's unsharded size and placement) are private to
``torch.distributed.fsdp._fully_shard``. A torch release may move or rename any of them, so ``attach``
calls ``check_fsdp_internals`` first:

1. The torch version is one the tests ran (``VERIFIED_TORCH``); another version raises, unless
   ``ZEN_EXT_ALLOW_UNVERIFIED_TORCH=1`` is set (then a warning), as ``check_deepspeed_version`` does
   for DeepSpeed.
2. Every private name in ``INTERNALS`` is there, on the modules and on every FSDP module of the model;
   a missing one always raises (no override: the adapter cannot run without it), naming it.

``ReduceScatter`` is exported from here: when torch lacks it, importing ``engines/fsdp.py`` still works
(its subclass derives from a stand-in) and ``attach`` raises the clear error instead of an ImportError.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

__all__ = ["ALLOW_UNVERIFIED_ENV", "INTERNALS", "ReduceScatter", "VERIFIED_TORCH", "check_fsdp_internals",
           "check_torch_version"]

VERIFIED_TORCH = ("2.13", "2.13")
"""The torch minor releases (first, last) the FSDP2 adapter's tests ran on (tests/multiproc/test_fsdp.py)."""

ALLOW_UNVERIFIED_ENV = "ZEN_EXT_ALLOW_UNVERIFIED_TORCH"

INTERNALS = {
    "module": ("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
               "torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo",
               "torch.distributed.fsdp._fully_shard._fsdp_common.DDPMeshInfo",
               "torch.autograd.Variable._execution_engine.queue_callback"),
    "FSDPModule": ("_get_fsdp_state", "set_custom_reduce_scatter", "set_reduce_scatter_unused_params"),
    "FSDPState": ("_fsdp_param_groups",),
    "FSDPParamGroup": ("mesh_info", "fsdp_params", "_reduce_scatter_comm"),
    "FSDPMeshInfo": ("mesh", "shard_process_group"),
    "FSDPParam": ("fsdp_placement", "sharded_param", "_orig_size"),
}
"""Every private torch name the adapter reads, by where it lives (``_fsdp_modules`` and ``attach`` in
engines/fsdp.py; ``mesh_info.spmd_mesh`` is read only where present)."""

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # reported by check_fsdp_internals at attach

    class ReduceScatter:  # type: ignore[no-redef]
        """Stand-in base so that engines/fsdp.py imports; ``attach`` refuses to run with it."""

        _zen_missing = True


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch_version(version: str | None = None) -> str:
    """Raise RuntimeError unless torch's minor release is in ``VERIFIED_TORCH`` (or the override
    environment variable is set: then log a warning). Returns the version."""
    version = torch.__version__ if version is None else version
    lo, hi = VERIFIED_TORCH
    if not _minor(lo) <= _minor(version) <= _minor(hi):
        tested = lo if lo == hi else f"{lo}..{hi}"
        msg = (f"zen_ext.fsdp reads private FSDP2 internals verified on torch {tested}, found torch {version}; "
               f"install torch {hi} (launch/setup.sh), or set {ALLOW_UNVERIFIED_ENV}=1 to try anyway (missing "
               f"internals still fail at attach; tests/multiproc/test_fsdp.py checks the results)")
        if os.environ.get(ALLOW_UNVERIFIED_ENV) != "1":
            raise RuntimeError(msg)
        log.warning(msg)
    return str(version)


def _missing_in_modules() -> list[str]:
    """The names of ``INTERNALS["module"]`` that this torch lacks."""
    import importlib

    missing = []
    for dotted in INTERNALS["module"]:
        if dotted.startswith("torch.autograd."):
            ok = hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback")
        elif dotted.endswith(".ReduceScatter"):
            ok = not getattr(ReduceScatter, "_zen_missing", False)
        else:
            mod, _, name = dotted.rpartition(".")
            try:
                ok = hasattr(importlib.import_module(mod), name)
            except ImportError:
                ok = False
        if not ok:
            missing.append(dotted)
    return missing


def _missing_on_model(model: torch.nn.Module) -> list[str]:
    """``Class.attr`` of ``INTERNALS`` absent from the FSDP modules of ``model`` (each name once)."""
    from torch.distributed.fsdp import FSDPModule

    missing: dict[str, None] = {}

    def need(obj, where: str) -> None:
        missing.update(dict.fromkeys(f"{where}.{a}" for a in INTERNALS[where] if not hasattr(obj, a)))

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        need(module, "FSDPModule")
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        if state is None:
            continue
        need(state, "FSDPState")
        for pg in getattr(state, "_fsdp_param_groups", ()):
            need(pg, "FSDPParamGroup")  # each attribute below is read only where present: all gaps are named
            if hasattr(pg, "mesh_info"):
                need(pg.mesh_info, "FSDPMeshInfo")
            for fp in getattr(pg, "fsdp_params", ()):
                need(fp, "FSDPParam")
    return list(missing)


def check_fsdp_internals(model: torch.nn.Module, version: str | None = None) -> None:
    """Refuse, before anything is set on ``model``, a torch the FSDP2 adapter was not tested on or one
    that lacks a private name it reads.

    1. The version (``check_torch_version``; ``ZEN_EXT_ALLOW_UNVERIFIED_TORCH=1`` turns it into a warning).
    2. The module-level names, then the attributes on every FSDP module, state, parameter group, mesh
       info and parameter of ``model``: each missing one is named in the error (always raised).

    Raises:
        RuntimeError: an untested torch version, or a missing internal.
    """
    # Step 1: the version.
    found = check_torch_version(version)
    # Step 2: the internals.
    missing = _missing_in_modules()
    if not missing:
        missing = _missing_on_model(model)
    if missing:
        lo, hi = VERIFIED_TORCH
        raise RuntimeError(f"zen_ext.fsdp needs torch internals that torch {found} lacks: {', '.join(missing)}; "
                           f"the FSDP2 adapter was tested on torch {lo if lo == hi else f'{lo}..{hi}'} "
                           f"(zen_ext/engines/fsdp_compat.py lists what it reads)")
