"""``zen_ext.deepspeed.enable()`` makes the HF Trainer's DeepSpeed engine synchronize with ZEN.

HF Trainer users only pass ``TrainingArguments(deepspeed=<config with a "zen" section>)``; Accelerate
then calls ``deepspeed.initialize``, which the one-line opt-in has routed through zen_ext. Two gloo
processes, a tiny untied Llama, natural sparsity plus DGC: ZeRO-1 (ZEN's all-reduce) and ZeRO-3 (ZEN's
reduce-scatter, docs/deepspeed_zero3.md).
"""

import os

import pytest
import torch

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
STEPS = 4


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 1000, (n, 32), generator=g)

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer_worker(rank, world, out_dir, stage=1):
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed

    zen_ext.deepspeed.enable()  # the one line
    from transformers import Trainer, TrainingArguments

    from recipes.common import build_model

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "steps_per_print": 10**6,
        "zen": {"scheme": "zen", "dgc": {"enabled": True, "min_numel": 256}},
    }
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=STEPS,
                             learning_rate=2e-3, deepspeed=ds_config, report_to=[], logging_steps=1,
                             save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=build_model(MODEL, seed=0), args=args, train_dataset=_Tokens(64))
    trainer.train()
    engine = trainer.model_wrapped
    zen = getattr(engine, "zen", None)
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        w = torch.cat([p.detach().float().reshape(-1).clone() for p in params])
    return {"engine": type(engine).__name__, "zen": zen is not None,
            "calls": zen.override_calls if zen else 0, "totals": zen.totals if zen else {},
            "steps": zen.stats.steps if zen else 0,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "w": w, "stage": engine.zero_optimization_stage(), "sharded": getattr(zen, "sharded", None)}


@pytest.mark.parametrize("stage", [1, 3])
def test_hf_trainer_gets_zen_after_enable(tmp_path, stage):
    res = run_workers(_trainer_worker, 2, str(tmp_path), stage, timeout_s=600)
    for r in res:
        assert r["stage"] == stage and r["sharded"] == (stage == 3)
        assert r["engine"] == "DeepSpeedEngine" and r["zen"]
        assert r["calls"] >= STEPS and r["steps"] == STEPS
        assert 0 < r["totals"]["bytes_sent"] < r["totals"]["dense_bytes"]
        assert len(r["losses"]) == STEPS and all(torch.isfinite(torch.tensor(r["losses"])))
    assert torch.equal(res[0]["w"], res[1]["w"])  # the replicas were synchronized (by ZEN)
