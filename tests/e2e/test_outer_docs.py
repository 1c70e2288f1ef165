"""docs/outer.md: every code block is marked, and the runnable ones run as written (2 CPU ranks, torchrun; the
FSDP2 HSDP one on 4).

Markers as in tests/e2e/test_fsdp_docs.py: ``<!-- snippet: NAME -->`` on the line before a block runs it,
``<!-- snippet: NAME (not run...: why) -->`` says where it is covered instead."""

import os
import re
import subprocess
import sys

import torch

from tests.e2e.doc_blocks import blocks
from tests.multiproc.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _blocks() -> list[tuple[str | None, bool, str, str]]:
    return blocks("docs/outer.md")


def test_every_block_is_marked():
    found = _blocks()
    assert found and all(name for name, *_ in found), [b[3][:60] for b in found if not b[0]]


def _run(tmp_path, name: str, script: str = "train.py", ranks: int = 2):
    (text,) = [t for n, run, lang, t in _blocks() if n == name and run and lang == "python"]
    (tmp_path / script).write_text(text)
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(free_port()),
                           script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_ddp_snippet_runs_as_written(tmp_path):
    proc = _run(tmp_path, "ddp-outer")
    assert re.search(r"outer steps 2, sent 42 of 2696 entries, \d+ bytes", proc.stdout), proc.stdout
    sds = [torch.load(tmp_path / f"outer_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(sd["outer_steps"] == 2 and sd["inner_steps"] == 10 for sd in sds)
    assert torch.equal(sds[0]["buckets"][0]["theta"], sds[1]["buckets"][0]["theta"])  # one θ_global


def test_deepspeed_snippet_runs_as_written(tmp_path):
    os.symlink(os.path.join(ROOT, "recipes"), tmp_path / "recipes")
    proc = _run(tmp_path, "deepspeed-outer")
    assert "zen_ext: zen.outer on DeepSpeed ZeRO-0 (2 replicas): every 4 steps" in proc.stdout, proc.stdout
    assert re.search(r"zen.outer summary \(2 replicas, 2 outer steps\): sent [\d,]+ bytes per rank, 0\.0\d+x",
                     proc.stdout), proc.stdout


def test_fsdp_hsdp_snippet_runs_as_written(tmp_path):
    proc = _run(tmp_path, "fsdp-hsdp-outer", ranks=4)
    # 674 of the 1,348 parameters a rank (2 shards), k = round(674/64) = 11 per outer step; θ_global + e, fp32
    assert "outer steps 2, sent 22 of 1348 shard entries, 5392 bytes of outer state" in proc.stdout, proc.stdout
    sds = [torch.load(tmp_path / f"outer_rank{r}.pt", weights_only=True)["outer"] for r in range(4)]
    for shard in (0, 1):  # ranks shard and shard + 2 hold the same shard: one θ_global
        assert torch.equal(sds[shard]["buckets"][0]["theta"], sds[shard + 2]["buckets"][0]["theta"])
    assert sds[0]["buckets"][0]["theta"].numel() == 674 and sds[0]["mesh"] == [2, 2]


def test_readme_excerpt_is_lines_of_the_ddp_snippet():
    """README.md's zen.outer excerpt is verbatim lines of the DDP block this file runs."""
    (ddp,) = [t for n, run, lang, t in _blocks() if n == "ddp-outer"]
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    start = lines.index(next(x for x in lines if x.startswith("<!-- snippet: outer-excerpt"))) + 2
    excerpt = lines[start:lines.index("```", start)]
    assert excerpt and all(line in ddp.splitlines() for line in excerpt), excerpt


def test_readme_fsdp_excerpt_is_lines_of_the_hsdp_snippet():
    """README.md's FSDP2 HSDP excerpt is verbatim lines of the HSDP block this file runs on 4 ranks."""
    (hsdp,) = [t for n, run, lang, t in _blocks() if n == "fsdp-hsdp-outer"]
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    start = lines.index(next(x for x in lines if x.startswith("<!-- snippet: outer-fsdp-excerpt"))) + 2
    excerpt = lines[start:lines.index("```", start)]
    assert len(excerpt) == 3 and all(line in hsdp.splitlines() for line in excerpt), excerpt
