"""recipes/finetune_llm_fsdp.py under torchrun (2 gloo ranks, a few steps of the tiny Llamas).

* FSDP2 with ZEN's reduce-scatter (configs/fsdp2_zen_dgc5.json: DGC 5 % and natural rows, CatchUpAdamW
  on the DTensor parameters, the default under DGC) on the untied model, and the plain FSDP2 baseline
  (configs/fsdp2_dense.json) on the tied one;
* natural-only ZEN on the tied model trains bitwise like plain FSDP2 (losses, eval losses, final weights
  and optimizer state);
* checkpoint and resume (``torch.distributed.checkpoint`` with each rank's ZEN state): a run resumed
  from the step-2 checkpoint of another equals it bitwise to the end, natural-only and with DGC (whose
  per-rank residuals are in the checkpoint, equal too);
* a bad config fails before any process group exists.

tests/multiproc/test_fsdp_recipe_shard.py holds the policies (mixed precision, activation checkpointing,
CPU offload) at the level of the recipe's ``shard``.
"""

import io
import json
import os
import shutil
import sys

import pytest
import torch

from tests.e2e.exit_abort import run_retrying_exit_abort
from tests.multiproc.launch import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
UNTIED, TIED = (os.path.join(ROOT, "configs", "models", f"llama-tiny-{t}.json") for t in ("untied", "tied"))
DGC, DENSE = (os.path.join(ROOT, "configs", f"fsdp2_{c}.json") for c in ("zen_dgc5", "dense"))
STEPS = 4


def _torchrun(config, out, steps=3, rc=0, model=UNTIED, extra=()):
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "recipes", "finetune_llm_fsdp.py"), "--config", config, "--data", "pydoc",
           "--max_docs", "25", "--tokenizer", "train", "--vocab_size", "512", "--seq_len", "64", "--steps", str(steps),
           "--eval_every", "2", "--model", model, "--output_dir", out, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = run_retrying_exit_abort(cmd, out_dir=out, cwd=ROOT, env=env, timeout=600)  # torch's gloo exit abort
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout if rc == 0 else proc.stderr


def _log(out) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _checkpoint(out, step=STEPS) -> dict:
    """The DCP folder of ``step`` as one flat dict (model, optimizer, recipe step, each rank's ZEN state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(out, "checkpoints", f"step{step}")
    dcp_to_torch_save(path, path + ".pt")
    flat = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, bytes):  # a rank's ZEN state, torch.save-d
                walk({"state": torch.load(io.BytesIO(v), weights_only=True)}, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v
    walk(torch.load(path + ".pt", weights_only=False), "")
    return flat


def _assert_same_checkpoint(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b))[:10])
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), (what, key)
        elif not key.endswith("config.stats.jsonl_path"):
            assert a[key] == b[key], (what, key, a[key], b[key])


def _same_training(a: list[dict], b: list[dict]) -> bool:
    keep = ("step", "loss", "eval_loss")
    return [{k: r[k] for k in keep if k in r} for r in a] == [{k: r[k] for k in keep if k in r} for r in b]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launch the tests read: ``{name: (stdout, output_dir)}``. "<name> resumed" is a fresh output
    directory holding only what the run ``name`` had written by step 2 (the tokenizer, its log lines, the
    checkpoint ``--save_every 2`` wrote), run with ``--resume`` to STEPS."""
    base = tmp_path_factory.mktemp("fsdp_recipe")
    natural = base / "natural.json"
    with open(DENSE) as f:
        natural.write_text(json.dumps({"fsdp": json.load(f)["fsdp"], "zen": {"scheme": "zen",
                                                                            "natural": {"enabled": True}}}))
    out = {}
    for name, config, model in (("dgc", DGC, UNTIED), ("plain", DENSE, TIED), ("natural", str(natural), TIED)):
        d = base / name
        out[name] = (_torchrun(config, str(d), steps=STEPS, model=model, extra=("--save_every", "2")), str(d))
        if name == "plain":
            continue
        r = base / f"{name}_resumed"
        shutil.copytree(d / "checkpoints" / "step2", r / "checkpoints" / "step2")
        (r / "checkpoints" / "latest").write_text("step2")
        shutil.copy(d / "tokenizer.json", r / "tokenizer.json")
        (r / "train_log.jsonl").write_text("".join(open(d / "train_log.jsonl").readlines()[:2]))
        out[f"{name} resumed"] = (_torchrun(config, str(r), steps=STEPS, model=model, extra=("--resume",)), str(r))
    return out


def test_fsdp_recipe_trains_with_zen_then_plain(runs):
    text, out = runs["dgc"]
    assert "zen_ext: ZEN on FSDP2 (dp=2, 4 FSDP modules): scheme=zen" in text
    assert "fsdp recipe: zen=on (zen) world=2 fsdp_modules=4 (2 blocks from _no_split_modules" in text
    assert "optimizer=CatchUpAdamW (the default for DGC under Adam" in text
    assert "ZEN gradient synchronization summary (2 ranks, 4 optimizer steps)" in text
    assert "per rank  vs  FSDP's dense reduce-scatter" in text  # what dense_bytes counts here
    assert "model.embed_tokens.weight:natural -> zen x4" in text and "lm_head.weight:dgc -> zen x4" in text
    log = _log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4] and [r["step"] for r in log if "eval_loss" in r] == [2, 4]
    assert 0 < log[-1]["bytes_sent"] < log[-1]["dense_bytes"]  # DGC's warm-up density 0.25 already sends less
    assert "peak memory per rank" in text
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step2", "step4"]

    plain, _ = runs["plain"]
    assert "fsdp recipe: zen=off" in plain and "ZEN gradient synchronization summary" not in plain
    assert "in the root unit (tied parameters): ['model.embed_tokens']" in plain and "fsdp_modules=3" in plain
    assert "optimizer=AdamW (no DGC)" in plain


def test_natural_only_zen_equals_plain_fsdp2_on_the_tied_model(runs):
    (plain, plain_out), (natural, natural_out) = runs["plain"], runs["natural"]
    assert "zen=on (zen)" in natural and "fsdp_modules=3" in natural
    assert _same_training(_log(natural_out), _log(plain_out))
    ckpt_plain, ckpt_natural = _checkpoint(plain_out), _checkpoint(natural_out)
    ours = {k: v for k, v in ckpt_natural.items() if not k.startswith("zen_ext.")}
    _assert_same_checkpoint(ours, ckpt_plain, "natural vs plain")
    assert ckpt_plain["model.lm_head.weight"].shape == (512, 64)  # the tie saved under both names


@pytest.mark.parametrize("name", ["natural", "dgc"])
def test_a_resumed_run_equals_the_uninterrupted_one(runs, name):
    (whole, whole_out), (resumed, resumed_out) = runs[name], runs[f"{name} resumed"]
    assert "start_step=2" in resumed
    assert _same_training(_log(resumed_out), _log(whole_out))
    a, b = _checkpoint(whole_out), _checkpoint(resumed_out)
    _assert_same_checkpoint(a, b, name)
    assert a["recipe.step"] == STEPS and {"zen_ext.rank00000.state.step", "zen_ext.rank00001.state.step"} <= a.keys()
    if name == "dgc":  # DGC's residuals (per rank) and CatchUpAdamW's ages came through the checkpoint
        assert any("residual" in k or "sparsifiers" in k for k in a if k.startswith("zen_ext.rank00001.")), sorted(a)
        assert any(k.endswith(".age") for k in a if k.startswith("optim.state.")), sorted(a)


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
