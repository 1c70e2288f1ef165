"""A config error in the recipe is one clear line, printed once (rank 0), and every rank exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, rank: int, debug: bool = False):
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    cfg["zen"]["dgc"]["densty"] = 0.05
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, RANK=str(rank), ZEN_DEBUG="1" if debug else "0", DS_ACCELERATOR="cpu",
               PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
                           str(path), "--output_dir", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.parametrize("rank", [0, 1])
def test_unknown_key_is_one_line_on_rank_0_and_every_rank_exits_2(tmp_path, rank):
    p = _run(tmp_path, rank)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if "configuration error" in line]
    if rank == 0:
        assert len(lines) == 1, p.stderr
        assert "zen.dgc got unknown key(s) ['densty']; did you mean 'density' for 'densty'?" in lines[0]
    else:
        assert lines == [], p.stderr


def test_debug_flag_shows_the_traceback(tmp_path):
    p = _run(tmp_path, 0, debug=True)
    assert p.returncode != 0 and "Traceback" in p.stderr and "densty" in p.stderr


def test_colossalai_recipe_reports_a_typo_once(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "configs", "colossalai_ddp_demo.json")))
    cfg["zen"]["sheme"] = cfg["zen"].pop("scheme", "zen")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, RANK="0", ZEN_DEBUG="0", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llm_colossalai.py"), "--config",
                        str(path), "--output_dir", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and "did you mean 'scheme' for 'sheme'?" in lines[0], p.stderr[-2000:]


def test_a_removed_option_is_refused_before_any_process_starts(tmp_path):
    """``--frozen_variance_after`` (removed) and a removed ``zen.dgc`` key: one line each saying so, exit 2,
    before the process group, the data or the model exist."""
    cfg = json.load(open(os.path.join(ROOT, "configs", "demo_ds.json")))
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, RANK="0", ZEN_DEBUG="0", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
                        str(path), "--output_dir", str(tmp_path / "out"), "--frozen_variance_after", "60"], env=env,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and "--frozen_variance_after was removed" in lines[0], p.stderr[-2000:]
    assert "docs/results/dgc_history.md" in lines[0] and not os.path.exists(tmp_path / "out")
    cfg["zen"]["dgc"]["normalize_beta"] = 0.95
    path.write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
                        str(path), "--output_dir", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and "zen.dgc.normalize_beta was removed" in lines[0], p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")
