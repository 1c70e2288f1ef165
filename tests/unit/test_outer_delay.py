"""zen.outer.delay 1 (Streaming DiLoCo's overlap) in SimWorld: the sum of round t runs on the communication
thread while the training thread goes on, is merged one round late by the documented rule (direct
references, bitwise), θ_global stays bitwise equal across replicas, ``finish`` flushes the last round,
and checkpoints taken mid-round or at an outer step resume bitwise."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.unit.test_outer import SHAPES, SMALL, _flat0, _named, _run_rounds, _train, _update
from zen_ext.comm.simulated import SimWorld
from zen_ext.outer import OuterConfig, OuterSync, state_bytes_per_param


def _worlds(n: int):
    """The replicas' SimWorld (every rank computes at once: ranks block on their thread's sums) and a
    second world whose communicators the communication threads drive."""
    return SimWorld(n, max_active=n), SimWorld(n).communicators()


class _Delayed(OuterSync):
    """OuterSync at delay 1 over the overlap communicator of its rank (``overlap`` set by the test)."""

    overlap: list = []

    def __init__(self, named, comm, cfg, **kw):
        super().__init__(named, comm, cfg, overlap_comm=self.overlap[comm.rank], **kw)


def _rounds_delayed(n: int, cfg: dict, rounds: int, scheme: str = "zen", ints: bool = False, cap_mb: float = 1e-3):
    """``_run_rounds`` at delay 1; per rank also θ_global after each round (``state_dict`` waits for the
    round's sum) and the parameters after ``finish``."""
    world, overlap = _worlds(n)
    thetas: dict[int, list] = {r: [] for r in range(n)}

    class Rec(_Delayed):
        def maybe_step(self, step):
            ran = super().maybe_step(step)
            thetas[self.comm.rank].append(torch.cat([b["theta"] for b in self.state_dict()["buckets"]]))
            return ran

    Rec.overlap = overlap
    res = _run_rounds(world, dict(cfg, delay=1), rounds, scheme=scheme, ints=ints, cls=Rec, cap_mb=cap_mb)
    finished = []
    for outer, _ in res:
        outer.close()
        finished.append(torch.cat([p.detach().reshape(-1) for b in outer.buckets for p in b.params]))
    return res, thetas, finished


def _sgd(theta, mom, avg, cfg):
    """torch.optim.SGD's single-tensor formula, as OuterSync's step 6 writes it."""
    step = avg
    if mom is not None:
        mom.mul_(cfg["momentum"]).add_(avg)
        step = avg.add_(mom, alpha=cfg["momentum"]) if cfg["nesterov"] else mom
    return theta.add_(step, alpha=-cfg["lr"])


def _delayed_reference(n: int, rounds: int, cfg: dict, pick=None):
    """The delay-1 math written directly (module docstring of outer/sync.py): per replica x (parameters) and a
    (anchor); Δ = a − x; merge x ← θ + (x − a) once the previous round is in θ; a ← x; then the round's
    average moves θ. ``pick(r, delta)``: what replica r sends (dense: all of Δ). Returns per round the
    replicas' parameters and θ, and the parameters after the final flush."""
    theta = _flat0()
    mom = torch.zeros_like(theta) if cfg.get("momentum", 0) > 0 else None
    xs = [theta.clone() for _ in range(n)]
    anchors = [theta.clone() for _ in range(n)]
    sizes = [torch.Size(s) for s in SHAPES]
    out, in_flight = [], False
    for rnd in range(rounds):
        sent = []
        for r in range(n):
            xs[r] = xs[r] - torch.cat([_update(r, rnd, s, ints=False).reshape(-1) for s in sizes])
            delta = anchors[r] - xs[r]
            sent.append(pick(r, delta) if pick else delta)
            if in_flight:
                xs[r] = theta + (xs[r] - anchors[r])
            anchors[r] = xs[r].clone()
        acc = sent[0].clone()
        for s in sent[1:]:
            acc += s
        theta = _sgd(theta, mom, acc / n, cfg)
        in_flight = True
        out.append(([x.clone() for x in xs], theta.clone()))
    flushed = [theta + (x - a) for x, a in zip(xs, anchors)]
    return out, flushed


@pytest.mark.parametrize("n", [3, 4])
def test_delay_1_dense_is_the_delayed_merge_bitwise(n):
    """Density 1 (SimWorld's all-reduce sums in rank order, as the reference): parameters after each outer
    step, θ_global after each round and the flushed parameters, bitwise."""
    cfg = dict(enabled=True, every=5, density=1, lr=0.7, momentum=0.9, nesterov=True, average="mean")
    res, thetas, finished = _rounds_delayed(n, cfg, rounds=4)
    ref, flushed = _delayed_reference(n, 4, cfg)
    for rnd, (xs, theta) in enumerate(ref):
        for r, (_, after) in enumerate(res):
            assert torch.equal(after[rnd], xs[r]), (rnd, r)
            assert torch.equal(thetas[r][rnd], theta), (rnd, r)
    for r in range(n):
        assert torch.equal(finished[r], flushed[r])
        assert torch.equal(finished[r], ref[-1][1])  # right after an outer step, the flush leaves θ_global
    # round 1 merged nothing: the parameters are each replica's own after the first outer step
    assert not torch.equal(res[0][1][0], res[1][1][0])


def test_delay_1_sparse_is_the_delayed_merge_bitwise_at_two_replicas():
    """SparseLoCo's picks (β 0.95, top-4 of 64 per chunk of the flat vector: one bucket) averaged over the
    replicas (``"mean"``) at R = 2 (two-term sums: order-free), delay 1."""
    cfg = dict(enabled=True, every=3, density=4 / 64, chunk=64, error_decay=0.95, lr=1.0, momentum=0.0,
               nesterov=False)
    numel = _flat0().numel()
    errs = [torch.zeros(numel) for _ in range(2)]

    def pick(r, delta):
        errs[r] = errs[r] * 0.95 + delta
        out = torch.zeros(numel)
        for c0 in range(0, numel, 64):
            c = errs[r][c0:c0 + 64]
            top = c.abs().topk(min(c.numel(), max(1, round(4 / 64 * c.numel())))).indices + c0
            out[top] = errs[r][top]
            errs[r][top] = 0
        return out

    ref, flushed = _delayed_reference(2, 4, cfg, pick)
    res, thetas, finished = _rounds_delayed(2, dict(cfg, average="mean"), rounds=4, scheme="zen", cap_mb=1.0)
    for rnd, (xs, theta) in enumerate(ref):
        for r in range(2):
            assert torch.equal(res[r][1][rnd], xs[r]), (rnd, r)
            assert torch.equal(thetas[r][rnd], theta), (rnd, r)
    assert all(torch.equal(f, g) for f, g in zip(finished, flushed))


@pytest.mark.parametrize("scheme", ["zen", "agsparse", "auto"])
@pytest.mark.parametrize("n", [3, 4])
def test_delay_1_theta_bitwise_equal_across_replicas(scheme, n):
    cfg = dict(SMALL, lr=0.7, momentum=0.9, nesterov=True, error_decay=0.95)
    res, thetas, finished = _rounds_delayed(n, cfg, rounds=4, scheme=scheme)
    for rnd in range(4):
        assert all(torch.equal(thetas[r][rnd], thetas[0][rnd]) for r in range(n)), rnd
        assert not torch.equal(res[1][1][rnd], res[0][1][rnd])  # each replica carries its own round in flight
    assert all(torch.equal(f, thetas[0][-1]) for f in finished)  # flushed: every replica at θ_global
    st = res[0][0].pop_stats()
    assert st["outer_steps"] == 4 and st["bytes_sent"] > 0 and 0 < st["union"] <= n * st["picks"]


def test_delay_1_sum_runs_on_the_thread_while_training_goes_on():
    """The outer step returns before its sum has run: the scheme blocks until the training thread, after
    the outer step, lets it go (no timing involved), and it runs on the ``zen-outer`` thread."""
    from zen_ext.core.registry import build_scheme

    gate, seen = threading.Event(), []

    class Gated:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def sync_group(self, comm, grads, *a, **k):
            seen.append(threading.current_thread().name)
            assert gate.wait(60)
            return self.inner.sync_group(comm, grads, *a, **k)

    (overlap,) = SimWorld(1).communicators()

    def body(comm):
        named = _named(0)
        outer = OuterSync(named, comm, dict(SMALL, delay=1), scheme=Gated(build_scheme("zen")),
                          overlap_comm=overlap, bucket_cap_mb=1e-3)
        theta0 = torch.cat([b.theta_N.clone() for b in outer.buckets])
        with torch.no_grad():
            for _, p in named:
                p.sub_(1.0)
        assert outer.maybe_step(SMALL["every"])  # returns while every sum waits at the gate
        held = len(seen) <= 1 and torch.equal(torch.cat([b.theta_N for b in outer.buckets]), theta0)
        gate.set()
        outer.finish()
        moved = not torch.equal(torch.cat([b.theta_N for b in outer.buckets]), theta0)
        outer.close()
        return held, moved, len(outer.buckets)

    (held, moved, buckets), = SimWorld(1).run(body)
    assert held and moved and len(seen) == buckets > 1 and set(seen) == {"zen-outer"}


@pytest.mark.parametrize("stop_at", [7, 6])
def test_delay_1_resume_equals_uninterrupted_bitwise(stop_at):
    """A checkpoint mid-round (step 7: round 2 in flight, one step in) or right at an outer step (6) holds
    the round in flight (θ_global with it applied, the anchor, the merge due): resumed == uninterrupted."""
    import tests.unit.test_outer as base

    cfg = dict(SMALL, every=3, momentum=0.9, nesterov=True, delay=1)

    class Delayed(_Delayed):
        pass

    def run(fn):
        world, Delayed.overlap = _worlds(3)  # fresh communicators for every run, as fresh processes have
        return world.run(fn)

    saved = base.OuterSync
    base.OuterSync = Delayed  # _train builds base.OuterSync
    try:
        full = run(lambda c: _train(c, 10, cfg))
        ckpt = run(lambda c: _train(c, 10, cfg, stop_at=stop_at))
        resumed = run(lambda c: _train(c, 10, cfg, resume=ckpt[c.rank]))
    finally:
        base.OuterSync = saved
    assert all(b["in_flight"] for b in ckpt[0]["outer"]["buckets"])
    for (p_full, sd_full), (p_res, sd_res) in zip(full, resumed):
        assert torch.equal(p_full, p_res)
        for bf, br in zip(sd_full["buckets"], sd_res["buckets"]):
            for key in ("theta", "error", "momentum", "anchor"):
                assert torch.equal(bf[key], br[key]), key
            assert bf["in_flight"] == br["in_flight"] is True


def test_delay_0_refuses_a_round_in_flight_and_delay_1_resumes_delay_0():
    overlap = SimWorld(1).communicators()

    def body(comm):
        named = _named(0)
        d1 = OuterSync(named, comm, dict(SMALL, delay=1), overlap_comm=overlap[0], bucket_cap_mb=1e-3)
        with torch.no_grad():
            for _, p in named:
                p.sub_(0.5)
        d1.maybe_step(SMALL["every"])
        sd1 = d1.state_dict()
        d1.close()
        d0 = OuterSync(_named(0), comm, SMALL, bucket_cap_mb=1e-3)
        with pytest.raises(ValueError, match=r"zen.outer.delay \(0\) must be 1 to resume it"):
            d0.load_state_dict(sd1)
        d1b = OuterSync(_named(0), comm, dict(SMALL, delay=1), overlap_comm=overlap[0], bucket_cap_mb=1e-3)
        d1b.load_state_dict(d0.state_dict())  # delay 0's state: nothing in flight, anchor θ_global
        ok = all(b.inflight is None and torch.equal(b.anchor_N, b.theta_N) for b in d1b.buckets)
        d1b.close()
        return ok
    assert SimWorld(1).run(body) == [True]


def test_delay_1_needs_a_communicator_of_its_own():
    def body(comm):
        with pytest.raises(ValueError, match=r"zen.outer.delay \(1\) needs a communicator of its own"):
            OuterSync(_named(0), comm, dict(SMALL, delay=1))
        with pytest.raises(ValueError, match="must be another communicator over the same ranks"):
            OuterSync(_named(0), comm, dict(SMALL, delay=1), overlap_comm=comm)
    SimWorld(1).run(body)


@pytest.mark.parametrize("density, momentum", [(1, 0.0), (0.05, 0.9)])
def test_delay_1_state_bytes_match_the_formula(density, momentum):
    cfg = OuterConfig(enabled=True, density=density, momentum=momentum, delay=1)
    (overlap,) = SimWorld(1).communicators()

    def body(c):
        outer = OuterSync(_named(0, torch.bfloat16), c, cfg, overlap_comm=overlap)
        n = outer.state_bytes()
        outer.close()
        return n
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    assert SimWorld(1).run(body)[0] == state_bytes_per_param(cfg) * numel == 4 * numel * (2 + (density < 1) +
                                                                                          (momentum > 0))


def test_finish_is_nothing_at_delay_0():
    def body(comm):
        named = _named(0)
        outer = OuterSync(named, comm, SMALL)
        before = [p.detach().clone() for _, p in named]
        outer.finish()
        outer.close()
        return all(torch.equal(a, p) for a, (_, p) in zip(before, named))
    assert SimWorld(1).run(body) == [True]


def test_replicas_disagreeing_on_delay_fail_before_any_group_is_built():
    overlap = SimWorld(2).communicators()

    def body(comm, cfg):
        OuterSync(_named(0), comm, cfg, overlap_comm=overlap[comm.rank] if cfg.get("delay") else None)
    with pytest.raises(RuntimeError, match=r"replicas disagree on the zen.outer config.*'delay': 0"):
        SimWorld(2).run(body, [SMALL, dict(SMALL, delay=1)])


@pytest.mark.parametrize("bits", [8, 4])
def test_delay_1_with_value_bits_waits_for_the_feedback_and_stays_equal(bits, monkeypatch):
    """value_bits' sender feedback writes e on the communication thread: the next outer step waits for it
    before its own error feedback (step 2), so e is never read half-written and θ_global stays bitwise
    equal across replicas; the thread's work is slowed so a missing wait would race."""
    import time as _time

    from zen_ext.outer import average

    real = average.sum_average

    def slow(*a, **k):
        _time.sleep(0.05)
        return real(*a, **k)

    monkeypatch.setattr("zen_ext.outer.sync.sum_average", slow)
    n = 3
    cfg = dict(SMALL, lr=0.7, momentum=0.9, nesterov=True, error_decay=0.95, value_bits=bits)
    res, thetas, finished = _rounds_delayed(n, cfg, rounds=4, scheme="zen")
    for rnd in range(4):
        assert all(torch.equal(thetas[r][rnd], thetas[0][rnd]) for r in range(n)), rnd
    assert all(torch.equal(f, thetas[0][-1]) for f in finished)
    errs = [torch.cat([b.err_N for b in outer.buckets]) for outer, _ in res]
    assert all(e.abs().sum() > 0 for e in errs)
