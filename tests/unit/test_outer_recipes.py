"""The recipes' ``--outer_*`` flags land in ``zen.outer``; what does not serve zen.outer refuses it by name."""

import json
import os

import pytest
import torch

from recipes import common
from zen_ext.comm.simulated import SimWorld
from zen_ext.config import ZenConfig
from zen_ext.reduction.attachment import assemble

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_deepspeed_recipe_flags_fill_zen_outer(tmp_path):
    from recipes.finetune_llm import load_ds_config, parse_args

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zen": {"scheme": "zen"}}))
    args = parse_args(["--deepspeed_config", str(cfg), "--outer_every", "5", "--outer_density", "1", "--outer_lr",
                       "0.7", "--outer_momentum", "0.9", "--outer_nesterov", "--outer_delay", "1", "--output_dir",
                       str(tmp_path)])
    outer = load_ds_config(args)["zen"]["outer"]
    assert outer == {"enabled": True, "every": 5, "density": 1.0, "lr": 0.7, "momentum": 0.9, "nesterov": True,
                     "delay": 1}
    assert ZenConfig.from_dict(load_ds_config(args)["zen"]).outer.nesterov is True
    # no flag: the config as written
    plain = parse_args(["--deepspeed_config", str(cfg), "--output_dir", str(tmp_path)])
    assert "outer" not in load_ds_config(plain)["zen"]
    bad = parse_args(["--deepspeed_config", str(cfg), "--outer_every", "0", "--output_dir", str(tmp_path)])
    with pytest.raises(common.ConfigError, match=r"zen.outer.every \(0\) must be >= 1"):
        load_ds_config(bad)


def test_fsdp_recipe_flags_fill_zen_outer_and_choose_the_hsdp_mesh():
    from recipes.finetune_llm_fsdp import build_optimizer, load_config, mesh_shape, outer_enabled, parse_args

    path = os.path.join(ROOT, "configs", "fsdp2_zen_dgc5.json")
    args = parse_args(["--config", path, "--outer_every", "4", "--outer_density", "1", "--outer_delay", "1",
                       "--replicas", "2"])
    fsdp, zen = load_config(path, args)
    assert zen["outer"] == {"enabled": True, "every": 4, "density": 1.0, "delay": 1} and outer_enabled(zen)
    assert not outer_enabled(load_config(path, parse_args(["--config", path]))[1])  # without the flag: as before
    assert mesh_shape(2, 4, True) == (2, 2) and mesh_shape(None, 4, True) == (4, 1)
    assert mesh_shape(None, 4, False) is None
    assert mesh_shape(2, 4, False) == (2, 2)  # HSDP for the per-step adapter too
    with pytest.raises(common.ConfigError, match=r"--replicas \(3\) must divide the world size \(4\)"):
        mesh_shape(3, 4, True)
    with pytest.raises(common.ConfigError, match=r"--replicas \(1\) must be >= 2 with zen.outer"):
        mesh_shape(1, 4, True)
    bad = parse_args(["--config", path, "--outer_every", "0"])
    with pytest.raises(common.ConfigError, match=r"zen.outer.every \(0\) must be >= 1"):
        load_config(path, bad)
    # the outer form trains with plain AdamW, though the config's zen.dgc is on (DGC does not run under it)
    assert build_optimizer(args, fsdp, zen, torch.nn.Linear(2, 2))[1] == "AdamW"


def test_per_step_attachments_refuse_outer():
    cfg = ZenConfig.from_dict({"outer": {"enabled": True}})

    def body(comm):
        with pytest.raises(NotImplementedError) as info:
            assemble(torch.nn.Linear(2, 2), cfg, sync_comm=comm, tp_comm=None, rank=0, dp_size=1, device="cpu")
        return str(info.value)
    (msg,) = SimWorld(1).run(body)
    assert msg.startswith("zen.outer (enabled) is served by torch DDP (zen_ext.engines.ddp_outer.register_outer) "
                          "and DeepSpeed ZeRO-0")
