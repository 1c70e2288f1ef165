"""The torch internals the FSDP2 adapters (``engines/fsdp.py``, ``engines/fsdp_hsdp.py``) read, and the
check that they are there.

FSDP2 offers public hooks for the reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) and the HSDP
all-reduce (``FSDPModule.set_all_reduce_hook``), but the reduce-scatter's base class and everything the
adapters need to lay out FSDP's gradients (parameter groups, their mesh infos and process groups, each
parameter's unsharded size and placement) are private to ``torch.distributed.fsdp._fully_shard``. A torch
release may move or rename any of them, so each ``attach`` (and ``zen_ext.fsdp.attach`` before it tells
the two apart) calls ``check_fsdp_internals`` first:

1. The torch version is one the tests ran (``VERIFIED_TORCH``); another version raises, unless
   ``ZEN_EXT_ALLOW_UNVERIFIED_TORCH=1`` is set (then a warning), as ``check_deepspeed_version`` does
   for DeepSpeed.
2. Every private name in ``INTERNALS`` that the path reads (``"shared"``, and ``"1-D"`` or ``"HSDP"``) is
   there, on the modules and on every FSDP module of the model; a missing one always raises (no override:
   the adapter cannot run without it), naming it.

``ReduceScatter`` is exported from here: when torch lacks it, importing ``engines/fsdp.py`` still works
(its subclass derives from a stand-in) and ``attach`` raises the clear error instead of an ImportError.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

__all__ = ["ALLOW_UNVERIFIED_ENV", "INTERNALS", "PATHS", "ReduceScatter", "VERIFIED_TORCH", "check_fsdp_internals",
           "check_torch_version"]

VERIFIED_TORCH = ("2.13", "2.13")
"""The torch minor releases (first, last) the FSDP2 adapter's tests ran on (tests/multiproc/test_fsdp.py)."""

ALLOW_UNVERIFIED_ENV = "ZEN_EXT_ALLOW_UNVERIFIED_TORCH"

_COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"

INTERNALS = {
    "shared": {  # read by both paths, and by zen_ext.fsdp.attach to tell HSDP from 1-D (hsdp_param_groups)
        "module": (f"{_COMMON}.HSDPMeshInfo", "torch.autograd.Variable._execution_engine.queue_callback"),
        "FSDPModule": ("_get_fsdp_state", "set_reduce_scatter_unused_params"),  # the latter named in errors
        "FSDPState": ("_fsdp_param_groups",),
        "FSDPParamGroup": ("mesh_info", "fsdp_params"),
        "FSDPMeshInfo": ("mesh",),
        "FSDPParam": ("fsdp_placement", "sharded_param", "_orig_size"),
    },
    "1-D": {  # engines/fsdp.py: ZEN's reduce-scatter
        "module": ("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter", f"{_COMMON}.FSDPMeshInfo",
                   f"{_COMMON}.DDPMeshInfo"),
        "FSDPModule": ("set_custom_reduce_scatter",),
        "FSDPParamGroup": ("_reduce_scatter_comm",),
        "FSDPMeshInfo": ("shard_process_group",),
    },
    "HSDP": {  # engines/fsdp_hsdp.py: FSDP's reduce-scatter, ZEN's all-reduce hook over the replicate group;
        # engines/fsdp_outer.py (zen.outer): the replicate group and is_sharded
        "FSDPModule": ("set_all_reduce_hook",),
        "FSDPParamGroup": ("_all_reduce_hook", "gradient_divide_factor", "force_sum_reduction_for_comms",
                           "mp_policy", "device", "is_sharded"),
        "HSDPMeshInfo": ("replicate_process_group", "replicate_mesh_size", "shard_mesh_size", "shard_mesh_rank"),
    },
}
"""Every private torch name the adapters read, by path, then by where it lives (``_fsdp_modules`` and
``attach`` in engines/fsdp.py; ``hsdp_param_groups``, ``check_hsdp_groups``, ``ZenAllReduceHook``,
``ZenHSDP.all_reduce`` and ``attach`` in engines/fsdp_hsdp.py; ``mesh_info.spmd_mesh`` is read only where
present). ``FSDPMeshInfo`` names are checked on every parameter group's mesh info, ``HSDPMeshInfo`` names on
those of a 2-D (HSDP) mesh."""

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


PATHS = ("1-D", "HSDP")
"""The adapters' paths, ``INTERNALS``'s keys besides ``"shared"``."""


def _needed(path: str | None) -> dict[str, tuple[str, ...]]:
    """``INTERNALS["shared"]`` merged with ``INTERNALS[path]`` (only the shared names for ``None``)."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path ({path!r}) must be one of {PATHS} or None")
    need = {where: list(names) for where, names in INTERNALS["shared"].items()}
    for where, names in (INTERNALS[path] if path else {}).items():
        need.setdefault(where, []).extend(names)
    return {where: tuple(names) for where, names in need.items()}


def _missing_in_modules(need: dict[str, tuple[str, ...]]) -> list[str]:
    """The names of ``need["module"]`` that this torch lacks."""
    import importlib

    missing = []
    for dotted in need.get("module", ()):
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


def _missing_on_model(model: torch.nn.Module, need: dict[str, tuple[str, ...]]) -> list[str]:
    """``Class.attr`` of ``need`` absent from the FSDP modules of ``model`` (each name once)."""
    import importlib

    from torch.distributed.fsdp import FSDPModule

    hsdp_info = getattr(importlib.import_module(_COMMON), "HSDPMeshInfo", None)  # the shared check names its absence
    missing: dict[str, None] = {}

    def check(obj, where: str) -> None:
        missing.update(dict.fromkeys(f"{where}.{a}" for a in need.get(where, ()) if not hasattr(obj, a)))

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        check(module, "FSDPModule")
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        if state is None:
            continue
        check(state, "FSDPState")
        for pg in getattr(state, "_fsdp_param_groups", ()):
            check(pg, "FSDPParamGroup")  # each attribute below is read only where present: all gaps are named
            if hasattr(pg, "mesh_info"):
                check(pg.mesh_info, "FSDPMeshInfo")
                if hsdp_info is not None and isinstance(pg.mesh_info, hsdp_info):
                    check(pg.mesh_info, "HSDPMeshInfo")
            for fp in getattr(pg, "fsdp_params", ()):
                check(fp, "FSDPParam")
    return list(missing)


def check_fsdp_internals(model: torch.nn.Module, version: str | None = None, *, path: str | None = "1-D") -> None:
    """Refuse, before anything is set on ``model``, a torch the FSDP2 adapters were not tested on or one
    that lacks a private name the ``path`` (``"1-D"``, ``"HSDP"``; ``None``: only what both read) reads.

    1. The version (``check_torch_version``; ``ZEN_EXT_ALLOW_UNVERIFIED_TORCH=1`` turns it into a warning).
    2. The module-level names, then the attributes on every FSDP module, state, parameter group, mesh
       info and parameter of ``model``: each missing one is named in the error (always raised).

    Raises:
        RuntimeError: an untested torch version, or a missing internal.
        ValueError: an unknown ``path``.
    """
    need = _needed(path)
    # Step 1: the version.
    found = check_torch_version(version)
    # Step 2: the internals.
    missing = _missing_in_modules(need)
    if not missing:
        missing = _missing_on_model(model, need)
    if missing:
        lo, hi = VERIFIED_TORCH
        raise RuntimeError(f"zen_ext.fsdp needs torch internals that torch {found} lacks: {', '.join(missing)}; "
                           f"the FSDP2 adapter{' (HSDP)' if path == 'HSDP' else ''} was tested on torch "
                           f"{lo if lo == hi else f'{lo}..{hi}'} (zen_ext/engines/fsdp_compat.py lists what it reads)")
