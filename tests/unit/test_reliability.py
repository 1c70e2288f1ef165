"""Reliability, single-process parts: index ranges, the hierarchy decision, resize of the
checkpointed state, and the repository's docs and results naming no machine paths.

Multi-process parts (TP agreement, hosts faked per rank, resize on gloo, fast failure) are in
tests/multiproc/test_reliability_gloo.py.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from zen_ext import SimWorld, SparseGrad, build_scheme
from zen_ext.core.registry import available_schemes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMEL = 37  # odd, not a multiple of any block or partition count


# --- item 2: every scheme checks its indices once, at entry ----------------------------------------------
def _range_text(name: str, bad: int, lo: int, hi: int) -> str:
    return f"scheme {name!r}: grad.indices ({bad}) must lie in [0, {NUMEL}) (indices span [{lo}, {hi}])"


@pytest.mark.parametrize("name", available_schemes())
@pytest.mark.parametrize("bad", [-1, NUMEL, NUMEL + 5])
def test_out_of_range_index_raises_naming_scheme_index_and_range(name, bad):
    """Before the check, omnireduce and sparse_ps dropped such an entry and sparcml wrapped -1 onto the
    last element; now every registered scheme refuses it before any message is sent."""
    scheme = build_scheme(name)
    good = SparseGrad(torch.tensor([0, NUMEL - 1]), torch.tensor([1.0, 2.0]), NUMEL)
    wrong = SparseGrad(torch.tensor([3, bad, 0]), torch.tensor([1.0, 2.0, 3.0]), NUMEL)
    world = SimWorld(2, timeout_s=60)
    with pytest.raises(RuntimeError) as info:
        world.run(lambda c, x: scheme.sync(c, x), [good, wrong])
    cause = info.value.__cause__
    assert isinstance(cause, ValueError), repr(info.value)
    assert str(cause) == _range_text(name, bad, min(bad, 0), max(bad, 3))
    # No rank sent anything: the check runs before the first collective.
    assert [s.bytes_sent for s in world.stats] == [0, 0]


@pytest.mark.parametrize("name", available_schemes())
def test_row_form_out_of_range_row_raises(name):
    scheme = build_scheme(name)
    vals = torch.ones(2, 3)
    wrong = SparseGrad(torch.tensor([1, NUMEL]), vals, NUMEL)
    try:
        with pytest.raises(ValueError) as info:
            scheme.sync(SimWorld(1).communicators()[0], wrong)
    except NotImplementedError:  # pragma: no cover — a scheme without row form
        pytest.skip(f"{name} has no row form")
    assert str(info.value) == _range_text(name, NUMEL, 1, NUMEL)


@pytest.mark.parametrize("name", available_schemes())
@pytest.mark.parametrize("n", [2, 3])
def test_first_and_last_index_equal_dense(name, n):
    """The happy path at the edges: index 0 and ``numel - 1`` on every rank, duplicates, one empty rank."""
    g = torch.Generator().manual_seed(n)
    inputs = []
    for r in range(n):
        idx = torch.tensor([0, NUMEL - 1, NUMEL - 1, r + 1]) if r != 1 else torch.tensor([], dtype=torch.int64)
        vals = torch.randint(-8, 9, (idx.numel(),), generator=g).float()
        inputs.append(SparseGrad(idx, vals, NUMEL))
    want = sum(x.to_dense() for x in inputs)
    for op in ("sum", "mean"):
        scheme = build_scheme(name)
        got = SimWorld(n).run(lambda c, x: scheme.sync(c, x, op=op), inputs)
        for r, out in enumerate(got):
            assert torch.equal(out, want if op == "sum" else want / n), (name, op, r)


def test_synchronizer_paths_produce_only_in_range_indices():
    """DGC and natural indices are built by the Synchronizer itself: with the selected entries at the
    very first and very last element of the bucket (and of each slice), the result equals the dense
    mean of what was sent, so nothing was dropped, wrapped or refused."""
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    # Bucket: emb [4, 3] (natural) at 0, w1 [40] (dgc) at 12, pad 2, w2 [8, 5] (dgc) at 54 → 94.
    slices = [GradSlice("emb", 0, 12, (4, 3)), GradSlice("w1", 12, 40, (40,)), GradSlice("w2", 54, 40, (8, 5))]
    kinds = {"emb": "natural", "w1": "dgc", "w2": "dgc"}
    numel = 94

    def grad(rank):
        flat = torch.zeros(numel)
        flat[0:3] = rank + 1  # the first embedding row
        flat[9:12] = -(rank + 2)  # the last embedding row
        flat[12] = 100.0 + rank  # first element of w1 and of the DGC index space
        flat[numel - 1] = -(200.0 + rank)  # last element of the bucket (last of w2)
        flat[52:54] = 1.0  # padding, reduced dense
        return flat

    for name in available_schemes():
        def body(comm, flat, name=name):
            sync = Synchronizer(dp_comm=comm, scheme=build_scheme(name), param_kinds=kinds,
                                dgc={"enabled": True, "density": 0.05, "min_numel": 1, "threshold": "exact",
                                     "momentum_correction": False, "momentum_masking": False},
                                natural={})
            return sync.sync_flat(flat, slices, op="sum")

        got = SimWorld(2).run(body, [grad(0), grad(1)])
        want = grad(0) + grad(1)  # only the largest entries are non-zero in the DGC slices: all are sent
        for out in got:
            assert torch.equal(out, want), name


# --- item 5: the hierarchy is decided from gathered facts, the same on every rank ----------------------
def test_hierarchy_even_nodes_follow_host_membership():
    from zen_ext.reduction import decide_hierarchy

    # Two hosts of 2, ranks interleaved (a round-robin hostfile): nodes are the hosts, not rank // 2.
    hosts = ["a", "b", "a", "b"]
    layouts, reason = decide_hierarchy("auto", hosts, [range(4)], [0, 0, 1, 1])
    assert layouts == {(0, 1, 2, 3): [[0, 2], [1, 3]]}
    assert reason == "2 nodes of 2 ranks per data-parallel group"
    assert decide_hierarchy(True, hosts, [range(4)])[0] == layouts
    # TP 2 × DP 4 on 2 hosts of 4: each DP group {0,2,4,6}, {1,3,5,7} has 2 ranks per host.
    hosts8 = ["h0"] * 4 + ["h1"] * 4
    layouts, _ = decide_hierarchy("auto", hosts8, [[0, 2, 4, 6], [1, 3, 5, 7]] * 4)
    assert layouts == {(0, 2, 4, 6): [[0, 2], [4, 6]], (1, 3, 5, 7): [[1, 3], [5, 7]]}


def test_hierarchy_uneven_hostfile_falls_back_or_refuses():
    from zen_ext.reduction import decide_hierarchy

    hosts = ["gpu1"] * 4 + ["gpu2"] * 2  # 4 + 2 GPUs
    layouts, reason = decide_hierarchy("auto", hosts, [range(6)], [0, 1, 2, 3, 0, 1])
    assert layouts is None
    assert reason == ("the data-parallel group [0, 1, 2, 3, 4, 5] spans nodes of different sizes "
                      "(gpu1: [0, 1, 2, 3], gpu2: [4, 5])")
    with pytest.raises(NotImplementedError) as info:
        decide_hierarchy(True, hosts, [range(6)])
    assert str(info.value) == (
        "zen.hierarchical (True) supports data-parallel groups spread evenly over several nodes (the same number, "
        "> 1, of ranks on each); the data-parallel group [0, 1, 2, 3, 4, 5] spans nodes of different sizes "
        "(gpu1: [0, 1, 2, 3], gpu2: [4, 5]); use \"auto\" (flat ZEN here) or false")


@pytest.mark.parametrize("hosts, where", [
    (["a", "a", "a", "a"], "a: [0, 1, 2, 3]"),  # a single node
    (["a", "b", "c", "d"], "a: [0], b: [1], c: [2], d: [3]"),  # one rank per node
])
def test_hierarchy_single_node_or_one_rank_per_node_runs_flat(hosts, where):
    from zen_ext.reduction import decide_hierarchy

    reason = f"the data-parallel group [0, 1, 2, 3] does not span several nodes with several ranks each ({where})"
    assert decide_hierarchy("auto", hosts, [range(4)]) == (None, reason)
    with pytest.raises(ValueError) as info:
        decide_hierarchy(True, hosts, [range(4)])
    assert str(info.value) == f'zen.hierarchical (True) must be false or "auto" here: {reason}'
    assert decide_hierarchy(False, ["a", "a", "b", "b"], [range(4)]) == (None, "zen.hierarchical is false")


def test_hierarchy_refuses_hosts_that_do_not_identify_machines():
    from zen_ext.reduction import decide_hierarchy

    # Two machines whose containers share one host name: local rank 0 appears twice on "worker".
    reason = ("ranks 0 and 2 both report host 'worker' with local rank 0, so host names do not identify "
              "machines (set ZEN_EXT_HOST to a per-machine name)")
    assert decide_hierarchy("auto", ["worker"] * 4, [range(4)], [0, 1, 0, 1]) == (None, reason)
    with pytest.raises(ValueError, match="host names do not identify machines"):
        decide_hierarchy(True, ["worker"] * 4, [range(4)], [0, 1, 0, 1])


def test_hierarchy_decision_ignores_each_ranks_own_environment(monkeypatch):
    """What a rank's LOCAL_WORLD_SIZE says plays no part: the same facts give the same layouts."""
    from zen_ext.reduction import decide_hierarchy

    hosts, groups = ["n0", "n0", "n1", "n1"], [range(4)]
    answers = set()
    for local_size in ("4", "2", "1", ""):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_size)
        layouts, reason = decide_hierarchy("auto", hosts, groups)
        answers.add((repr(layouts), reason))
    assert len(answers) == 1


# --- item 8: a resize keeps what the ranks share and restarts only per-rank memory ----------------------
DGC_WARM = {"enabled": True, "density": 0.05, "warmup_steps": 100, "warmup_start_density": 0.25, "min_numel": 1,
            "momentum_correction": True}


def _trained_states(dp: int, steps: int) -> list[dict]:
    """Each rank's Synchronizer state after ``steps`` DGC steps at data-parallel size ``dp``."""
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    slices = [GradSlice("w", 0, 64, (8, 8))]

    def body(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds={"w": "dgc"}, dgc=DGC_WARM)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            sync.sync_flat(torch.randn(64, generator=g), slices, op="mean")
            sync.end_step()
        return sync.state_dict()

    return SimWorld(dp).run(body)


def _fresh_sync(comm):
    from zen_ext.reduction.synchronizer import Synchronizer

    return Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds={"w": "dgc"}, dgc=DGC_WARM)


RESIZE_TEXT = ("zen: the checkpoint was saved with dp_size 2, now 1: restored the step counter (7; DGC warm-up and "
               "sampling continue from it); DGC residuals, momenta and thresholds are per rank and restart from zero")


def test_synchronizer_partial_restore_keeps_step_and_drops_residuals():
    saved = _trained_states(2, 7)
    assert saved[0]["sparsifiers"]["step"] == 7 and saved[0]["sparsifiers"]["params"]["w"]["residual"].abs().sum() > 0
    sync = _fresh_sync(SimWorld(1).communicators()[0])
    sync.load_state_dict(saved[0], per_rank=False)
    assert sync.state.step == 7 and sync.state.params == {}
    assert sync.configs["dgc"].density_at(sync.state.step) < 0.25  # warm-up goes on, it does not restart
    full = _fresh_sync(SimWorld(1).communicators()[0])
    full.load_state_dict(saved[0])
    assert torch.equal(full.state.params["w"]["residual"], saved[0]["sparsifiers"]["params"]["w"]["residual"])


def test_ddp_hook_state_resize_keeps_step_counters(caplog):
    """Before: dp 2 → dp 1 returned early, so the step went 7 → 0 and DGC's warm-up restarted."""
    from zen_ext.config import ZenConfig
    from zen_ext.reduction import BucketReducer
    from zen_ext.engines.ddp import ZenHookState
    from zen_ext.reduction.stats import StepStats

    saved = _trained_states(2, 7)
    sync = _fresh_sync(SimWorld(1).communicators()[0])
    state = ZenHookState(sync=sync, reducer=BucketReducer(sync, cap_bytes=1 << 20, dp_size=1), names={},
                         cfg=ZenConfig(), stats=StepStats(0), rank=0)
    sd = {"sync": saved[0], "step": 7, "dp_size": 2, "rank": 0, "config": ZenConfig().to_dict()}
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.ddp"):
        state.load_state_dict(sd)
    assert state.step == 7 and sync.state.step == 7 and sync.state.params == {}
    assert [r.getMessage() for r in caplog.records if r.name == "zen_ext.engines.ddp"] == [RESIZE_TEXT]


def _stub_attachment(dp_size: int, rank: int, load_dir):
    """A ZenDeepSpeed with only what checkpoint loading uses (no engine: DeepSpeed's own load is a stub)."""
    from zen_ext.engines.deepspeed import ZenDeepSpeed

    z = object.__new__(ZenDeepSpeed)
    z.dp_ranks, z.rank = list(range(dp_size)), rank
    z.sync = _fresh_sync(SimWorld(1).communicators()[0])
    z._orig_load = lambda d, tag=None, *a, **k: (os.path.join(d, str(tag)), {})
    return z


def _save_ds_files(root, dp: int, steps: int):
    from zen_ext.config import ZenConfig

    for r, sd in enumerate(_trained_states(dp, steps)):
        path = os.path.join(root, "global_step7", "zen_ext", f"rank{r:05d}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"sync": sd, "dp_size": dp, "rank": r, "config": ZenConfig().to_dict()}, path)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step7")


def test_deepspeed_resize_shrink_and_grow_keep_the_step(tmp_path, caplog):
    _save_ds_files(str(tmp_path), 2, 7)
    # Shrink to dp 1: rank 0's own file, partially restored.
    z = _stub_attachment(1, 0, tmp_path)
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.deepspeed"):
        z._load_checkpoint(str(tmp_path))
    assert z.sync.state.step == 7 and z.sync.state.params == {}
    assert [r.getMessage() for r in caplog.records if r.name == "zen_ext.engines.deepspeed"] == [RESIZE_TEXT]
    caplog.clear()
    # Grow to dp 4: rank 3 has no file of its own; it still resumes at step 7, from rank 0's file.
    z = _stub_attachment(4, 3, tmp_path)
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.deepspeed"):
        z._load_checkpoint(str(tmp_path), "global_step7")
    assert z.sync.state.step == 7 and z.sync.state.params == {}
    assert [r.getMessage() for r in caplog.records if r.name == "zen_ext.engines.deepspeed"] == [
        "zen: no ZEN state was saved for rank 3, and the checkpoint was saved with dp_size 2, now 4: restored the "
        "step counter (7; DGC warm-up and sampling continue from it); DGC residuals, momenta and thresholds are "
        "per rank and restart from zero"]
    # The same size restores everything, silently.
    caplog.clear()
    z = _stub_attachment(2, 1, tmp_path)
    with caplog.at_level(logging.WARNING, logger="zen_ext.engines.deepspeed"):
        z._load_checkpoint(str(tmp_path))
    assert z.sync.state.step == 7 and z.sync.state.params["w"]["residual"].abs().sum() > 0
    assert not [r for r in caplog.records if r.name == "zen_ext.engines.deepspeed"]


# --- docs and committed results name no machine paths ------------------------------------------------------
CHECKOUT_PATH = re.compile(r"(?<![\w.$])/(?:work|root|home|Users)/[\w.\-/]*")
ANY_ABSOLUTE_IN_RESULTS = re.compile(r"\"(?:/tmp|/work|/root|/home|/Users|/var|/mnt)/[^\"]*\"")


def _text_files(*dirs):
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in sorted(files):
                if f.endswith((".md", ".json", ".jsonl", ".txt", ".csv")):
                    yield os.path.join(base, f)


def test_docs_and_results_name_no_machine_paths():
    """Docs say where things are relative to the repository; results record $WORK/... or repo-relative
    paths (benchmarks/cluster/cluster_common.py ``portable_path``). Example scratch directories in commands
    (``--work /tmp/w``) are the reader's choice, not this machine's, and stay allowed in docs."""
    found = []
    for path in [os.path.join(ROOT, "README.md"), *_text_files("docs", "benchmarks")]:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        rel = os.path.relpath(path, ROOT)
        hits = CHECKOUT_PATH.findall(text) + (ANY_ABSOLUTE_IN_RESULTS.findall(text) if "results" in rel else [])
        hits += [ROOT] if ROOT in text else []
        found += [f"{rel}: {h}" for h in sorted(set(hits))]
    assert not found, "absolute machine paths (use repo-relative paths or $WORK/...):\n" + "\n".join(found[:20])


def test_benchmark_writers_record_portable_paths(monkeypatch):
    import sys

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks", "cluster"))
    sys.modules.pop("cluster_common", None)
    from cluster_common import portable_path

    assert portable_path(os.path.join(ROOT, "benchmarks", "cluster", "configs", "llama-bench.json")) == \
        os.path.join("benchmarks", "cluster", "configs", "llama-bench.json")
    assert portable_path("/scratch/zen/traces/dgc1/step_00000005.pt", "/scratch/zen") == \
        "$WORK/traces/dgc1/step_00000005.pt"
    monkeypatch.delenv("WORK", raising=False)
    assert portable_path("/elsewhere/traces/dgc1/step_00000005.pt") == "dgc1/step_00000005.pt"
