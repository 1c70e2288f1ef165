"""recipes/finetune_llm.py end to end: the ``deepspeed`` launcher, then a torchrun resume.

The demo's configuration (DGC + natural sparsity + ``scheme: "auto"``) on the built-in text with a
trained tokenizer, a few steps; then torchrun continues from the saved checkpoint. The engine-level
tests check bit-exact resume; this checks the recipe's wiring (launchers, checkpoint discovery, logs,
outputs) and the statistics it writes.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.multiproc.launch import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _run(cmd, rc=0):
    """The command's stdout (``rc`` 0), or its stderr where it must exit with ``rc``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stderr if rc else proc.stdout


def _recipe_args(out, steps, *extra):
    return [os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
            os.path.join(ROOT, "configs", "demo_ds.json"), "--data", "pydoc", "--max_docs", "25",
            "--tokenizer", "train", "--vocab_size", "512", "--seq_len", "64", "--steps", str(steps),
            "--eval_every", "2", "--save_every", "3", "--output_dir", out, *extra]


def test_recipe_with_deepspeed_launcher_then_torchrun_resume(tmp_path):
    out = str(tmp_path / "run")
    first = _run([os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                  *_recipe_args(out, 3)])
    assert "zen=on (auto) ZeRO-1 world=2 dp=2" in first and "start_step=0" in first
    assert "lr_schedule=WarmupLR(warmup=10)" in first  # the demo config's schedule, named on the start line
    # DGC under the config's AdamW: CatchUpAdamW by default, and the start line says why.
    assert "optimizer=CatchUpAdamW(catch_up=15/21) (the default for DGC under Adam" in first
    assert "hint: DGC under plain Adam" not in first
    assert "ZEN gradient synchronization summary (2 ranks, 3 optimizer steps)" in first
    second = _run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                   *_recipe_args(out, 5, "--resume")])
    assert "start_step=3" in second and "(2 ranks, 2 optimizer steps)" in second

    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    # ``auto`` minimizes time, not bytes: at 2 ranks on the configured 10 Gbit/s, dense may rightly win
    # for this tiny model, so ZEN never sends more than dense, and the summary says why it chose.
    assert all(r["bytes_sent"] <= r["dense_bytes"] for r in log)
    assert "candidates" in first and "auto:" in first
    assert [r["step"] for r in log if "eval_loss" in r] == [2, 3, 4, 5]
    with open(os.path.join(out, "zen_stats.jsonl")) as f:
        stats = [json.loads(line) for line in f]
    assert [r["step"] for r in stats] == [1, 2, 3, 4, 5]  # the resumed engine continues the step count
    assert all("loss" in r and r["schemes"] for r in stats)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["final"]["step"] == 5 and summary["zen_summary"].startswith("=")
    assert os.path.isfile(os.path.join(out, "tokenizer.json")) and os.path.isfile(os.path.join(out, "loss.png"))
    assert os.path.isfile(os.path.join(out, "checkpoints", "step3", "zen_ext", "rank00001.pt"))
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        assert f.read().strip() == "step5"


def test_catch_up_adam_resumes_its_ages_from_the_engine_checkpoint(tmp_path):
    """CatchUpAdamW through DeepSpeed (ZeRO-1, client optimizer): a run stopped at step 3 and resumed
    reproduces the uninterrupted run's losses exactly, which needs every held-back coordinate's age back
    from the engine's optimizer checkpoint (a lost age would change the first resumed step of each). The
    uninterrupted run takes the default (CatchUpAdamW for DGC under AdamW), the stopped one asks for it."""
    launch = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2"]
    full_out, part_out = str(tmp_path / "full"), str(tmp_path / "part")
    first = _run([*launch, "--master_port", str(free_port()), *_recipe_args(full_out, 6)])
    assert "optimizer=CatchUpAdamW(catch_up=" in first and "hint: DGC under plain Adam" not in first
    _run([*launch, "--master_port", str(free_port()), *_recipe_args(part_out, 3, "--catch_up_adam")])
    # Resumed with the config's AdamW instead: refused before any state loads, naming the flag that fits.
    err = _run([*launch, "--master_port", str(free_port()), *_recipe_args(part_out, 6, "--plain_adam", "--resume")],
               rc=2)
    assert ("was saved with optimizer CatchUpAdamW, but this run trains with AdamW (--plain_adam), whose state "
            "differs; resume with --catch_up_adam") in err
    _run([*launch, "--master_port", str(free_port()), *_recipe_args(part_out, 6, "--catch_up_adam", "--resume")])
    losses = []
    for out in (full_out, part_out):
        with open(os.path.join(out, "train_log.jsonl")) as f:
            losses.append([json.loads(line)["loss"] for line in f])
    assert len(losses[0]) == 6 and losses[1] == losses[0]
