"""zen.outer in SimWorld: the outer sum is a lossless sum of the picks, the error feedback conserves every
value, replicas stay bitwise equal, density 1 is DiLoCo and the sparse form is SparseLoCo (direct
references written here), checkpoints resume bitwise, config errors read as documented."""

from __future__ import annotations

import copy

import pytest
import torch

from zen_ext.comm.simulated import SimWorld
from zen_ext.config import ZenConfig
from zen_ext.outer import OuterConfig, OuterSync, state_bytes_per_param

# Sizes around a 64-element chunk: full chunks, a tail, a parameter smaller than a chunk, index 0 and last.
SHAPES = [(5, 30), (64,), (3,), (7, 11)]
SMALL = dict(enabled=True, every=2, density=4 / 64, chunk=64)


def _named(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.nn.Parameter(torch.randint(-64, 65, s, generator=g).to(dtype) / 8))
            for i, s in enumerate(SHAPES)]


def _update(rank: int, rnd: int, shape, scale: float = 1.0, ints: bool = True) -> torch.Tensor:
    """A replica's inner-training movement in round ``rnd``: integers (or wide dyadics), seeded per rank."""
    g = torch.Generator().manual_seed(1000 * rnd + 17 * rank + 1)
    if ints:
        return torch.randint(-9, 10, shape, generator=g).float() * scale
    return torch.randint(-2**20, 2**20, shape, generator=g).float() / 2**10


class _Recording(OuterSync):
    """OuterSync that keeps each bucket's picks and sums (to compare with a dense sum of the picks)."""

    def __init__(self, *a, **k):
        self.log = []
        super().__init__(*a, **k)

    def _sparse_sum(self, i, b, idx_K, val_K):
        before = b.err_N.clone()
        out = super()._sparse_sum(i, b, idx_K, val_K)
        self.log.append((i, idx_K.clone(), val_K.clone(), out[0].clone(),
                         None if out[1] is None else out[1].clone(), before))
        return out


def _run_rounds(world: SimWorld, cfg: dict, rounds: int, scheme: str = "zen", ints: bool = True, cls=OuterSync,
                cap_mb: float = 1e-3):
    """Every replica: ``rounds`` outer rounds, each moving its parameters by ``_update`` then an outer step.
    Returns per rank: the OuterSync and the parameters after each round."""

    def body(comm):
        named = _named(0)
        outer = cls(named, comm, cfg, scheme=scheme, bucket_cap_mb=cap_mb)
        after = []
        for rnd in range(rounds):
            with torch.no_grad():
                for _, p in named:
                    p.sub_(_update(comm.rank, rnd, p.shape, ints=ints))
            assert outer.maybe_step((rnd + 1) * outer.cfg.every)
            after.append(torch.cat([p.detach().reshape(-1).clone() for _, p in named]))
        return outer, after

    return world.run(body)


# --- lossless sum, error feedback, equal replicas ---------------------------------------------------------
@pytest.mark.parametrize("scheme", ["zen", "agsparse", "sparcml", "auto"])
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("average", ["contributors", "mean"])
def test_outer_average_equals_dense_sum_of_picks_averaged(scheme, n, average):
    cfg = dict(SMALL, average=average, error_decay=0.5)
    res = _run_rounds(SimWorld(n), cfg, rounds=3, scheme=scheme, cls=_Recording)
    logs = [o.log for o, _ in res]
    assert len(logs[0]) == 3 * len(res[0][0].buckets) > 3  # several buckets
    for entries in zip(*logs):
        numel = entries[0][3].numel()
        dense = torch.zeros(numel)
        count = torch.zeros(numel)
        for _, idx, val, _, _, _ in entries:
            assert idx.unique().numel() == idx.numel()  # distinct picks
            dense.index_add_(0, idx, val)
            count.index_add_(0, idx, torch.ones_like(val))
        # exact: integer-valued picks, one correctly rounded division each
        expect = dense / count.clamp(min=1) if average == "contributors" else dense / n
        counted = average == "contributors" and scheme == "zen"  # ZEN's owners count; others send rows
        assert res[0][0].form == ("counted" if counted else "rows" if average == "contributors" else "mean")
        for _, _, _, got, got_union, _ in entries:
            assert torch.equal(got, expect)
            if average == "mean":
                assert got_union is None
            else:  # rows: the senders counted; counted: the non-zero averages
                assert int(got_union) == int((expect.ne(0) if counted else count.gt(0)).sum())


def test_error_feedback_conserves_every_value():
    cfg = dict(SMALL, error_decay=0.5)
    res = _run_rounds(SimWorld(3), cfg, rounds=3, cls=_Recording)
    for outer, _ in res:
        by_bucket = {}
        for i, idx, val, _, _, before in outer.log:
            by_bucket.setdefault(i, []).append((idx, val, before))
        for i, rounds in by_bucket.items():
            for r, (idx, val, e_after_ef) in enumerate(rounds):
                # e_after_ef is e after e ← βe + Δ and the picks' removal; the picks were e's values there.
                sent = torch.zeros_like(e_after_ef)
                sent[idx] = val
                assert torch.all(e_after_ef[idx] == 0)
                k = outer.buckets[i].picks
                assert idx.numel() == k
                # every picked |value| >= every kept |value| of its chunk
                chunk = outer.cfg.chunk
                for c0 in range(0, e_after_ef.numel(), chunk):
                    in_c = (idx >= c0) & (idx < c0 + chunk)
                    if in_c.any():
                        assert val[in_c].abs().min() >= e_after_ef[c0:c0 + chunk].abs().max()


def test_error_feedback_conservation_exact():
    """sent + e_after == β·e_before + Δ, bitwise, on one bucket driven by hand."""
    from zen_ext.outer.select import select_

    cfg = OuterConfig(**SMALL, error_decay=0.5)
    g = torch.Generator().manual_seed(3)
    e = torch.randint(-50, 50, (300,), generator=g).float() / 4
    delta = torch.randint(-50, 50, (300,), generator=g).float() / 4
    expect = e * 0.5 + delta
    work = e.clone().mul_(0.5).add_(delta)
    idx, val = select_(work, cfg)
    sent = torch.zeros(300)
    sent[idx] = val
    assert torch.equal(sent + work, expect)
    assert idx.numel() == 4 * 4 + 3  # 4 full chunks of 64 (k 4) and a 44-element tail (k round(2.75) = 3)
    assert {0, 299} <= set(range(300)) and torch.all(work[idx] == 0)


@pytest.mark.parametrize("scheme, state_device", [("zen", "cpu"), ("agsparse", "cpu"), ("auto", "cpu"),
                                                  ("zen", "device")])
@pytest.mark.parametrize("n", [3, 4])
def test_replicas_bitwise_equal_after_each_outer_step(scheme, state_device, n):
    cfg = dict(SMALL, lr=0.7, momentum=0.9, nesterov=True, error_decay=0.95, state_device=state_device)
    res = _run_rounds(SimWorld(n), cfg, rounds=3, scheme=scheme, ints=False)
    for rnd in range(3):
        ref = res[0][1][rnd]
        for _, after in res[1:]:
            assert torch.equal(after[rnd], ref)
    # and the state every replica holds for θ_global is the parameters
    for outer, after in res:
        assert torch.equal(torch.cat([b.theta_N for b in outer.buckets]), after[-1])


# --- the papers' algorithms, written directly ---------------------------------------------------------------
def _flat0():
    return torch.cat([p.detach().reshape(-1) for _, p in _named(0)])


def test_density_1_is_dense_diloco():
    """Dense DiLoCo (torchft's outer step): Δ averaged over replicas, torch.optim.SGD(lr 0.7, momentum 0.9,
    Nesterov) on θ_global. SimWorld's all-reduce sums in rank order, as the reference does: bitwise."""
    n, rounds = 3, 4
    cfg = dict(enabled=True, every=5, density=1, lr=0.7, momentum=0.9, nesterov=True)
    res = _run_rounds(SimWorld(n), cfg, rounds=rounds, ints=False)
    theta = torch.nn.Parameter(_flat0())
    opt = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    sizes = [torch.Size(s) for s in SHAPES]
    for rnd in range(rounds):
        deltas = []
        for r in range(n):
            local = theta.detach() - torch.cat([_update(r, rnd, s, ints=False).reshape(-1) for s in sizes])
            deltas.append(theta.detach() - local)
        acc = deltas[0].clone()
        for d in deltas[1:]:
            acc += d
        theta.grad = acc / n
        opt.step()
        for _, after in res:
            assert torch.equal(after[rnd], theta.detach()), rnd
    assert all(b.err_N is None for b in res[0][0].buckets)  # dense: no error feedback kept


def _sparseloco_reference(n: int, rounds: int, beta: float, k: int, chunk: int, ints: bool):
    """SparseLoCo without its 2-bit values: per replica e ← β·e + Δ, top-k |e| per chunk of the flat
    vector, picks leave e, all-gather, each index averaged over the replicas that picked it
    (``scatter_reduce_(reduce="mean", include_self=False)``), outer SGD lr 1 without momentum."""
    theta = _flat0()
    numel = theta.numel()
    errs = [torch.zeros(numel) for _ in range(n)]
    sizes = [torch.Size(s) for s in SHAPES]
    out = []
    for rnd in range(rounds):
        gathered_idx, gathered_val = [], []
        for r in range(n):
            local = theta - torch.cat([_update(r, rnd, s, ints=ints).reshape(-1) for s in sizes])
            errs[r] = errs[r] * beta + (theta - local)
            for c0 in range(0, numel, chunk):
                c = errs[r][c0:c0 + chunk]
                kk = min(c.numel(), max(1, round(k / chunk * c.numel())))
                top = c.abs().topk(kk).indices + c0
                gathered_idx.append(top)
                gathered_val.append(errs[r][top].clone())
                errs[r][top] = 0
        avg = torch.zeros(numel).scatter_reduce_(0, torch.cat(gathered_idx), torch.cat(gathered_val), "mean",
                                                 include_self=False)
        theta = theta - 1.0 * avg
        out.append(theta.clone())
    return out


@pytest.mark.parametrize("scheme", ["zen", "agsparse"])
def test_sparseloco_reference_bitwise_at_two_replicas(scheme):
    """R = 2: every sum has two terms (commutative in floats), so the scheme's sum order cannot matter:
    SparseLoCo's defaults (β 0.95, lr 1, no momentum, contributors) on float updates, bitwise. One bucket:
    the reference chunks the whole flat vector."""
    cfg = dict(enabled=True, every=3, density=4 / 64, chunk=64, error_decay=0.95)
    res = _run_rounds(SimWorld(2), cfg, rounds=4, scheme=scheme, ints=False, cap_mb=1.0)
    ref = _sparseloco_reference(2, 4, 0.95, 4, 64, ints=False)
    for rnd in range(4):
        for _, after in res:
            assert torch.equal(after[rnd], ref[rnd]), rnd


@pytest.mark.parametrize("scheme", ["zen", "agsparse"])
def test_sparseloco_reference_at_four_replicas(scheme):
    """R = 4: the first round is exact (wide dyadic updates: every sum exact, count ∈ 1..4 divides the same
    way); later rounds average non-dyadic θ, where the scheme's sum order may round differently: 1e-6."""
    cfg = dict(enabled=True, every=3, density=4 / 64, chunk=64, error_decay=0.95)
    res = _run_rounds(SimWorld(4), cfg, rounds=3, scheme=scheme, ints=False, cap_mb=1.0)
    ref = _sparseloco_reference(4, 3, 0.95, 4, 64, ints=False)
    for _, after in res:
        assert torch.equal(after[0], ref[0])
        for rnd in (1, 2):
            torch.testing.assert_close(after[rnd], ref[rnd], rtol=1e-6, atol=1e-6)


# --- checkpoints -------------------------------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(9, 70)
        self.b = torch.nn.Linear(70, 3)
        g = torch.Generator().manual_seed(0)  # not the global RNG: SimWorld's ranks are threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def _train(comm, steps: int, cfg: dict, stop_at: int | None = None, resume: dict | None = None):
    """Inner AdamW steps on each replica's own data, the outer sync every H; optionally stop after
    ``stop_at`` steps returning a checkpoint, or start from ``resume``."""
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = OuterSync(model.named_parameters(), comm, cfg, bucket_cap_mb=1e-3)
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        outer.load_state_dict(resume["outer"])
        start = resume["step"]
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        model(torch.randn(4, 9, generator=g)).backward()
        opt.step()
        opt.zero_grad()
        outer.maybe_step(step)
        if step == stop_at:
            return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                    "outer": outer.state_dict(), "step": step}
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), outer.state_dict()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_resume_equals_uninterrupted_bitwise(momentum):
    cfg = dict(SMALL, every=3, momentum=momentum, nesterov=momentum > 0)
    world = SimWorld(3)
    full = world.run(lambda c: _train(c, 10, cfg))
    ckpt = world.run(lambda c: _train(c, 10, cfg, stop_at=7))  # mid-round: 2 outer steps done, 1 step in
    resumed = world.run(lambda c: _train(c, 10, cfg, resume=ckpt[c.rank]))
    for (p_full, sd_full), (p_res, sd_res) in zip(full, resumed):
        assert torch.equal(p_full, p_res)
        for bf, br in zip(sd_full["buckets"], sd_res["buckets"]):
            for key in ("theta", "error", "momentum"):
                assert (bf[key] is None and br[key] is None) or torch.equal(bf[key], br[key])
    assert full[0][1]["outer_steps"] == 3 and full[0][1]["last_step"] == 9
    assert not torch.equal(full[0][1]["buckets"][0]["error"], full[1][1]["buckets"][0]["error"])  # per replica


def test_load_state_dict_refuses_another_layout():
    def body(comm):
        a = OuterSync(_named(0), comm, SMALL)
        b = OuterSync(_named(0)[:2], comm, SMALL)
        with pytest.raises(ValueError, match="another parameter layout"):
            b.load_state_dict(a.state_dict())
    SimWorld(1).run(body)


# --- agreement, memory, config ---------------------------------------------------------------------------
def test_replicas_must_agree_on_layout_and_config():
    def body(comm, cfg):
        named = _named(0)
        if comm.rank == 1:
            named = named[:3]
        OuterSync(named, comm, cfg)
    with pytest.raises(RuntimeError, match="replicas disagree on the"):
        SimWorld(2).run(body, [SMALL, SMALL])
    with pytest.raises(RuntimeError, match="zen.outer config"):
        SimWorld(2).run(lambda c, cfg: OuterSync(_named(0), c, cfg), [SMALL, dict(SMALL, density=0.5)])


def test_start_is_rank_0s_parameters():
    def body(comm):
        named = _named(comm.rank)  # different on every replica
        OuterSync(named, comm, SMALL)
        return torch.cat([p.detach().reshape(-1) for _, p in named])
    out = SimWorld(3).run(body)
    assert torch.equal(out[1], out[0]) and torch.equal(out[2], out[0]) and torch.equal(out[0], _flat0())


@pytest.mark.parametrize("density, momentum", [(1, 0.0), (0.05, 0.0), (0.05, 0.9), (1, 0.9)])
def test_state_bytes_match_the_formula(density, momentum):
    cfg = OuterConfig(enabled=True, density=density, momentum=momentum)
    out = SimWorld(1).run(lambda c: OuterSync(_named(0, torch.bfloat16), c, cfg).state_bytes())
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    assert out[0] == state_bytes_per_param(cfg) * numel == 4 * numel * (1 + (density < 1) + (momentum > 0))


def test_outer_sync_dict_config_refuses_unknown_keys():
    with pytest.raises(RuntimeError, match=r"zen.outer got unknown key\(s\) \['evry'\]; did you mean 'every'"):
        SimWorld(1).run(lambda c: OuterSync(_named(0), c, dict(SMALL, evry=3)))


def test_lossy_scheme_refused():
    with pytest.raises(RuntimeError, match="must be a lossless scheme"):
        SimWorld(1).run(lambda c: OuterSync(_named(0), c, SMALL, scheme="spardl"))


@pytest.mark.parametrize("section, exc, text", [
    ({"every": 0}, ValueError, "zen.outer.every (0) must be >= 1"),
    ({"every": 1.5}, TypeError, "zen.outer.every (1.5) must be an integer"),
    ({"density": 0}, ValueError, "zen.outer.density (0) must be in (0, 1]"),
    ({"density": 1.5}, ValueError, "zen.outer.density (1.5) must be in (0, 1]"),
    ({"error_decay": -0.1}, ValueError, "zen.outer.error_decay (-0.1) must be in [0, 1]"),
    ({"chunk": 0}, ValueError, "zen.outer.chunk (0) must be >= 1"),
    ({"lr": 0}, ValueError, "zen.outer.lr (0) must be > 0"),
    ({"momentum": 1}, ValueError, "zen.outer.momentum (1) must be in [0, 1)"),
    ({"nesterov": True}, ValueError, "zen.outer.nesterov (True) must be false when zen.outer.momentum is 0"),
    ({"average": "median"}, ValueError, "zen.outer.average ('median') must be one of ['mean', 'contributors']"),
    ({"state_device": "gpu"}, ValueError, "zen.outer.state_device ('gpu') must be one of ['cpu', 'device']"),
    ({"delay": 2}, ValueError, "zen.outer.delay (2) must be 0 or 1"),
    ({"delay": -1}, ValueError, "zen.outer.delay (-1) must be 0 or 1"),
    ({"delay": True}, TypeError, "zen.outer.delay (True) must be an integer"),
    ({"lr": float("nan")}, ValueError, "zen.outer.lr (nan) must be a finite number"),
    ({"enabled": 1}, TypeError, "zen.outer.enabled (1) must be a bool (true or false)"),
    ({"typo": 1}, ValueError, "zen.outer got unknown key(s) ['typo']"),
])
def test_config_errors(section, exc, text):
    with pytest.raises(exc) as info:
        ZenConfig.from_dict({"outer": section})
    assert str(info.value).startswith(text)


def test_config_defaults_are_sparseloco_and_lossy_scheme_refused():
    c = ZenConfig.from_dict({"outer": {"enabled": True}}).outer
    assert (c.every, c.density, c.error_decay, c.chunk, c.lr, c.momentum, c.nesterov, c.average, c.state_device,
            c.delay) == (15, 64 / 4096, 0.95, 4096, 1.0, 0.0, False, "contributors", "cpu", 0)
    assert c.k_of(4096) == 64 and ZenConfig().outer.enabled is False
    assert ZenConfig.from_dict(ZenConfig.from_dict({"outer": {"enabled": True, "every": 4}}).to_dict()).outer.every == 4
    with pytest.raises(ValueError, match=r"zen.scheme \('spardl'\) must be a lossless scheme when zen.outer"):
        ZenConfig.from_dict({"scheme": "spardl", "outer": {"enabled": True}})
