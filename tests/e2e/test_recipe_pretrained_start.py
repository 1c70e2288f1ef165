"""The DeepSpeed recipe saves its final model with save_pretrained, and a second run fine-tunes from it
(fine-tuning from saved weights, offline), and ``--plain_adam``'s start line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zen_ext.comm.local import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, out: str, steps: int, extra: list[str], stdout: list | None = None) -> list[dict]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
           os.path.join(ROOT, "configs", "demo_ds.json"), "--data", "pydoc", "--max_docs", "25", "--steps", str(steps),
           "--output_dir", str(tmp_path / out), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    if stdout is not None:
        stdout.append(p.stdout)
    with open(tmp_path / out / "train_log.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One ``--plain_adam`` run of 6 steps that saves its model: the start of the fine-tuning run below,
    and the run whose start line and losses the ``--plain_adam`` test reads (a process start imports
    DeepSpeed and transformers: several seconds a run)."""
    tmp_path = tmp_path_factory.mktemp("pretrained_start")
    text: list[str] = []
    # The check is on the saved weights, not the optimizer: the config's AdamW moves furthest in 6 steps
    # (CatchUpAdamW holds the coordinates DGC has not sent yet where they are).
    first = _run(tmp_path, "pre", 6, ["--save_model", str(tmp_path / "pretrained"), "--plain_adam"], stdout=text)
    return tmp_path, first, text[0]


def test_saved_model_is_the_start_of_the_next_run(pretrained):
    tmp_path, first, _ = pretrained
    saved = tmp_path / "pretrained"
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    assert (saved / "tokenizer.json").is_file()
    second = _run(tmp_path, "ft", 1, ["--model", str(saved), "--tokenizer", str(saved)])
    # Random init starts near ln(1024) = 6.93; the saved model starts where the first run ended.
    assert first[0]["loss"] > 6.5
    assert second[0]["loss"] < first[0]["loss"] - 0.2, (first[0]["loss"], first[-1]["loss"], second[0]["loss"])


def test_plain_adam_keeps_the_config_optimizer_and_says_so(pretrained):
    """``--plain_adam`` keeps the config's AdamW (without it DGC under Adam trains with CatchUpAdamW), and
    the start line then hints at it; the run trains."""
    _, plain, text = pretrained
    assert "optimizer=AdamW (--plain_adam)" in text and "hint: DGC under plain Adam" in text
    assert plain[-1]["loss"] < plain[0]["loss"]
