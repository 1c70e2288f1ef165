"""docs/extending.md's worked example, run: a scheme written outside the package, with its cost model
on its class, registered with the decorator, used by name and picked by ``auto``, exact against dense."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from zen_ext import SimWorld, build_scheme
from zen_ext.analysis import workloads as W
from zen_ext.core.cost import Traffic
from zen_ext.core.registry import register_scheme, unregister_scheme
from zen_ext.core.scheme import SyncScheme
from zen_ext.core.types import as_dense

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                   "extending.md")


def doc_example() -> dict:
    """Run the code block of docs/extending.md's "Add a scheme" as a user's module: its names (the
    ``@register_scheme`` decorator registers ``gather_dense`` as it runs)."""
    text = open(DOC).read()
    section = text[text.index("## Add a scheme"):text.index("## Add a sparsifier")]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    names: dict = {"__name__": "gather_dense_example"}
    exec(compile(code, DOC, "exec"), names)
    return names


@pytest.fixture(autouse=True)
def gather_dense():
    """The document's scheme, registered for one test only, so that other test modules never see the
    toy scheme among auto's candidates."""
    yield doc_example()["GatherDenseScheme"]
    unregister_scheme("gather_dense")


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_outside_scheme_by_name_equals_dense(n, op):
    inputs = W.zipf_embedding(n, row_width=4)
    got = SimWorld(n).run(lambda c, x: build_scheme("gather_dense").sync(c, x, op=op), inputs)
    want = SimWorld(n).run(lambda c, x: build_scheme("dense").sync(c, as_dense(x).clone(), op=op), inputs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_auto_considers_an_outside_scheme_and_picks_it_when_its_model_says_it_is_fastest(monkeypatch, gather_dense):
    from zen_ext.planner.auto import AutoScheme

    assert "gather_dense" in AutoScheme.valid_candidates()
    # A model that claims no cost at all: auto must pick the scheme, and the result stays exact.
    monkeypatch.setattr(gather_dense, "predict_traffic", staticmethod(lambda p, o: Traffic(p.n)))
    monkeypatch.setattr(gather_dense, "predict_work", staticmethod(lambda w, o: {}))
    n = 4
    inputs = W.zipf_embedding(n, row_width=4)
    autos = [build_scheme("auto", bandwidth_gbps=1.0, latency_us=50.0, model="alpha_beta") for _ in range(n)]
    got = SimWorld(n).run(lambda c, x: autos[c.rank].sync(c, x, key="g"), inputs)
    assert autos[0].last_choice("g")[0] == "gather_dense"
    expected = sum(x.to_dense() for x in inputs)
    for g in got:
        assert torch.equal(g, expected)


def test_a_lossless_scheme_without_cost_model_is_skipped_with_a_reason(caplog, gather_dense):
    from zen_ext.planner.auto import AutoScheme

    class NoModel(gather_dense):
        name = "gather_dense_unmodelled"
        wire_phases = ()

    register_scheme(NoModel)
    try:
        with caplog.at_level(logging.INFO, logger="zen_ext.planner"):
            valid = AutoScheme.valid_candidates()
        assert "gather_dense_unmodelled" not in valid and "gather_dense" in valid
        assert any("'gather_dense_unmodelled' has no cost model" in r.getMessage() for r in caplog.records)
    finally:
        unregister_scheme("gather_dense_unmodelled")


def test_a_half_declared_cost_model_is_refused():
    class WirePhasesOnly(SyncScheme):
        name = "wire_phases_only"
        wire_phases = ("comm_s",)

        def _sync(self, comm, grad, op="sum", timings=None, key=None, out=None):
            return as_dense(grad)

    with pytest.raises(ValueError, match=r"scheme 'wire_phases_only' declares wire_phases \('comm_s',\) but not "
                                         r"\['predict_traffic', 'predict_work'\]"):
        register_scheme(WirePhasesOnly)
    with pytest.raises(ValueError, match=r"zen.scheme \('wire_phases_only'\) must be one of"):
        build_scheme("wire_phases_only")


def test_a_taken_name_is_refused(gather_dense):
    class Impostor(gather_dense):
        name = "zen"

    with pytest.raises(ValueError, match="scheme name 'zen' is already registered by ZenScheme"):
        register_scheme(Impostor)



def test_a_builtin_scheme_is_named_only_by_its_own_file():
    """Adding a built-in scheme touches its own file, the registry's list and its tests: no other module
    of zen_ext names it (the planner, the simulator and the metrics find schemes through the registry).
    ``zen`` and ``dense`` are left out: they are also the config section, the default scheme and the
    routing kind of dense parameters."""
    import inspect

    from zen_ext.core.registry import BUILTIN_SCHEMES

    root = os.path.dirname(os.path.dirname(os.path.abspath(inspect.getsourcefile(SyncScheme))))
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")]
    named = []
    for cls in BUILTIN_SCHEMES:
        if cls.name in ("zen", "dense"):
            continue
        own = os.path.abspath(inspect.getsourcefile(cls))
        named += [f"{os.path.relpath(f, root)} names {cls.name!r}" for f in files
                  if os.path.abspath(f) != own and f'"{cls.name}"' in open(f).read()]
    assert len(BUILTIN_SCHEMES) == 8 and not named, named
