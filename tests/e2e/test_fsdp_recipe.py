"""recipes/finetune_llm_fsdp.py under torchrun: FSDP2 with ZEN's reduce-scatter (configs/fsdp2_zen_dgc5.json)
on the tiny Llama for a few steps, then the plain FSDP2 baseline (configs/fsdp2_dense.json); a bad config
fails before any process group exists."""

import json
import os
import subprocess
import sys

import pytest

from tests.multiproc.launch import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _torchrun(config, out, steps=3, rc=0):
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "recipes", "finetune_llm_fsdp.py"), "--config", config, "--data", "pydoc",
           "--max_docs", "25", "--tokenizer", "train", "--vocab_size", "512", "--seq_len", "64", "--steps", str(steps),
           "--eval_every", "2", "--output_dir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout if rc == 0 else proc.stderr


def test_fsdp_recipe_trains_with_zen_then_plain(tmp_path):
    out = str(tmp_path / "zen")
    text = _torchrun(os.path.join(ROOT, "configs", "fsdp2_zen_dgc5.json"), out)
    assert "zen_ext: ZEN on FSDP2 (dp=2, 4 FSDP modules): scheme=zen" in text
    assert "fsdp recipe: zen=on (zen) world=2 fsdp_modules=4" in text
    assert "ZEN gradient synchronization summary (2 ranks, 3 optimizer steps)" in text
    assert "per rank  vs  FSDP's dense reduce-scatter" in text  # what dense_bytes counts here
    assert "model.embed_tokens.weight:natural -> zen x3" in text and "lm_head.weight:dgc -> zen x3" in text
    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == [1, 2, 3] and [r["step"] for r in log if "eval_loss" in r] == [2, 3]
    assert 0 < log[-1]["bytes_sent"] < log[-1]["dense_bytes"]  # DGC's warm-up density 0.25 already sends less
    assert "peak memory per rank" in text

    plain = _torchrun(os.path.join(ROOT, "configs", "fsdp2_dense.json"), str(tmp_path / "plain"))
    assert "fsdp recipe: zen=off" in plain and "ZEN gradient synchronization summary" not in plain


def test_fsdp_recipe_refuses_a_bad_config_before_training(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fsdp": {"micro_batch": 8, "lr_max": 1.0}, "zen": {}}))
    err = _torchrun(str(bad), str(tmp_path / "out"), rc=1)
    assert "fsdp keys ['lr_max'] must be among" in err


@pytest.mark.parametrize("name", ["fsdp2_zen_dgc5.json", "fsdp2_dense.json"])
def test_shipped_fsdp_configs_validate(name):
    sys.path.insert(0, ROOT)
    from recipes.finetune_llm_fsdp import load_config

    fsdp, zen = load_config(os.path.join(ROOT, "configs", name))
    assert fsdp["micro_batch"] == 8 and (zen is not None) == ("zen" in name)
