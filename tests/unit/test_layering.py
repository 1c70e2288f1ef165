"""The package layers import one way: core ← compress ← reduction ← engines (issue 22). A module that
imported upward would re-create the cycles that forced lazy imports before."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "zen_ext")
ORDER = ["core", "compress", "reduction", "engines"]


def _imported_packages(path: str, package: str) -> set[str]:
    """zen_ext subpackages that ``path`` (a module of ``package``) imports, at any depth in the file."""
    got = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").startswith("zen_ext."):
                got.add(node.module.split(".")[1])
            elif node.level == 1 and node.module:
                got.add(package if package else node.module.split(".")[0])
            elif node.level == 2 and node.module:
                got.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("zen_ext."):
                    got.add(a.name.split(".")[1])
    return got


def test_layers_import_downward_only():
    bad = []
    for i, layer in enumerate(ORDER):
        above = set(ORDER[i + 1:])
        for dirpath, _, files in os.walk(os.path.join(ROOT, layer)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    up = _imported_packages(path, layer) & above
                    if up:
                        bad.append(f"{os.path.relpath(path, ROOT)} imports {sorted(up)}")
    assert not bad, bad


def test_the_checker_sees_an_upward_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from ..reduction.synchronizer import GradSlice\nimport zen_ext.engines.ddp\n")
    assert _imported_packages(str(p), "core") == {"reduction", "engines"}


MAX_MODULE_LINES = 500
"""Issue 22's bound: a module that grows past it holds more than one concern; split it by concern."""


def test_no_module_over_the_line_bound():
    long = []
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_MODULE_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, long
