"""docs/extending.md's sparsifier example (docs/examples/nonzero_sparsifier.py), run end to end: a
sparsifier written outside the package, registered with the decorator, configured as ``zen.nonzero``,
routed by ``classify_parameters``, looped over by the Synchronizer next to the built-ins (exact against
a dense all-reduce) and agreed across ranks; tests/multiproc/test_extending_gloo.py runs it in torch DDP."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from zen_ext import SimWorld
from zen_ext.compress import Sparsifier, classify_parameters, register_sparsifier, registered, unregister_sparsifier
from zen_ext.config import ZenConfig
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples" / "nonzero_sparsifier.py"


def load_example():
    """Import the example as a user would import their own module (it registers on import)."""
    if "nonzero_sparsifier" not in sys.modules:
        spec = importlib.util.spec_from_file_location("nonzero_sparsifier", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["nonzero_sparsifier"] = module
        spec.loader.exec_module(module)
    module = sys.modules["nonzero_sparsifier"]
    register_sparsifier(config=module.NonzeroConfig)(module.NonzeroSparsifier)  # again after a teardown
    return module


@pytest.fixture(autouse=True)
def example():
    module = load_example()
    yield module
    unregister_sparsifier("nonzero")  # other test modules never see it


# A bucket: gap | embedding (natural) | mask1 (nonzero) | bias (dense) | w (dgc) | mask2 (nonzero) | gap.
SLICES = [
    GradSlice("emb", 2, 8 * 4, (8, 4)),
    GradSlice("mask1", 34, 60, (6, 10)),
    GradSlice("bias", 94, 7, (7,)),
    GradSlice("w", 101, 200, (10, 20)),
    GradSlice("mask2", 301, 45, (45,)),
]
NUMEL = 350
KINDS = {"emb": "natural", "mask1": "nonzero", "bias": "dense", "w": "dense", "mask2": "nonzero"}


def inputs(n, seed, empty_rank=None):
    """Integer-valued buckets: sparse masks with index 0 and the last of each slice on rank 0."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        x = torch.randint(-9, 10, (NUMEL,), generator=gen).float()
        for s in SLICES:
            if KINDS[s.name] in ("nonzero", "natural"):
                keep = torch.rand(s.numel, generator=gen) < 0.1
                if r == 0:
                    keep[0] = keep[-1] = True
                x[s.offset : s.offset + s.numel] *= keep
        if r == empty_rank:
            x.zero_()
        out.append(x)
    return out


def sync_all(n, xs, op, kinds=KINDS, dgc=None, nonzero=None):
    nonzero = nonzero or {"enabled": True, "params": ["mask"]}

    def fn(comm, x):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=kinds, natural={}, dgc=dgc,
                            sections={"nonzero": nonzero})
        out = sync.sync_flat(x.clone(), SLICES, op=op)
        return out, sync.pop_step_stats()

    return SimWorld(n).run(fn, xs)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_outside_sparsifier_in_the_synchronizer_equals_dense(n, op):
    xs = inputs(n, seed=n, empty_rank=1 if n > 1 else None)
    want = sum(xs) / n if op == "mean" else sum(xs)
    for r, (out, stats) in enumerate(sync_all(n, xs, op)):
        assert torch.equal(out, want)
        # Its own line in the stats: 105 elements, of which this rank's non-zeros were sent.
        assert stats["numel"]["nonzero"] == 105
        sent = int(torch.cat([xs[r][34:94], xs[r][301:346]]).count_nonzero())
        assert stats["nnz"]["nonzero"] == sent and sent < 105
        assert sent > 0 or r == 1  # rank 1 is empty
        assert stats["slice_schemes"]["mask1:nonzero"] == "zen"  # one key for the fused group


def test_outside_sparsifier_next_to_dgc():
    """With DGC on a matrix of the same bucket, the outside kind and the dense parts stay exact."""
    n = 3
    xs = inputs(n, seed=7)
    kinds = dict(KINDS, w="dgc")
    dgc = {"enabled": True, "density": 0.1, "momentum_correction": False}
    want = sum(xs)
    for out, stats in sync_all(n, xs, "sum", kinds=kinds, dgc=dgc):
        exact = torch.ones(NUMEL, dtype=torch.bool)
        exact[101:301] = False  # DGC's slice: lossy by design
        assert torch.equal(out[exact], want[exact])
        assert stats["numel"]["dgc"] == 200 and stats["numel"]["nonzero"] == 105


def test_classification_gives_claimed_parameters_to_the_outside_kind_first():
    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(50, 8),
        "mask_proj": torch.nn.Linear(64, 64),
        "proj": torch.nn.Linear(64, 64),
    })
    sections = {"nonzero": {"enabled": True, "params": [r"^mask_"]}}
    kinds = classify_parameters(model, natural={}, dgc={"enabled": True, "min_numel": 16}, sections=sections)
    assert kinds == {"embed.weight": "natural", "mask_proj.weight": "nonzero", "mask_proj.bias": "nonzero",
                     "proj.weight": "dgc", "proj.bias": "dense"}
    off = classify_parameters(model, natural={}, dgc={"enabled": True, "min_numel": 16},
                              sections={"nonzero": {"enabled": False, "params": [r"^mask_"]}})
    assert off["mask_proj.weight"] == "dgc"
    with pytest.raises(ValueError, match=r"sections \(\['nothing'\]\) must be registered sparsifier kinds"):
        classify_parameters(model, natural={}, dgc=None, sections={"nothing": {}})


def test_config_section_parses_round_trips_and_validates():
    cfg = ZenConfig.from_dict({"nonzero": {"enabled": True, "params": ["mask"]}})
    assert cfg.sections()["nonzero"].params == ["mask"]
    assert cfg.to_dict()["nonzero"] == {"enabled": True, "params": ["mask"]}
    assert ZenConfig.from_dict(cfg.to_dict()) == cfg
    assert "sparsifier_sections" not in cfg.to_dict()
    with pytest.raises(TypeError, match=r"zen.nonzero.params \(3\) must be a list of regular expressions"):
        ZenConfig.from_dict({"nonzero": {"params": 3}})
    with pytest.raises(ValueError, match=r"zen.nonzero.params \('\('\) must be a regular expression"):
        ZenConfig.from_dict({"nonzero": {"params": ["("]}})
    with pytest.raises(ValueError, match=r"nonzero"):  # the valid keys listed include the outside kind
        ZenConfig.from_dict({"nonzer": {}})
    with pytest.raises(ValueError, match=r"sparsifier_sections"):  # internal, not a JSON key
        ZenConfig.from_dict({"sparsifier_sections": {}})
    # Built in code, the sections are parsed and checked as well.
    assert ZenConfig(sparsifier_sections={"nonzero": {"enabled": True}}).sections()["nonzero"].enabled
    with pytest.raises(ValueError, match=r"sparsifier kind \('nothing'\) must be one of"):
        ZenConfig(sparsifier_sections={"nothing": {}})


def test_ranks_that_configure_the_outside_kind_differently_raise():
    def fn(comm):
        nonzero = {"enabled": True, "params": ["mask"] if comm.rank == 0 else ["mask", "x"]}
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=KINDS, natural={},
                            sections={"nonzero": nonzero})
        return sync.sync_flat(torch.zeros(NUMEL), SLICES)

    with pytest.raises(RuntimeError, match=r"data-parallel ranks disagree on the bucket's nonzero"):
        SimWorld(2).run(fn)


def test_registry_rules(example):
    assert [s.kind for s in registered()][:1] == ["nonzero"]  # priority 0: before natural and dgc

    class NoKind(Sparsifier):
        def compress(self, grads, tp_comm=None):
            raise NotImplementedError

    with pytest.raises(ValueError, match=r"kind \(None\) must be an identifier other than 'dense'"):
        register_sparsifier(config=example.NonzeroConfig)(NoKind)
    NoKind.kind = "dense"
    with pytest.raises(ValueError, match=r"kind \('dense'\) must be an identifier"):
        register_sparsifier(config=example.NonzeroConfig)(NoKind)
    NoKind.kind = "dgc"
    with pytest.raises(ValueError, match=r"sparsifier kind \('dgc'\) must be unique: DGCSparsifier already has it"):
        register_sparsifier(config=example.NonzeroConfig)(NoKind)
    NoKind.kind, NoKind.bucket_mode = "other", "rows"
    with pytest.raises(ValueError, match=r"bucket_mode \('rows'\) must be one of \['per_slice', 'fused'\]"):
        register_sparsifier(config=example.NonzeroConfig)(NoKind)
    NoKind.bucket_mode = "fused"
    with pytest.raises(TypeError, match=r"must be a dataclass with a bool field 'enabled'"):
        register_sparsifier(config=dict)(NoKind)
    with pytest.raises(TypeError, match=r"must decorate a Sparsifier subclass"):
        register_sparsifier(config=example.NonzeroConfig)(object)
    with pytest.raises(ValueError, match=r"must not be a built-in"):
        unregister_sparsifier("dgc")
    assert "other" not in [s.kind for s in registered()]


def test_resuming_with_another_section_warns_per_kind(caplog):
    def build(comm, params, density=0.05):
        return Synchronizer(dp_comm=comm, scheme="zen", param_kinds=KINDS, natural={},
                            dgc={"enabled": True, "density": density},
                            sections={"nonzero": {"enabled": True, "params": params}})

    def fn(comm):
        sd = build(comm, ["mask"]).state_dict()
        with caplog.at_level("WARNING", logger="zen_ext.reduction.synchronizer"):
            build(comm, ["mask"]).load_state_dict(sd)
            quiet = len(caplog.records)
            build(comm, ["mask", "x"], density=0.1).load_state_dict(sd)
        return quiet, sorted(r.getMessage().split(":")[1] for r in caplog.records)

    quiet, warned = SimWorld(1).run(fn)[0]
    assert quiet == 0
    assert warned == [" resuming with a different dgc config", " resuming with a different nonzero config"]


def test_a_field_only_one_rank_has_is_a_difference_on_both_ranks():
    """A sparsifier registered on one rank only (its module imported there): both ranks must raise, not
    only the one that has the extra field, or the other would go on to a collective and wait."""
    from zen_ext.reduction.plan import _first_difference

    with_it = {"op": "sum", "nonzero": {"enabled": False, "params": []}}
    without = {"op": "sum"}
    gathered = [with_it, without]
    for me, mine in enumerate(gathered):
        problem = _first_difference(gathered, mine, "data-parallel", me, "same config")
        assert problem is not None and "bucket's nonzero" in problem, (me, problem)
    assert _first_difference([without, without], without, "data-parallel", 0, "same config") is None
