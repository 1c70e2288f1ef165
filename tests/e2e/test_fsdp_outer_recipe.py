"""recipes/finetune_llm_fsdp.py with zen.outer (``--outer_every``) on a 2 × 2 HSDP mesh (``--replicas 2``),
4 gloo ranks under torchrun, the tiny untied Llama: it trains, prints the outer summary, writes per-rank
checkpoints, and a run resumed from the step-2 checkpoint (between outer steps, every 3) equals the
uninterrupted one bitwise: losses, eval losses, every rank's shards, AdamW state and outer state
(θ_global, error feedback, momentum). With ``--outer_delay 1`` the resume starts from the step-4 checkpoint,
one step into a round whose sum (the outer step at 3) is in flight, and the run's ``finish()`` after the last
step flushes it before the final eval."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.multiproc.launch import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
DENSE = os.path.join(ROOT, "configs", "fsdp2_dense.json")
STEPS = 5


def _torchrun(out, extra=()):
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "4", "--master_port", str(free_port()),
           os.path.join(ROOT, "recipes", "finetune_llm_fsdp.py"), "--config", DENSE, "--data", "pydoc",
           "--max_docs", "25", "--tokenizer", "train", "--vocab_size", "512", "--seq_len", "64", "--steps", str(STEPS),
           "--eval_every", "3", "--save_every", "2", "--model", MODEL, "--output_dir", out, "--replicas", "2",
           "--outer_every", "3", "--outer_density", "0.05", "--outer_momentum", "0.5", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _flat(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return [x]


@pytest.mark.parametrize("delay", [0, 1])
def test_outer_recipe_trains_and_resumes_bitwise(tmp_path, delay):
    whole = tmp_path / "whole"
    extra = ("--outer_delay", "1") if delay else ()
    text = _torchrun(str(whole), extra)
    assert "zen_ext: zen.outer on FSDP2 HSDP (replicate=2 x shard=2): every 3 steps" in text, text
    assert ("delay 1 (overlapped)" in text) == bool(delay), text
    assert re.search(r"zen.outer summary \(FSDP2 HSDP, 2 replicas x shard 2, 1 outer steps\): sent [\d,]+ bytes per "
                     r"rank, 0\.0\d+x", text), text
    assert sorted(os.listdir(whole / "checkpoints")) == ["latest", "step2", "step4", "step5"]
    resumed, at = tmp_path / "resumed", 4 if delay else 2
    shutil.copytree(whole / "checkpoints" / f"step{at}", resumed / "checkpoints" / f"step{at}")
    (resumed / "checkpoints" / "latest").write_text(f"step{at}")
    shutil.copy(whole / "tokenizer.json", resumed / "tokenizer.json")
    _torchrun(str(resumed), extra=(*extra, "--resume"))

    def log(d):
        with open(d / "train_log.jsonl") as f:
            return {r["step"]: (r["loss"], r.get("eval_loss"), r["bytes_sent"]) for r in map(json.loads, f)}
    a, b = log(whole), log(resumed)
    assert [a[s] for s in range(at + 1, STEPS + 1)] == [b[s] for s in range(at + 1, STEPS + 1)]
    for rank in range(4):
        x, y = (torch.load(d / "checkpoints" / "step5" / f"outer_rank{rank:05d}.pt", weights_only=True)
                for d in (whole, resumed))
        fx, fy = _flat(x), _flat(y)
        assert len(fx) == len(fy) and sum(isinstance(t, torch.Tensor) for t in fx) > 50
        assert all(torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q for p, q in zip(fx, fy)), rank
        assert x["outer"]["outer_steps"] == 1 and x["outer"]["buckets"][0]["error"] is not None
        assert x["outer"]["buckets"][0]["in_flight"] is False  # flushed (delay 1) or never (delay 0)
        if delay:  # the checkpoint resumed from held the round of the outer step at 3 in flight
            mid = torch.load(whole / "checkpoints" / "step4" / f"outer_rank{rank:05d}.pt", weights_only=True)
            assert all(b["in_flight"] for b in mid["outer"]["buckets"])
    # the two replicas of shard 0 hold the same θ_global and, after step 5 (between outer steps), other weights
    r0, r2 = (torch.load(whole / "checkpoints" / "step5" / f"outer_rank{r:05d}.pt", weights_only=True) for r in (0, 2))
    assert all(torch.equal(p["theta"], q["theta"]) for p, q in zip(r0["outer"]["buckets"], r2["outer"]["buckets"]))
    assert not all(torch.equal(r0["local"]["params"][n], r2["local"]["params"][n]) for n in r0["local"]["params"])
