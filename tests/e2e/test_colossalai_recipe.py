"""recipes/finetune_llm_colossalai.py end to end under torchrun (slow): the lossless path reproduces the
dense baseline's losses, and a resumed run (model, optimizer, DGC residuals) continues the
uninterrupted trajectory exactly, with AdamW and with CatchUpAdamW."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.multiproc.launch import free_port

pytest.importorskip("colossalai")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "finetune_llm_colossalai.py")


def _run(nproc: int, config: dict, out_dir: str, steps: int, *extra: str, rc: int = 0):
    """The recipe under torchrun; its train log (``rc`` 0), or its stderr where it must exit with ``rc``."""
    os.makedirs(out_dir, exist_ok=True)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), RECIPE, "--config", cfg_path, "--steps", str(steps), "--max_docs", "60", "--seq_len", "32",
           "--output_dir", out_dir, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-5000:]
    if rc:
        return proc.stderr
    with open(os.path.join(out_dir, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]


TRAIN = {"micro_batch_size": 2, "lr": 0.003, "warmup_steps": 2}


@pytest.mark.slow
def test_recipe_tp2_natural_equals_dense_baseline(tmp_path):
    kwargs = {"tp_size": 2, "pp_size": 1, "zero_stage": 0, "precision": "fp32"}
    dense = _run(4, {"plugin": "hybrid_parallel", "plugin_kwargs": kwargs, "zen": {"enabled": False},
                     "train": TRAIN}, str(tmp_path / "dense"), 4)
    zen = _run(4, {"plugin": "hybrid_parallel", "plugin_kwargs": kwargs,
                   "zen": {"natural": {"enabled": True}, "dgc": {"enabled": False}}, "train": TRAIN},
               str(tmp_path / "zen"), 4)
    assert [r["loss"] for r in zen] == [r["loss"] for r in dense]
    assert zen[-1]["eval_loss"] == dense[-1]["eval_loss"]
    assert os.path.isfile(tmp_path / "zen" / "summary.json") and os.path.isfile(tmp_path / "zen" / "loss.png")
    with open(tmp_path / "zen" / "zen_stats.jsonl") as f:
        stats = [json.loads(line) for line in f]
    assert len(stats) == 4 and all(s["bytes_sent"] > 0 for s in stats)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "catch_up_adamw"])
def test_recipe_resume_continues_the_dgc_trajectory(tmp_path, optimizer):
    """With ``catch_up_adamw`` the optimizer's per-coordinate ages travel with the booster's optimizer
    checkpoint too: a lost age would change the first resumed step of every held-back coordinate."""
    config = {"plugin": "torch_ddp", "zen": {"dgc": {"enabled": True, "density": 0.05}},
              "train": {**TRAIN, "gradient_accumulation_steps": 2, "optimizer": optimizer}}
    full = _run(2, config, str(tmp_path / "full"), 6)
    _run(2, config, str(tmp_path / "part"), 3)
    if optimizer == "adamw":  # resumed under "auto" (CatchUpAdamW for DGC): refused, naming the saved optimizer
        other = {**config, "train": {**config["train"], "optimizer": "auto"}}
        err = _run(2, other, str(tmp_path / "part"), 6, "--resume", rc=1)  # torchrun: 1 when a rank fails
        assert ('was saved with optimizer adamw, but this run trains with catch_up_adamw, whose state differs; '
                'resume with train.optimizer "adamw"') in err
    resumed = _run(2, config, str(tmp_path / "part"), 6, "--resume")
    assert [r["step"] for r in resumed] == list(range(1, 7))  # the log appends
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert full[-1]["loss"] < full[0]["loss"]
