"""The FSDP2 adapters' guard on torch (``zen_ext/engines/fsdp_compat.py``): at ``attach`` (1-D and HSDP), an
untested torch version is refused (``ZEN_EXT_ALLOW_UNVERIFIED_TORCH=1`` lets it through with a warning) and a
missing private internal the path reads is always refused, named; on this torch, every internal is found on a
real FSDP2 model."""

from __future__ import annotations

import re

import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext.engines import fsdp_compat


def test_version_check_names_the_tested_versions(monkeypatch):
    monkeypatch.delenv(fsdp_compat.ALLOW_UNVERIFIED_ENV, raising=False)
    lo, hi = fsdp_compat.VERIFIED_TORCH
    assert fsdp_compat.check_torch_version(f"{hi}.0+cpu") == f"{hi}.0+cpu"
    assert fsdp_compat.check_torch_version(f"{lo}.1") == f"{lo}.1"
    for other in ("2.6.0", "2.12.1+cu126", "2.14.0", "3.0.0", "2.14.0a0+git1234"):
        with pytest.raises(RuntimeError, match=re.escape(f"verified on torch {hi}, found torch {other}")) as err:
            fsdp_compat.check_torch_version(other)
        assert fsdp_compat.ALLOW_UNVERIFIED_ENV in str(err.value)
    monkeypatch.setenv(fsdp_compat.ALLOW_UNVERIFIED_ENV, "1")
    assert fsdp_compat.check_torch_version("2.12.1") == "2.12.1"  # a warning, not an error


def test_installed_torch_is_a_tested_one():
    """The suite runs on a torch the guard accepts; pyproject.toml's range is the guard's."""
    fsdp_compat.check_torch_version()
    import pathlib

    text = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    lo, hi = fsdp_compat.VERIFIED_TORCH
    major, minor = hi.split(".")
    assert f'"torch>={lo},<{major}.{int(minor) + 1}"' in text


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.b(self.a(x)).sum()


def _guard(rank, world):
    import os

    from torch.distributed.fsdp import fully_shard

    import zen_ext.fsdp

    def model():
        m = Two()
        fully_shard(m.a)
        fully_shard(m)
        return m

    def caught(fn):
        try:
            fn()
        except RuntimeError as exc:
            return str(exc)
        return None

    out = {"ok": caught(lambda: fsdp_compat.check_fsdp_internals(model()))}
    # A torch whose FSDPParam lacks _orig_size and whose parameter group lacks _reduce_scatter_comm.
    m = model()
    pg = m.a._get_fsdp_state()._fsdp_param_groups[0]
    del pg.fsdp_params[0]._orig_size
    del pg._reduce_scatter_comm
    out["missing"] = caught(lambda: zen_ext.fsdp.attach(m, {}))
    # A module-level name gone.
    import torch.distributed.fsdp._fully_shard._fsdp_common as common

    saved = common.DDPMeshInfo
    del common.DDPMeshInfo
    try:
        out["module"] = caught(lambda: zen_ext.fsdp.attach(model(), {}))
    finally:
        common.DDPMeshInfo = saved
    # An untested version: refused; with the override, attach goes on.
    fsdp_compat.VERIFIED_TORCH = ("2.12", "2.12")
    out["version"] = caught(lambda: zen_ext.fsdp.attach(model(), {}))
    os.environ[fsdp_compat.ALLOW_UNVERIFIED_ENV] = "1"
    attached = model()
    a = zen_ext.fsdp.attach(attached, {})
    attached(torch.ones(2, 4)).backward()
    out["override_steps"] = a.step
    a.close()
    return out


def test_attach_refuses_a_missing_internal_and_an_untested_version():
    out = run_workers(_guard, 1)[0]
    assert out["ok"] is None
    assert "FSDPParamGroup._reduce_scatter_comm" in out["missing"] and "FSDPParam._orig_size" in out["missing"]
    assert "tested on torch 2.13" in out["missing"] and "lacks" in out["missing"]
    assert "torch.distributed.fsdp._fully_shard._fsdp_common.DDPMeshInfo" in out["module"]
    assert "verified on torch 2.12, found torch 2.13" in out["version"]
    assert out["override_steps"] == 0  # one rank: FSDP skips the reduce-scatter, attach went through


def _guard_hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import zen_ext.fsdp

    def model(mesh=None):
        m = Two()
        fully_shard(m.a, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    def caught(fn):
        try:
            fn()
        except (RuntimeError, NotImplementedError) as exc:
            return type(exc).__name__, str(exc)
        return None

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    out = {"ok": caught(lambda: fsdp_compat.check_fsdp_internals(model(mesh), path="HSDP"))}
    # A torch whose HSDP mesh info lacks its replicate group and whose parameter group lacks the hook's slot:
    # named before anything else (the (1, 1) mesh's replicate dim of size 1 would be refused next).
    m = model(mesh)
    pg = m.a._get_fsdp_state()._fsdp_param_groups[0]
    del pg.mesh_info.replicate_process_group
    del pg._all_reduce_hook
    out["missing"] = caught(lambda: zen_ext.fsdp.attach(m, {}))
    out["untouched"] = caught(lambda: zen_ext.fsdp.attach(model(mesh), {}))  # the HSDP refusal that comes next
    # FSDPModule.set_all_reduce_hook gone: refused under HSDP, while a 1-D model (which does not read it) attaches.
    saved = FSDPModule.set_all_reduce_hook
    del FSDPModule.set_all_reduce_hook
    try:
        out["hook"] = caught(lambda: zen_ext.fsdp.attach(model(mesh), {}))
        flat = zen_ext.fsdp.attach(model(), {})
        out["flat"] = type(flat).__name__
        flat.close()
    finally:
        FSDPModule.set_all_reduce_hook = saved
    # HSDPMeshInfo gone: zen_ext.fsdp.attach cannot tell HSDP from 1-D and names it instead of an ImportError.
    import torch.distributed.fsdp._fully_shard._fsdp_common as common

    saved = common.HSDPMeshInfo
    del common.HSDPMeshInfo
    try:
        out["dispatch"] = caught(lambda: zen_ext.fsdp.attach(model(), {}))
    finally:
        common.HSDPMeshInfo = saved
    return out


def test_hsdp_attach_names_a_missing_hsdp_internal():
    """The HSDP path (zen_ext/engines/fsdp_hsdp.py) runs the same guard on the names it reads
    (``fsdp_compat.INTERNALS["HSDP"]``); a 1-D model is not refused for an HSDP-only name."""
    out = run_workers(_guard_hsdp, 1)[0]
    assert out["ok"] is None
    kind, msg = out["missing"]
    assert kind == "RuntimeError" and "tested on torch 2.13" in msg, out["missing"]
    assert "HSDPMeshInfo.replicate_process_group" in msg and "FSDPParamGroup._all_reduce_hook" in msg, msg
    assert out["untouched"][0] == "NotImplementedError" and "replicate dim has size 1" in out["untouched"][1]
    assert out["hook"][0] == "RuntimeError" and "FSDPModule.set_all_reduce_hook" in out["hook"][1], out["hook"]
    assert out["flat"] == "ZenFSDP"
    assert out["dispatch"][0] == "RuntimeError", out["dispatch"]
    assert "torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo" in out["dispatch"][1]
