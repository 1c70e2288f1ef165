"""The generic layers name no sparsifier kind: what differs between kinds they ask of the sparsifier's
hooks (``label``, ``resolve_defaults``, ``row_sparse``, ``once_per_step``) and of the registry (one
``zen.<kind>`` section each). A sparsifier registered from outside gets every one of them; the DGC
options that were removed are refused with the reason."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from dataclasses import dataclass

import pytest
import torch

from zen_ext import SimWorld
from zen_ext.compress import DGCSparsifier, NaturalSparsifier, Sparsifier, register_sparsifier, registered
from zen_ext.compress import unregister_sparsifier
from zen_ext.compress.dgc.config import RETIRED_KEYS
from zen_ext.core.types import SparseGrad
from zen_ext.config import ZenConfig
from zen_ext.reduction.plan import GradSlice
from zen_ext.reduction.reducer import BucketReducer
from zen_ext.reduction.stats import startup_line
from zen_ext.reduction.synchronizer import Synchronizer

PKG = pathlib.Path(__file__).resolve().parents[2] / "zen_ext"
GENERIC = [*sorted((PKG / "reduction").glob("*.py")), *sorted((PKG / "engines").glob("*.py")), PKG / "config.py",
           PKG / "config_reference.py", PKG / "optim.py"]


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and of its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_generic_layers_name_no_kind_in_code():
    """No string, attribute, name or keyword in the code of the generic layers is a built-in kind
    (docstrings may show a ``"zen": {"dgc": ...}`` example)."""
    kinds = {s.kind for s in registered()}
    assert {"natural", "dgc"} <= kinds
    found = []
    for path in GENERIC:
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                names = [w.strip(" ={}:") for w in node.value.split()]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.keyword):
                names = [node.arg]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            hit = sorted(kinds & set(names))
            if hit:
                found.append(f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', '?')} {hit}")
    assert not found, found


# --- an outside sparsifier that uses every hook ------------------------------------------------------
@dataclass(frozen=True)
class RowsConfig:
    enabled: bool = False
    width: int | None = None  # null until resolve_defaults decides it


class RowsSparsifier(Sparsifier):
    """The non-zero rows of matrices named ``rows*`` (lossless; a stand-in for natural sparsity)."""

    kind = "rows"
    lossless = True
    bucket_mode = "per_slice"
    row_sparse = True
    once_per_step = True

    def __init__(self, config) -> None:
        self.config = config

    @classmethod
    def label(cls, config) -> str:
        return f"rows w{config.width}"

    @classmethod
    def resolve_defaults(cls, config, optimizer, *, quiet=False):
        if config.width is not None:
            return config, ""
        width = 0 if optimizer is None else len(optimizer.param_groups)
        return dataclasses.replace(config, width=width), f"width={width} (chosen)"

    @classmethod
    def claims(cls, param, config) -> bool:
        return param.name.startswith("rows") and param.dim == 2

    def compress(self, grads, tp_comm=None) -> SparseGrad:
        g = grads[0].grad.reshape(grads[0].grad.shape[0], -1)
        idx = g.ne(0).any(1).nonzero().flatten()
        return SparseGrad(idx, g.index_select(0, idx), g.shape[0], in_range=True)


@pytest.fixture
def rows():
    register_sparsifier(config=RowsConfig, priority=50)(RowsSparsifier)
    yield RowsSparsifier
    unregister_sparsifier("rows")


def test_config_holds_the_outside_section_and_resolves_its_defaults(rows):
    cfg = ZenConfig.from_dict({"rows": {"enabled": True}})
    assert cfg.rows is cfg.section("rows") and cfg.rows.width is None
    assert list(cfg.sections()) == ["rows", "natural"]  # by priority; dgc is off
    assert cfg.sections_line() == "rows=on natural=on dgc=off"
    out, note = cfg.resolve_defaults(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert out.rows.width == 1 and note == "rows width=1 (chosen)" and cfg.rows.width is None  # a copy
    kinds = {"rows0": "rows", "emb": "natural", "b": "dense"}
    line = startup_line("an engine", out, kinds, {"rows0": 8, "emb": 4, "b": 2}, note)
    assert line == ("zen_ext: ZEN on an engine: scheme=zen, buckets 128 MB | rows w1: 1 tensor (8 elements), "
                    "natural: 1 tensor (4 elements), dense: 1 tensor (2 elements) | rows width=1 (chosen)")
    assert ZenConfig.from_dict(out.to_dict()) == out


def test_row_sparse_kind_gets_its_densification_stat(rows):
    """γ (``gamma_<kind>``): the union of non-zero rows after the sync over one rank's, for any row_sparse
    kind; exact against the dense sum."""
    slices = [GradSlice("rows0", 0, 6 * 3, (6, 3)), GradSlice("b", 18, 4, (4,))]
    xs = [torch.zeros(22), torch.zeros(22)]
    xs[0][0:3] = 1.0  # rank 0: row 0
    xs[1][0:3], xs[1][9:12] = 2.0, 3.0  # rank 1: rows 0 and 3
    xs[0][18:], xs[1][18:] = 1.0, 5.0

    def fn(comm, x):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds={"rows0": "rows", "b": "dense"},
                            sections={"rows": {"enabled": True}})
        assert sync.row_kinds == frozenset({"rows"})
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=comm.size)
        y = x.clone()
        red.reduce_(y, slices, "sum")
        return y, red.pop_stats()

    (y0, rec0), (y1, rec1) = SimWorld(2).run(fn, xs)
    assert torch.equal(y0, xs[0] + xs[1]) and torch.equal(y1, xs[0] + xs[1])
    assert rec0["gamma_rows"] == 2.0 and rec1["gamma_rows"] == 1.0  # 2 rows after; 1 and 2 before
    assert "gamma_natural" not in rec0


def test_builtin_hooks():
    assert DGCSparsifier.once_per_step and not DGCSparsifier.row_sparse
    assert NaturalSparsifier.row_sparse and not NaturalSparsifier.once_per_step
    dgc = ZenConfig.from_dict({"dgc": {"enabled": True, "density": 0.01}}).dgc
    assert DGCSparsifier.label(dgc) == "dgc 0.01" and NaturalSparsifier.label(None) == "natural"
    with pytest.raises(AttributeError):
        ZenConfig().no_such_kind  # noqa: B018


# --- removed options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, why", [
    ("feedback", "ef21", 'EF21 \\("ef21"\\) measured far worse than error feedback, the one kept'),
    ("feedback", "ef", 'EF21 \\("ef21"\\) measured far worse'),  # the key itself is gone
    ("normalize_beta", 0.95, "measured worse than off"),
    ("selection_chunk", 256, "measured no better than one threshold per tensor"),
    ("dense_from_step", 160, "a dense tail measured worse than a uniform density of the same traffic"),
])
def test_a_removed_dgc_key_is_refused_with_the_reason(key, value, why):
    assert key in RETIRED_KEYS
    text = rf"zen.dgc.{key} was removed \({why}.*: docs/results/dgc_history.md\); remove the key"
    with pytest.raises(ValueError, match=text):
        ZenConfig.from_dict({"dgc": {"enabled": True, key: value}})
    with pytest.raises(ValueError, match=text):
        ZenConfig.from_ds_config({"zen": {"dgc": {key: value}}})
    with pytest.raises(TypeError):  # no such field in code either
        from zen_ext.compress import DGCConfig

        DGCConfig(**{key: value})


def test_the_removed_optimizer_is_gone():
    import zen_ext.optim as optim

    assert [n for n in dir(optim) if "Frozen" in n] == []
    assert (PKG.parent / "docs" / "results" / "dgc_history.md").is_file()
