"""What a reader follows resolves: every relative markdown link in README.md, docs/, benchmarks/ and launch/,
and every ``benchmarks/...`` path the docs, the benchmarks, the launch scripts, the recipes and the tests
name (a command to run, a results file to read, a sys.path entry). benchmarks/ is grouped by what it
measures (comm/, cluster/, quality/, memory/, gpu/), and a moved script or results file must take every
mention along."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BENCH_PATH = re.compile(r"(?<![\w/.$-])(?:\.\./)*(benchmarks/[\w./\-\[\]*<>{}]*)")
HISTORY = re.compile(r"[0-9a-f]{7,40}:$")
"""``git show <commit>:benchmarks/...`` names a file as it was in that commit, not in the tree."""
WRITTEN_BY_A_RUN = ("gpu_check_multi.md",)
"""Paths a run writes where the tree has none yet (``launch/gpu_check.sh --multi`` on a multi-GPU node)."""


def _files(*tops: str, ends: tuple[str, ...]) -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *tops], cwd=ROOT,
                                capture_output=True, text=True, timeout=60, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"git cannot list the tree: {exc}")
    return [f for f in listed if f.endswith(ends) and os.path.isfile(os.path.join(ROOT, f))]


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_relative_markdown_links_resolve():
    dead = []
    for rel in _files("README.md", "docs", "benchmarks", "launch", ends=(".md",)):
        text = _read(rel)
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"(https?:|mailto:|#)", target):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), target.split("#")[0]))):
                dead.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: ({target})")
    assert not dead, "links to nothing:\n" + "\n".join(dead)


def test_every_named_benchmarks_path_exists():
    dead = []
    for rel in _files("README.md", "docs", "benchmarks", "launch", "recipes", "configs", "tests",
                      ends=(".md", ".py", ".sh", ".json")):
        text = _read(rel)
        for m in BENCH_PATH.finditer(text):
            path = m.group(1).rstrip(".,:;)`'\"]")
            if HISTORY.search(text[max(0, m.start() - 45):m.start()]) or path.endswith(WRITTEN_BY_A_RUN):
                continue
            wild = [path.find(c) for c in "*<>{}[" if c in path]
            if wild:  # a glob or a template: its folder must exist
                path = path[:min(wild)]
                path = path[:path.rfind("/") + 1]
            if path and not os.path.exists(os.path.join(ROOT, path)):
                dead.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}")
    assert not dead, "paths to nothing:\n" + "\n".join(dead)
