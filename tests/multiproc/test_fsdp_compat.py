"""The FSDP2 adapter's guard on torch (``zen_ext/engines/fsdp_compat.py``): at ``attach``, an untested torch
version is refused (``ZEN_EXT_ALLOW_UNVERIFIED_TORCH=1`` lets it through with a warning) and a missing
private internal is always refused, named; on this torch, every internal is found on a real FSDP2 model."""

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
