"""docs/extending.md's worked example, run: a scheme written outside the package, registered with the
decorator and a cost model, used by name and picked by ``auto``, exact against dense."""

from __future__ import annotations

import logging

import pytest
import torch

from zen_ext import SimWorld, build_scheme
from zen_ext.planner import cost_model as cm
from zen_ext.analysis import workloads as W
from zen_ext.core.scheme import _REGISTRY, SyncScheme, register_scheme
from zen_ext.core.types import as_dense


# --- the example of docs/extending.md, "Add a scheme" (kept in step with the document; the decorator
# and the cost-model registration run in the ``registered`` fixture, so that other test modules never
# see the toy scheme among auto's candidates) -----------------------------------------------------------
class GatherDenseScheme(SyncScheme):
    """Every rank all-gathers every rank's dense gradient and sums locally (lossless, and slow)."""

    name = "gather_dense"

    def _sync(self, comm, grad, op="sum", timings=None, key=None, out=None):
        mine = as_dense(grad)
        total = torch.zeros_like(mine)
        for part in comm.all_gather_v(mine):  # rank order: every rank sums in the same order
            total += part
        return total.div_(comm.size) if op == "mean" else total


def _gather_dense_traffic(profile, options):
    tr = cm._Traffic(profile.n)
    tr.all_gather_v([profile.numel * profile.row_width * profile.value_bytes] * profile.n)
    return tr


def _gather_dense_work(w, options):
    return {"comm_s": {"fill_s_per_byte": w.n * w.numel * w.row_width * w.value_bytes}}


# ------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def registered():
    register_scheme(GatherDenseScheme)
    cm.register_cost_model("gather_dense", traffic=_gather_dense_traffic, work=_gather_dense_work,
                           wire_phases=("comm_s",))
    yield
    _REGISTRY.pop("gather_dense", None)
    cm.COST_MODELS.pop("gather_dense", None)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_outside_scheme_by_name_equals_dense(n, op):
    inputs = W.zipf_embedding(n, row_width=4)
    got = SimWorld(n).run(lambda c, x: build_scheme("gather_dense").sync(c, x, op=op), inputs)
    want = SimWorld(n).run(lambda c, x: build_scheme("dense").sync(c, as_dense(x).clone(), op=op), inputs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_auto_considers_an_outside_scheme_and_picks_it_when_its_model_says_it_is_fastest(monkeypatch):
    from zen_ext.planner.auto import AutoScheme

    assert "gather_dense" in AutoScheme.valid_candidates()
    # A model that claims no cost at all: auto must pick the scheme, and the result stays exact.
    monkeypatch.setitem(cm.COST_MODELS, "gather_dense", cm.SchemeCostModel(
        traffic=lambda p, o: cm._Traffic(p.n), work=lambda w, o: {}, wire_phases=("comm_s",)))
    n = 4
    inputs = W.zipf_embedding(n, row_width=4)
    autos = [build_scheme("auto", bandwidth_gbps=1.0, latency_us=50.0, model="alpha_beta") for _ in range(n)]
    got = SimWorld(n).run(lambda c, x: autos[c.rank].sync(c, x, key="g"), inputs)
    assert autos[0].last_choice("g")[0] == "gather_dense"
    expected = sum(x.to_dense() for x in inputs)
    for g in got:
        assert torch.equal(g, expected)


def test_a_lossless_scheme_without_cost_model_is_skipped_with_a_reason(monkeypatch, caplog):
    from zen_ext.planner import auto as planner

    class NoModel(GatherDenseScheme):
        name = "gather_dense_unmodelled"

    register_scheme(NoModel)
    try:
        with caplog.at_level(logging.INFO, logger="zen_ext.planner"):
            valid = planner.AutoScheme.valid_candidates()
        assert "gather_dense_unmodelled" not in valid and "gather_dense" in valid
        assert any("'gather_dense_unmodelled' has no cost model" in r.getMessage() for r in caplog.records)
    finally:
        _REGISTRY.pop("gather_dense_unmodelled", None)


def test_register_cost_model_errors():
    with pytest.raises(ValueError, match="wire_phases must name at least one phase"):
        cm.register_cost_model("x", traffic=_gather_dense_traffic, work=_gather_dense_work, wire_phases=())
    with pytest.raises(ValueError, match="traffic and work must be callables"):
        cm.register_cost_model("x", traffic=None, work=_gather_dense_work, wire_phases=("comm_s",))
    assert "x" not in cm.COST_MODELS

