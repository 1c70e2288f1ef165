"""The configuration reference (``python -m zen_ext.config_reference``; the README and docs embed it, and
tests/unit/test_config.py checks they hold the current one): every key of the ``zen`` section and its
subsections (one per registered sparsifier, then SparDL's, the outer synchronization's, the planner and the statistics) with its default and
the docstring under its field."""

from __future__ import annotations

import dataclasses
import inspect
import json

from .compress import registered
from .config import PlannerConfig, StatsConfig, ZenConfig
from .core.spardl import SparDLConfig
from .outer.config import OuterConfig


def _field_docs(cls) -> dict[str, str]:
    """Field name → the docstring under it, read from this module's source."""
    import ast

    src = inspect.getsource(cls)
    body = ast.parse(src).body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def reference_markdown() -> str:
    """Markdown tables of every key with its default and meaning (the docs' config reference)."""
    out = []
    sections = [(ZenConfig, "zen"), *((s.config, f"zen.{s.kind}") for s in registered()),
                (SparDLConfig, "zen.spardl"), (OuterConfig, "zen.outer"), (PlannerConfig, "zen.planner"), (StatsConfig, "zen.stats")]
    for cls, path in sections:
        docs = _field_docs(cls)
        out.append(f"#### `{path}`\n\n{' '.join(inspect.getdoc(cls).split())}\n")
        out.append("| key | default | meaning |\n| --- | --- | --- |")
        defaults = cls()
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            value = getattr(defaults, f.name)
            shown = "(section)" if dataclasses.is_dataclass(value) else f"`{json.dumps(value)}`"
            out.append(f"| `{f.name}` | {shown} | {docs.get(f.name, '')} |")
        if cls is ZenConfig:  # a row per sparsifier section, described by its sparsifier's docstring
            for s in registered():
                what = " ".join(inspect.getdoc(s.cls).split("\n\n")[0].split()).rstrip(".")
                out.append(f"| `{s.kind}` | (section) | {what} (see the ``zen.{s.kind}`` table). |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown())
