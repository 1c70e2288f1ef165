"""ZEN's reduce-scatter inside DeepSpeed ZeRO-3 and ZeRO-2 (``reduce_scatter: true``), on real gloo processes.

The matrix (each case: a plain DeepSpeed run and a ZEN run, 5 optimizer steps, losses and gathered
parameters compared with ``==``):

* 2 ranks, the tiny untied Llama (real gradients; every sum has two operands, so its order cannot
  matter): ZeRO-2 and ZeRO-3 × fp32 and bf16, ZeRO-3 with gradient accumulation 2, ZeRO-1 with
  ``reduce_scatter`` (fp32), natural sparsity only.
* 3 and 4 ranks, ``ExactToy``: gradients that are integer multiples of 12 (its loss is linear in every
  parameter with integer coefficients), so every sum is exact in any order and DeepSpeed's pre-divided
  values ``12k / n`` too: ZeRO-2 and ZeRO-3, fp32; 3 ranks bf16 for ZeRO-3. Its parameter counts (185,
  35, 7) divide by none of 2, 3, 4, and every touched embedding row lies in rank 0's range (a hot
  range; the other ranks own none of the embedding's traffic).
* DGC (2 ranks, ZeRO-3): the ``zen`` reduce-scatter equals the ``dense`` reduce-scatter fed the same
  DGC output; checkpoint save/load with zen_ext's per-rank state continues bit-exactly.
"""

import os

import pytest
import torch

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
VOCAB, MICRO, SEQ, STEPS = 1000, 2, 16, 5


# --- worker side ---------------------------------------------------------------------------------------
class ExactToy(torch.nn.Module):
    """An embedding (37 × 5) and a linear layer (5 → 7): the loss is linear in every parameter with integer
    coefficients that are multiples of 12, so each gradient is an integer multiple of 12 whatever the
    weights, and sums of them (pre-divided by 2, 3 or 4) are exact in any order, in fp32 and bf16."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(37, 5)
        self.lin = torch.nn.Linear(5, 7)

    def forward(self, ids):
        feats = (ids[:, :5] % 3).to(self.lin.weight.dtype)  # integer features 0..2
        coef = torch.arange(1, 8, dtype=self.lin.weight.dtype) % 2 + 1  # 1 or 2 per output
        return 12 * self.emb(ids).sum() + 12 * (self.lin(feats) * coef).sum()


def _ds_config(stage, dtype="fp32", zen=None, ga=1, zero=None):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ga,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_scatter": True, "reduce_bucket_size": 20000,
                                 "stage3_param_persistence_threshold": 0, **(zero or {})},
           "steps_per_print": 10**6}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if zen is not None:
        cfg["zen"] = zen
    return cfg


def _engine(cfg, toy):
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model

    model = ExactToy() if toy else build_model(MODEL, seed=0)
    engine, *_ = zds.initialize(model=model, config=cfg)
    return engine


def _batches(rank, n, toy, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if toy:  # every touched embedding row in [0, 9): rank 0's range at 2, 3 and 4 ranks
        return [torch.randint(0, 9, (MICRO, 6), generator=g) for _ in range(n)]
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(n)]


def _train(engine, batches, toy):
    losses = []
    for x in batches:
        loss = engine(x) if toy else engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _weights(engine):
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


def _pair(rank, stage, dtype, toy, ga=1, zen=None, seed=0):
    batches = _batches(rank, STEPS * ga, toy, seed)
    zen = zen or {"scheme": "zen"}
    plain = _engine(_ds_config(stage, dtype, ga=ga), toy)
    ours = _engine(_ds_config(stage, dtype, ga=ga, zen=zen), toy)
    out = {"plain": _train(plain, batches, toy), "zen": _train(ours, batches, toy), "plain_w": _weights(plain),
           "zen_w": _weights(ours), "calls": ours.zen.override_calls, "last": ours.zen.stats.last,
           "totals": ours.zen.totals}
    ours.zen.close()
    return out


def _bitwise_worker(rank, world, cases):
    return {name: _pair(rank, *args) for name, *args in cases}


CASES_2 = [("zero1_fp32", 1, "fp32", False), ("zero2_fp32", 2, "fp32", False), ("zero2_bf16", 2, "bf16", False),
           ("zero3_fp32", 3, "fp32", False),
           ("zero3_bf16", 3, "bf16", False), ("zero3_ga2", 3, "fp32", False, 2)]
CASES_N = [("zero2_toy", 2, "fp32", True), ("zero3_toy", 3, "fp32", True)]


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_bitwise_worker, 2, CASES_2, timeout_s=900)


@pytest.mark.parametrize("name", [c[0] for c in CASES_2])
def test_natural_zen_equals_plain_zero_two_ranks(two_ranks, name):
    for rank, res in enumerate(two_ranks):
        r = res[name]
        assert r["zen"] == r["plain"], (name, rank)
        assert torch.equal(r["zen_w"], r["plain_w"]), (name, rank)
        assert r["calls"] >= STEPS
        last = r["last"]
        assert 0 < last["nnz"]["natural"] < last["numel"]["natural"] // 4, last  # the embedding went sparse
    assert torch.equal(two_ranks[0][name]["zen_w"], two_ranks[1][name]["zen_w"])


@pytest.mark.parametrize("world", [3, 4])
def test_natural_zen_equals_plain_zero_exact_model(world):
    cases = CASES_N + ([("zero3_toy_bf16", 3, "bf16", True)] if world == 3 else [])
    res = run_workers(_bitwise_worker, world, cases, timeout_s=900)
    for name, *_ in cases:
        for rank in range(world):
            r = res[rank][name]
            assert r["zen"] == r["plain"], (name, rank)
            assert torch.equal(r["zen_w"], r["plain_w"]), (name, rank)
            assert r["last"]["nnz"]["natural"] > 0


# --- DGC, checkpoints, the fp16 guard (2 ranks, ZeRO-3) ------------------------------------------------
DGC = {"enabled": True, "density": 0.05, "min_numel": 256, "momentum_correction": False, "momentum_masking": False,
       "warmup_steps": 0}


def _dgc_worker(rank, world, tmp):
    from zen_ext.core.reduce_scatter import build_reduce_scatter

    out = {}
    batches = _batches(rank, 8, toy=False, seed=2)
    # The same DGC output reduce-scattered by zen, direct and dense.
    for name in ("zen", "direct", "dense"):
        e = _engine(_ds_config(3, zen={"scheme": "zen" if name != "dense" else "dense", "dgc": DGC}), toy=False)
        if name == "direct":
            e.zen.sync.rs_scheme = build_reduce_scatter("direct")
        out[name] = {"losses": _train(e, batches[:STEPS], toy=False), "w": _weights(e), "last": e.zen.stats.last,
                     "totals": e.zen.totals}
        e.zen.close()
    # Resume: 8 steps with a checkpoint after 4; a fresh engine continues from it bit-exactly.
    ckpt = os.path.join(tmp, "ckpt")
    zen = {"scheme": "zen", "dgc": DGC}
    a = _engine(_ds_config(3, zen=zen), toy=False)
    first = _train(a, batches[:4], toy=False)
    a.save_checkpoint(ckpt, tag="s4")
    out["resume_full"] = first + _train(a, batches[4:], toy=False)
    b = _engine(_ds_config(3, zen=zen), toy=False)
    b.load_checkpoint(ckpt, tag="s4")
    out["resume_b"] = _train(b, batches[4:], toy=False)
    out["state_file"] = os.path.isfile(os.path.join(ckpt, "s4", "zen_ext", f"rank{rank:05d}.pt"))
    # fp16: a NaN in one element of one rank's DGC-routed gradient must skip the step on every rank.
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True
    cfg = _ds_config(3, zen=zen)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    f = _engine(cfg, toy=False)
    poison = {"on": False}
    f.module.lm_head.weight.register_hook(
        lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("nan"), dtype=g.dtype))
        if poison["on"] else g)
    losses = []
    for i, x in enumerate(_batches(rank, 4, toy=False, seed=3)):
        poison["on"] = rank == 1 and i == 1
        loss = f(input_ids=x, labels=x).loss
        f.backward(loss)
        f.step()
        losses.append(loss.float().item())
    out["fp16"] = {"skipped": f.skipped_steps, "nonfinite": f.zen.totals["nonfinite_steps"], "w": _weights(f)}
    return out


@pytest.fixture(scope="module")
def dgc_run(tmp_path_factory):
    return run_workers(_dgc_worker, 2, str(tmp_path_factory.mktemp("zen_z3")), timeout_s=900)


def test_dgc_zen_and_direct_equal_dense_reduce_scatter(dgc_run):
    for rank, r in enumerate(dgc_run):
        for name in ("zen", "direct"):
            assert r[name]["losses"] == r["dense"]["losses"], (name, rank)
            assert torch.equal(r[name]["w"], r["dense"]["w"]), (name, rank)
        assert r["zen"]["last"]["density"]["dgc"] < 0.2, r["zen"]["last"]
        assert 0 < r["zen"]["totals"]["bytes_sent"] < r["dense"]["totals"]["bytes_sent"], (r["zen"]["totals"],
                                                                                        r["dense"]["totals"])


def test_zero3_resume_with_zen_state_is_exact(dgc_run):
    for rank, r in enumerate(dgc_run):
        assert r["state_file"]
        assert r["resume_b"] == r["resume_full"][4:], rank


def test_zero3_fp16_overflow_on_one_rank_skips_the_step_everywhere(dgc_run):
    for rank, r in enumerate(dgc_run):
        assert r["fp16"]["skipped"] == 1 and r["fp16"]["nonfinite"] == 1, (rank, r["fp16"])
        assert torch.isfinite(r["fp16"]["w"]).all()
    assert torch.equal(dgc_run[0]["fp16"]["w"], dgc_run[1]["fp16"]["w"])
