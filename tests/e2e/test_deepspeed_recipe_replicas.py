"""recipes/finetune_llm.py with ``--replicas 2``: zen.outer under DeepSpeed ZeRO-1 and ZeRO-2 inside 2 replica
groups of 2 ranks (4 gloo ranks, the ``deepspeed`` launcher), run as docs/outer.md's ``deepspeed-outer-recipe``
command line with a few steps added (6 steps, outer steps at 3 and 6, a checkpoint at step 4, mid-round; ZeRO-2
at ``--outer_delay 1``), through tests/e2e/_recipe_replicas.py for every rank's final weights and first
micro-batches; at ZeRO-1 the recipe then resumes from the step-4 checkpoint. One fixture per stage serves its
tests. The refusals run the recipe's checks alone (no launch) and one recipe process."""

import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from tests.e2e.doc_blocks import blocks
from tests.multiproc.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
SMALL = ["--data", "pydoc", "--max_docs", "25", "--tokenizer", "train", "--vocab_size", "512", "--seq_len", "64",
         "--steps", "6", "--eval_every", "3", "--save_every", "4", "--outer_every", "3"]
"""Added after the doc's arguments (argparse keeps the last of a repeated flag): a 6-step run, H = 3."""


def _doc_args() -> list[str]:
    """The recipe's arguments in docs/outer.md's DeepSpeed recipe command (after ``recipes/finetune_llm.py``)."""
    (text,) = [t for name, _, lang, t in blocks("docs/outer.md") if name == "deepspeed-outer-recipe"]
    words = shlex.split(text.replace("\\\n", " "))
    assert words[:4] == ["OMP_NUM_THREADS=1", "DS_ACCELERATOR=cpu", "deepspeed", "--num_gpus"] and words[4] == "4"
    return words[words.index("recipes/finetune_llm.py") + 1:]


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def run(request, tmp_path_factory):
    stage = request.param
    tmp = tmp_path_factory.mktemp(f"replicas_zero{stage}")
    args = _doc_args()
    if stage != 1:  # the doc's ZeRO-1 config at another stage
        cfg = json.load(open(os.path.join(ROOT, args[args.index("--deepspeed_config") + 1])))
        cfg["zero_optimization"]["stage"] = stage
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        args += ["--deepspeed_config", str(tmp / "cfg.json"), "--outer_delay", "1"]  # the last round merged at the end
    out = str(tmp / "out")
    rec = {"stage": stage, "out": out, **_launch(args, out)}
    if stage == 1:  # the recipe's --resume from the mid-round checkpoint (step 4) of the run above, to step 6
        resumed = tmp / "resumed"
        shutil.copytree(os.path.join(out, "checkpoints", "step4"), resumed / "checkpoints" / "step4")
        (resumed / "checkpoints" / "latest").write_text("step4")
        shutil.copy(os.path.join(out, "tokenizer.json"), resumed / "tokenizer.json")
        rec["resumed"] = _launch(args + ["--resume"], str(resumed))
    return rec


def _launch(args, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
           os.path.join(ROOT, "tests", "e2e", "_recipe_replicas.py"), *args, *SMALL, "--output_dir", out]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    return {"stdout": proc.stdout, "log": log,
            "weights": [torch.load(os.path.join(out, f"weights_rank{r}.pt"), weights_only=True) for r in range(4)],
            "batches": [torch.load(os.path.join(out, f"batches_rank{r}.pt"), weights_only=True) for r in range(4)]}


@pytest.mark.slow
def test_recipe_trains_zero_inside_two_replica_groups(run):
    """The layout line, ZeRO-<stage> inside groups of 2, 2 outer steps in 6, finite and falling losses."""
    stage, text, log = run["stage"], run["stdout"], run["log"]
    assert (f"deepspeed recipe: replicas: 2 replica groups x 2 ranks ([0, 1] [2, 3]), ZeRO-{stage} inside each, "
            f"zen.outer across them; data sharded over all 4 ranks") in text, text[-3000:]
    assert f"ZeRO-{stage} world=4 dp=2" in text  # DeepSpeed's data-parallel group: the replica group
    assert f"zen.outer on DeepSpeed ZeRO-{stage} (inside groups of 2 ranks, 2 replicas): every 3 steps" in text
    assert "zen.outer summary (2 replicas, 2 outer steps)" in text
    assert ("scheme zen, delay 1 (overlapped)" in text) == (stage == 2)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in log) and log[-1]["loss"] < log[0]["loss"] - 0.02
    assert [r["step"] for r in log if "eval_loss" in r] == [3, 6] and math.isfinite(log[-1]["eval_loss"])
    assert 0 < log[-1]["bytes_sent"] < log[-1]["dense_bytes"] / 10


@pytest.mark.slow
def test_replicas_equal_after_the_outer_step_and_apart_mid_round(run):
    """After step 6 (an outer step; under delay 1 with the last round merged at the end) all 4 ranks
    hold bitwise the same weights; the two groups' DeepSpeed checkpoints of step 4 (one inner step after the
    outer step at 3) hold different ones: each group trained alone."""
    w = run["weights"]
    assert len(w[0]) > 10 and all(w[r].keys() == w[0].keys() for r in range(4))
    assert all(torch.equal(w[r][k], w[0][k]) for r in range(1, 4) for k in w[0])
    mid = [torch.load(os.path.join(run["out"], "checkpoints", "step4", f"replica{g}", "step4",
                                   "mp_rank_00_model_states.pt"), weights_only=False)["module"] for g in (0, 1)]
    assert mid[0].keys() == mid[1].keys() and len(mid[0]) > 10
    assert not all(torch.equal(mid[0][k], mid[1][k]) for k in mid[0])
    with open(os.path.join(run["out"], "checkpoints", "latest")) as f:
        assert f.read().strip() == "step6"


@pytest.mark.slow
def test_each_rank_reads_its_own_share_of_the_data(run):
    """The first micro-batches of the 4 ranks share no block, step by step and over all of them: the two
    replica groups read different batches, the two ranks of a group different micro-batches."""
    b = run["batches"]
    assert all(len(x) == 4 and all(t.shape == (8, 64) for t in x) for x in b)
    for step in range(4):
        rows = [tuple(row.tolist()) for r in range(4) for row in b[r][step]]
        assert len(set(rows)) == 32, step
    everything = [tuple(row.tolist()) for x in b for t in x for row in t]
    assert len(set(everything)) == len(everything) == 128


# --- refusals ---------------------------------------------------------------------------------------------
def _config(stage, outer=True):
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds_outer_zero1.json")))
    cfg["zero_optimization"]["stage"] = stage
    cfg["zen"]["outer"]["enabled"] = outer
    return cfg


@pytest.mark.parametrize("stage, outer, replicas, text", [
    (1, False, 2, "--replicas (2) must come with zen.outer (--outer_every H, or zen.outer.enabled in the config): "
                  "without it nothing would synchronize the replica groups"),
    (0, True, 2, "--replicas (2) must be left out under ZeRO-0: zen.outer already makes every rank a replica of its "
                 "own there; --replicas groups ranks for ZeRO-1/2"),
    (3, True, 2, "--replicas (2) must be used with zero_optimization.stage 1 or 2, got 3: zen.outer does not serve "
                 "ZeRO-3 (its parameters are partitioned too)"),
    (2, True, 1, "--replicas (1) must be >= 2 with zen.outer (the outer sync runs across replicas)"),
    (1, True, None, "zero_optimization.stage (1) with zen.outer must come with --replicas R: ZeRO-1 partitions inside "
                    "each of R replica groups of world/R ranks and the outer sync runs across them (or use stage 0: "
                    "every rank a replica)"),
])
def test_settings_refused_before_training(stage, outer, replicas, text):
    from recipes import common, finetune_llm

    with pytest.raises(common.ConfigError) as info:
        finetune_llm.check_replicas(replicas, _config(stage, outer))
    assert str(info.value) == text


@pytest.mark.parametrize("stage, outer, replicas", [(0, True, None), (1, False, None), (1, True, 2), (2, True, 4)])
def test_settings_served(stage, outer, replicas):
    from recipes import finetune_llm

    finetune_llm.check_replicas(replicas, _config(stage, outer))


def test_recipe_refuses_replicas_under_zero_0_before_any_process_group(tmp_path):
    """The recipe itself: one configuration-error line, exit 2, no process group, data or model built."""
    env = dict(os.environ, RANK="0", ZEN_DEBUG="0", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
                        os.path.join(ROOT, "configs", "demo_ds_outer.json"), "--replicas", "2", "--output_dir",
                        str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and "--replicas (2) must be left out under ZeRO-0" in lines[0], p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_recipe_resumes_mid_round_bitwise(run):
    """ZeRO-1: the recipe resumed from its step-4 checkpoint (each replica group's DeepSpeed checkpoint, every
    rank's outer state, ``latest``) logs the uninterrupted run's losses at steps 5 and 6 and ends with its
    weights bitwise on every rank (the data continues where it stopped: same batches, same shares)."""
    if run["stage"] != 1:
        pytest.skip("resume is checked at ZeRO-1 (one launch fewer); the engine tests resume ZeRO-2 bitwise")
    res = run["resumed"]
    assert "start_step=4" in res["stdout"]
    assert [(r["step"], r["loss"], r.get("eval_loss")) for r in res["log"]] == \
        [(r["step"], r["loss"], r.get("eval_loss")) for r in run["log"][4:]]
    for r in range(4):
        assert all(torch.equal(res["weights"][r][k], run["weights"][r][k]) for k in run["weights"][r]), r
