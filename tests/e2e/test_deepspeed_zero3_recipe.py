"""recipes/finetune_llm.py under ZeRO-3 with ZEN's reduce-scatter: docs/deepspeed_zero3.md's command,
a few steps, with the config its JSON block shows."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.multiproc.launch import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
DOC = os.path.join(ROOT, "docs", "deepspeed_zero3.md")


def _block(name: str) -> str:
    """The fenced block right after ``<!-- snippet: name -->`` in the doc."""
    text = open(DOC).read()
    m = re.search(r"<!-- snippet: " + re.escape(name) + r" -->\n```\w*\n(.*?)```", text, re.S)
    assert m, name
    return m.group(1)


def _subset(small, big) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _subset(v, big[k]) for k, v in small.items())
    return small == big


def test_doc_config_block_is_the_shipped_config():
    with open(os.path.join(ROOT, "configs", "demo_ds_zero3.json")) as f:
        assert _subset(json.loads(_block("zero3-config")), json.load(f))


def test_recipe_runs_zero3_with_zen(tmp_path):
    line = _block("zero3-recipe").strip()
    args = line.split("recipes/finetune_llm.py", 1)[1].split()
    args[args.index("--output_dir") + 1] = str(tmp_path / "run")
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "recipes", "finetune_llm.py"), *args, "--data", "pydoc", "--max_docs", "25",
           "--tokenizer", "train", "--vocab_size", "512", "--seq_len", "64", "--steps", "3", "--eval_every", "3",
           "--save_every", "3", "--memory_report"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "ZEN on DeepSpeed ZeRO-3" in out and "reduce-scatter zen (ZeRO-3" in out, out[-3000:]
    assert "ZEN gradient synchronization summary (2 ranks, 3 optimizer steps)" in out
    assert "per rank  vs  DeepSpeed's dense reduce-scatter" in out  # what dense_bytes counts here
    with open(os.path.join(str(tmp_path / "run"), "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(0 < r["bytes_sent"] < r["dense_bytes"] for r in log), log
    # --memory_report: every rank's record; flat DGC keeps an fp32 residual of every DGC element
    with open(os.path.join(str(tmp_path / "run"), "summary.json")) as f:
        memory = json.load(f)["memory"]
    assert len(memory) == 2, memory
    for m in memory:
        assert 0 < m["dgc_params"] < m["params"], m
        assert 4 * m["dgc_params"] <= m["zen_state_bytes"] <= 4 * m["dgc_params"] + 4096, m
        assert 0 < m["init_rss_mib"] and m["peak_rss_mib"] == max(m["init_peak_mib"], m["train_peak_mib"]), m
