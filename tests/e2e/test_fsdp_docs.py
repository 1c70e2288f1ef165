"""docs/fsdp.md: every code block is marked, and the runnable one runs as written (2 CPU ranks, torchrun).

Markers as in tests/e2e/test_readme_snippets.py: ``<!-- snippet: NAME -->`` on the line before a block
runs it, ``<!-- snippet: NAME (not run...: why) -->`` says where it is covered instead."""

import os
import subprocess
import sys

import torch

from tests.e2e.doc_blocks import blocks
from tests.multiproc.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _blocks() -> list[tuple[str | None, bool, str, str]]:
    return blocks("docs/fsdp.md")


def test_every_block_is_marked():
    found = _blocks()
    assert found and all(name for name, *_ in found), [b[3][:60] for b in found if not b[0]]


def test_attach_snippet_runs_as_written(tmp_path):
    (text,) = [t for name, run, lang, t in _blocks() if run and lang == "python"]
    (tmp_path / "train.py").write_text(text)
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                           "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "zen_ext: ZEN on FSDP2 (dp=2, 3 FSDP modules)" in proc.stdout
    assert "ZEN gradient synchronization summary (2 ranks, 5 optimizer steps)" in proc.stdout
    for rank in (0, 1):
        sd = torch.load(tmp_path / f"zen_rank{rank}.pt", weights_only=True)
        assert sd["step"] == 5 and sd["rank"] == rank and "3.weight" in str(sd["sync"]["sparsifiers"])


def _readme_block(name: str) -> str:
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- snippet: {name} "))
    end = lines.index("```", at + 2)
    return "\n".join(lines[at + 2 : end])


def test_readme_excerpts_are_lines_of_the_tested_docs():
    """README.md's sharded-training excerpts are verbatim lines of the blocks the tests run."""
    (script,) = [t for name, run, lang, t in _blocks() if run and lang == "python"]
    excerpt = _readme_block("fsdp-excerpt")
    assert excerpt and excerpt in script, excerpt
    zero3 = open(os.path.join(ROOT, "docs", "deepspeed_zero3.md")).read()
    config = zero3.split("<!-- snippet: zero3-config -->", 1)[1].split("```", 2)[1]
    excerpt = _readme_block("zero3-excerpt")
    assert excerpt and excerpt in config, excerpt
