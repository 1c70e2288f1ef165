"""Every code block a user would copy from README.md, docs/deepspeed.md, docs/colossalai.md and
docs/demo.md runs as written.

Each fenced block carries a marker on the line before it: ``<!-- snippet: NAME -->`` (run here),
``<!-- snippet: NAME (output) -->`` (an example of printed output, checked against the summary's
format) or ``<!-- snippet: NAME (not run: why) -->``. An unmarked block, or a runnable marker with no
harness below, fails ``test_every_block_is_marked``, so a new README block cannot slip by untested.

How a block runs:

1. ``json`` blocks are configs: the DeepSpeed one is written verbatim to ``ds_config.json`` in a
   scratch directory (the Python blocks read that file), the ColossalAI one is validated.
2. ``python`` blocks that are fragments (``model``, ``loader`` come from the user's script) get a
   harness: ``PRELUDE`` builds a tiny random-init Llama and its data, then the block's exact text,
   then ``POSTLUDE`` writes what the test checks. The program is launched on 2 CPU processes with
   ``torchrun``, in the scratch directory (``configs/`` and ``recipes/`` are linked there, so the
   block's relative paths resolve as in a checkout).
3. ``bash`` blocks run line by line in ``bash -e`` in the scratch directory, with the venv's
   ``python``/``torchrun``/``deepspeed`` first on PATH and ``OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu`` (as
   the README says for CPU).

Every run must exit 0 and print no traceback and no ``Exception ignored`` (the
ColossalAI plugin's ``__del__`` at interpreter exit). A run that fails with exactly torch's known gloo
exit abort is run again (``tests/e2e/exit_abort.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.e2e.exit_abort import run_retrying_exit_abort
from tests.multiproc.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
DOCS = ("README.md", "docs/deepspeed.md", "docs/colossalai.md", "docs/demo.md")
MARK = re.compile(r"^<!--\s*snippet:\s*([\w.-]+)\s*(?:\((output|not run:[^)]*)\))?\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
MODEL = "configs/models/llama-tiny-untied.json"


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    name: str | None
    note: str | None
    lang: str
    text: str


def read_blocks(path: str) -> list[Block]:
    """The fenced code blocks of ``path`` with the marker on the line right before each."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        mark = MARK.match(lines[start - 1]) if start > 0 else None
        out.append(Block(path, start + 1, mark.group(1) if mark else None, mark.group(2) if mark else None,
                         m.group(1), "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return out


ALL = [b for p in DOCS for b in read_blocks(p)]
BY_NAME = {b.name: b for b in ALL if b.name}


# --- harnesses: what a user's script has around the fragment -------------------------------------------------
_DATA = f'''
import os, sys, json, warnings
import torch
from recipes.common import build_model
model = build_model({MODEL!r}, seed=0)
_g = torch.Generator().manual_seed(0)
_x = torch.randint(0, 1000, (6, 4, 32), generator=_g)
loader = [{{"input_ids": b, "labels": b}} for b in _x]           # 6 micro-batches of 4 sequences
batches = [b for b in _x]                                      # the ColossalAI docs' loop
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)     # ColossalAI's boost takes the user's


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(i))
        return {{"input_ids": x, "labels": x}}


train_dataset = _Tokens()
'''

_RESULT = '''
import torch.distributed as _dist
_rank = _dist.get_rank() if _dist.is_initialized() else int(os.environ.get("RANK", 0))
with open(f"result{_rank}.json", "w") as _f:
    json.dump(_result, _f)
'''

_DS_POST = '''
_result = {"zen": getattr(engine, "zen", None) is not None, "steps": engine.zen.stats.steps,
           "calls": engine.zen.override_calls, "totals": engine.zen.totals,
           "momentum_correction": engine.zen.cfg.dgc.momentum_correction, "scheme": engine.zen.cfg.scheme}
''' + _RESULT

_HF_POST = '''
_z = trainer.model_wrapped.zen
_result = {"zen": True, "steps": _z.stats.steps, "calls": _z.override_calls, "totals": _z.stats.totals,
           "momentum_correction": _z.cfg.dgc.momentum_correction, "scheme": _z.cfg.scheme}
''' + _RESULT

_CAI_TRAIN = '''
for batch in batches[:3]:
    loss = model(input_ids=batch, labels=batch).loss
    booster.backward(loss, optimizer)
    optimizer.step(); optimizer.zero_grad()
booster.plugin.zen.summary()
'''

_CAI_POST = '''
_z = booster.plugin.zen
_result = {"zen": _z is not None, "steps": _z.stats.steps, "totals": _z.stats.totals,
           "momentum_correction": _z.cfg.dgc.momentum_correction, "scheme": _z.cfg.scheme}
''' + _RESULT

_PLUGINS_POST = '''
booster = Booster(plugin=plugin)
for batch in batches[:3]:
    loss = model(input_ids=batch, labels=batch).loss
    booster.backward(loss, optimizer)
    optimizer.step(); optimizer.zero_grad()
_z = plugin.zen
_result = {"zen": _z is not None, "steps": _z.stats.steps, "totals": _z.stats.totals,
           "momentum_correction": _z.cfg.dgc.momentum_correction, "scheme": _z.cfg.scheme}
''' + _RESULT

_DDP_POST = '''
_result = {"zen": True, "steps": state.stats.steps, "totals": state.stats.totals,
           "momentum_correction": state.cfg.dgc.momentum_correction, "scheme": state.cfg.scheme}
with open(f"result{int(os.environ['RANK'])}.json", "w") as _f:
    json.dump(_result, _f)
'''

_API_PRE = '''
import os, json
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
_r = dist.get_rank()
dp_group = None                                                # the default group
numel = 1000
indices = torch.tensor([0, 7, 500 + _r, 999])                  # overlapping, first and last index
values = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (_r + 1)
per_rank_grads = [torch.zeros(64).index_fill_(0, torch.tensor([r % 64, 3]), float(r)) for r in range(128)]
'''

_API_POST = '''
_dense = torch.zeros(numel)
for _q in range(dist.get_world_size()):
    _dense.index_add_(0, torch.tensor([0, 7, 500 + _q, 999]), torch.tensor([1.0, 2.0, 3.0, 4.0]) * (_q + 1))
_dense /= dist.get_world_size()
_sim = sum(per_rank_grads)
_result = {"equal": bool(torch.equal(out, _dense)), "sim_equal": all(bool(torch.equal(o, _sim)) for o in outs),
           "sent": comm.stats.bytes_sent}
with open(f"result{_r}.json", "w") as _f:
    json.dump(_result, _f)
dist.destroy_process_group()
'''

# name -> (prelude, postlude); the block's own text goes between them, unchanged.
PYTHON_HARNESS = {
    "deepspeed-initialize": (_DATA, _DS_POST),
    "ds-doc-training-script": (_DATA, _DS_POST),
    "ds-doc-hf-trainer": (_DATA, _HF_POST),
    "colossalai-build-booster": (_DATA, _CAI_TRAIN + _CAI_POST),
    "cai-doc-build-booster": (_DATA, _CAI_POST),
    "cai-doc-plugins": (_DATA + "import colossalai\ncolossalai.launch_from_torch()\n", _PLUGINS_POST),
    "ddp": (_DATA, _DDP_POST),
    "cai-doc-ddp": (_DATA, _DDP_POST),
    "python-api": (_API_PRE, _API_POST),
}
JSON_BLOCKS = {"deepspeed-json", "cai-doc-json"}
BASH_BLOCKS = {"cli", "recipes-one-node"}
SLOW_BASH = {"recipes-one-node"}


# --- running ------------------------------------------------------------------------------------------------
def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT,
                PATH=BIN + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")


def _scratch(tmp_path) -> str:
    """A directory that looks like a checkout to the blocks: README's ds_config.json, configs/, recipes/."""
    for name in ("configs", "recipes"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "ds_config.json").write_text(BY_NAME["deepspeed-json"].text)
    return str(tmp_path)


def _run_with_retry(cmd, cwd: str) -> subprocess.CompletedProcess:
    return run_retrying_exit_abort(cmd, cwd=cwd, env=_env(), timeout=600)


def _check_output(proc: subprocess.CompletedProcess, what: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-6000:]}"
    for bad in ("Traceback", "Exception ignored", "terminate called"):
        assert bad not in out, f"{what} printed {bad!r}:\n{out[-6000:]}"
    return out


def _run_python(name: str, tmp_path) -> tuple[list[dict], str]:
    cwd = _scratch(tmp_path)
    pre, post = PYTHON_HARNESS[name]
    program = pre + "\n# --- the block, as written ---\n" + BY_NAME[name].text + "# --- end of the block ---\n" + post
    assert BY_NAME[name].text in program
    with open(os.path.join(cwd, "snippet.py"), "w") as f:
        f.write(program)
    proc = _run_with_retry([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port",
                            str(free_port()), "snippet.py"], cwd)
    out = _check_output(proc, f"{name} ({BY_NAME[name].path}:{BY_NAME[name].line})")
    results = []
    for r in range(2):
        with open(os.path.join(cwd, f"result{r}.json")) as f:
            results.append(json.load(f))
    return results, out


# --- the tests ----------------------------------------------------------------------------------------------
def test_every_block_is_marked():
    """Each block is marked, runnable markers have a harness, skipped ones say why, names are unique."""
    problems = []
    names = [b.name for b in ALL if b.name]
    problems += [f"duplicate marker {n!r}" for n in sorted(set(n for n in names if names.count(n) > 1))]
    for b in ALL:
        where = f"{b.path}:{b.line}"
        if b.name is None:
            problems.append(f"{where}: ```{b.lang} block without a <!-- snippet: NAME --> marker")
        elif b.note is None and b.name not in PYTHON_HARNESS and b.name not in JSON_BLOCKS | BASH_BLOCKS:
            problems.append(f"{where}: runnable block {b.name!r} has no harness in {__file__}")
        elif b.note and b.note.startswith("not run:") and len(b.note) < 15:
            problems.append(f"{where}: {b.name!r} must say why it is not run")
    assert not problems, "\n".join(problems)
    assert len(ALL) >= 20 and set(PYTHON_HARNESS) <= set(BY_NAME)


def test_output_blocks_have_the_summary_format():
    """The printed summaries in the docs look like what ``stats.summarize`` prints today."""
    from zen_ext.reduction.stats import summarize

    text = summarize([{"bytes_sent": 1, "dense_bytes": 5, "sync_s": 1.0}], 1, __import__("collections").Counter(
        {"dense": 1}), [2.0, 1.0], "scheme=auto")
    prefixes = [line.split(":")[0] + ":" for line in text.split("\n") if ":" in line]
    for b in ALL:
        if b.note == "output":
            lines = [line for line in b.text.split("\n") if line.strip()]
            assert lines[0].startswith("ZEN gradient synchronization summary ("), b
            for p in prefixes[1:]:
                assert any(line.startswith(p) for line in lines), f"{b.path}:{b.line} lacks {p!r}"


def test_json_blocks_are_valid_configs():
    from zen_ext.config import ZenConfig

    ds = json.loads(BY_NAME["deepspeed-json"].text)
    cfg = ZenConfig.from_ds_config(ds)
    assert cfg.enabled and cfg.scheme == "auto" and cfg.dgc.enabled and cfg.dgc.momentum_correction is None
    assert "optimizer" in ds  # ZeRO-1 needs one
    from zen_ext.engines.colossalai import ColossalAIConfig

    cai = ColossalAIConfig.from_json(json.loads(BY_NAME["cai-doc-json"].text))
    assert cai.plugin == "hybrid_parallel" and cai.zen.enabled and cai.zen.dgc.enabled


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed-initialize", "ds-doc-training-script"])
def test_deepspeed_initialize_block(name, tmp_path):
    """The README JSON as written (optimizer, bf16, ZeRO-1, scheme auto) through initialize."""
    results, out = _run_python(name, tmp_path)
    for r in results:
        assert r["zen"] and r["scheme"] == "auto" and r["steps"] == 6 and r["calls"] >= 6
        # ``auto`` minimizes time: on 2 local ranks (a measured ~10 Gbit/s link) dense may rightly win
        # for this tiny model, so ZEN never sends more than dense, and the summary says why it chose.
        assert 0 < r["totals"]["bytes_sent"] <= r["totals"]["dense_bytes"], out[-4000:]
        assert "candidates" in out, out[-4000:]
        assert r["momentum_correction"] is False  # AdamW: chosen, not applied twice
    assert out.count("zen_ext: ZEN on DeepSpeed ZeRO-1 (dp=2") == 1  # the start-up line, rank 0 only
    assert "momentum_correction=false (chosen: AdamW keeps its own moments" in out
    assert "ZEN gradient synchronization summary (2 ranks, 6 optimizer steps)" in out


@pytest.mark.slow
def test_hf_trainer_block_with_scheme_auto(tmp_path):
    """HF Trainer + enable() (docs/deepspeed.md's block, which the README points to) with exactly the README
    JSON: Accelerate leaves "scheme": "auto" alone."""
    results, out = _run_python("ds-doc-hf-trainer", tmp_path)
    for r in results:
        assert r["zen"] and r["scheme"] == "auto" and r["steps"] == 20 and r["calls"] >= 20
        # ``auto`` minimizes measured time: where the probed link is fast (CI's loopback), dense may
        # rightly win for this tiny model, so ZEN never sends more than dense and says why it chose.
        assert 0 < r["totals"]["bytes_sent"] <= r["totals"]["dense_bytes"], out[-4000:]
        assert "candidates" in out, out[-4000:]
    assert "ZEN gradient synchronization summary (2 ranks, 20 optimizer steps)" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["colossalai-build-booster", "cai-doc-build-booster", "cai-doc-plugins"])
def test_colossalai_blocks(name, tmp_path):
    """build_booster with the README's tp2 config (2 processes: tp 2 x dp 1, so ZEN's group has one
    rank and sends nothing), the docs' config loop, and the plugins built directly (tp 2 x dp 1)."""
    results, out = _run_python(name, tmp_path)
    for r in results:
        assert r["zen"] and r["steps"] == (6 if name == "cai-doc-build-booster" else 3)  # its loop: 6 batches
        # DGC on: chosen false from the AdamW given to boost; the plugins block's zen={} has DGC off.
        assert r["momentum_correction"] is (None if name == "cai-doc-plugins" else False)
    assert out.count("zen_ext: ZEN on a DDP comm hook (dp=1, tp=2)") == 1


@pytest.mark.slow
def test_ddp_block(tmp_path):
    if BY_NAME["ddp"].text != BY_NAME["cai-doc-ddp"].text:
        pytest.fail("README's and docs/colossalai.md's DDP blocks differ: run both")
    results, out = _run_python("ddp", tmp_path)
    for r in results:
        assert r["zen"] and r["steps"] == 6 and 0 < r["totals"]["bytes_sent"] < r["totals"]["dense_bytes"]
        assert r["momentum_correction"] is False
    assert "ZEN gradient synchronization summary (2 ranks, 6 optimizer steps)" in out
    assert "no optimizer was given" not in out  # optimizer= was passed


@pytest.mark.slow
def test_python_api_block(tmp_path):
    results, _ = _run_python("python-api", tmp_path)
    for r in results:
        assert r["equal"] and r["sim_equal"] and r["sent"] > 0


def _run_bash(name: str, tmp_path) -> str:
    cwd = _scratch(tmp_path)
    b = BY_NAME[name]
    proc = _run_with_retry(["bash", "-e", "-c", b.text], cwd)
    return _check_output(proc, f"{name} ({b.path}:{b.line})")


@pytest.mark.slow
def test_cli_block(tmp_path):
    out = _run_bash("cli", tmp_path)
    assert "integer-valued gradient (same rows, sum): bitwise equal to dense all-reduce: yes" in out
    assert "equal up to float summation order" in out
    assert "### n = 16" in out and "| zen | 0 |" in out


@pytest.mark.slow
def test_recipes_one_node_block(tmp_path):
    out = _run_bash("recipes-one-node", tmp_path)
    assert out.count("ZEN gradient synchronization summary (2 ranks, 20 optimizer steps)") == 2
    for d in ("runs/x", "runs/c"):
        with open(tmp_path / d / "summary.json") as f:
            assert json.load(f)["steps"] == 20
    assert "all_gather_into_tensor" not in out  # the recipes filter DeepSpeed's FutureWarning
