"""The recipes' learning-rate schedules: the DeepSpeed recipe fills a scheduler's ``"total_num_steps": "auto"``
with the run's ``--steps``; the ColossalAI recipe warms up, then stays or decays to ``train.min_lr_ratio``."""

from __future__ import annotations

import glob
import json
import os

import pytest

from recipes import common, finetune_llm
from recipes.finetune_llm_colossalai import TrainSettings, lr_factor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, total):
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": total, "warmup_num_steps": 10,
                                                             "cos_min_ratio": 0.1}}
    path = tmp_path / "cosine.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_auto_total_steps_is_the_run_length(tmp_path):
    args = finetune_llm.parse_args(["--deepspeed_config", _config(tmp_path, "auto"), "--steps", "137",
                                    "--output_dir", str(tmp_path / "out")])
    assert finetune_llm.load_ds_config(args)["scheduler"]["params"]["total_num_steps"] == 137


def test_a_given_total_is_kept(tmp_path):
    args = finetune_llm.parse_args(["--deepspeed_config", _config(tmp_path, 500), "--steps", "137",
                                    "--output_dir", str(tmp_path / "out")])
    assert finetune_llm.load_ds_config(args)["scheduler"]["params"]["total_num_steps"] == 500


def test_colossalai_recipe_warms_up_then_decays_to_its_floor():
    constant = TrainSettings.from_dict({"warmup_steps": 10})
    assert [lr_factor(constant, s, 100) for s in (0, 5, 10, 60, 100)] == [0.0, 0.5, 1.0, 1.0, 1.0]
    cosine = TrainSettings.from_dict({"warmup_steps": 10, "min_lr_ratio": 0.1})
    assert lr_factor(cosine, 5, 100) == 0.5 and lr_factor(cosine, 10, 100) == 1.0
    assert abs(lr_factor(cosine, 55, 100) - 0.55) < 1e-12  # half-way: the mean of 1 and the floor
    assert abs(lr_factor(cosine, 100, 100) - 0.1) < 1e-12 and abs(lr_factor(cosine, 130, 100) - 0.1) < 1e-12


def test_colossalai_recipe_rejects_a_floor_outside_0_1():
    with pytest.raises(ValueError, match=r"train.min_lr_ratio \(1.5\) must be in \[0, 1\]"):
        TrainSettings.from_dict({"min_lr_ratio": 1.5})


@pytest.mark.parametrize("name", sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.json"))
                                        if "colossalai" not in p and "fsdp2_" not in p))
def test_every_shipped_deepspeed_config_builds_its_scheduler(tmp_path, name):
    """Each config under configs/ that the DeepSpeed recipe takes gives DeepSpeed's scheduler class
    parameters it accepts once the recipe has filled them, and a rate that ends where it says."""
    import torch
    from deepspeed.runtime import lr_schedules

    args = finetune_llm.parse_args(["--deepspeed_config", os.path.join(ROOT, "configs", name), "--steps", "300",
                                    "--output_dir", str(tmp_path / "out")])
    sched = finetune_llm.load_ds_config(args)["scheduler"]
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    s = getattr(lr_schedules, sched["type"])(opt, **sched["params"])
    for _ in range(300):
        s.step()
    end = sched["params"].get("cos_min_ratio", 1.0) * 1e-3 if sched["type"] == "WarmupCosineLR" \
        else sched["params"]["warmup_max_lr"]
    assert abs(opt.param_groups[0]["lr"] - end) < 1e-9


def test_an_auto_the_recipe_cannot_fill_is_a_clear_error(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    cfg["optimizer"]["params"]["lr"] = "auto"
    path = tmp_path / "auto_lr.json"
    path.write_text(json.dumps(cfg))
    args = finetune_llm.parse_args(["--deepspeed_config", str(path), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(common.ConfigError, match=r'optimizer.params.lr \("auto"\) must be a number: this recipe '
                                                 r"fills only scheduler.params.total_num_steps"):
        finetune_llm.load_ds_config(args)


def test_the_start_line_names_the_schedule(tmp_path):
    args = finetune_llm.parse_args(["--deepspeed_config", _config(tmp_path, "auto"), "--steps", "137",
                                    "--output_dir", str(tmp_path / "out")])
    text = finetune_llm._describe_schedule(finetune_llm.load_ds_config(args))
    assert text == "WarmupCosineLR(warmup=10,total=137,min=0.1)"
    assert finetune_llm._describe_schedule({}) == "none"
