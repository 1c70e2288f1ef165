"""ZEN attached to real DeepSpeed engines on 2 gloo processes (tiny untied Llama, hidden 64, 2 layers).

Two process launches serve all tests (module fixtures), because starting DeepSpeed dominates:

* ``lossless``: for ZeRO 0/1/2, fp32/bf16/fp16, BF16_Optimizer and gradient accumulation, a dense
  DeepSpeed run and a ZEN run with natural sparsity only; per-step losses and final weights must be
  *equal* (2 ranks: every sum has the same operands in the same order). Also the override checks.
* ``dgc``: DGC top-k training (loss falls; stats JSONL; DeepSpeed's CSV monitor), checkpoint resume
  (bit-exact continuation, and the ZEN state matters), the fp16 overflow guard, refused settings.
"""

import json
import os
import time

import pytest
import torch

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
VOCAB, MICRO, SEQ = 1000, 2, 32


# --- worker side ---------------------------------------------------------------------------------------
def _ds_config(stage=0, dtype="fp32", zen=None, ga=1, zero=None, **extra):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ga,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage, **(zero or {})}, "steps_per_print": 10**6, **extra}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "bf16_optimizer":  # bf16 + ZeRO-1 + fp32 accumulation builds BF16_Optimizer
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if zen is not None:
        cfg["zen"] = zen
    return cfg


def _engine(cfg):
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model

    if "fp16" in cfg:
        # The CPU accelerator reports fp16 only with AVX512-FP16; the fp16 engine path itself runs
        # on any CPU with torch 2.13 (slowly), which is all these tests need.
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    model = build_model(MODEL, seed=0)
    engine, *_ = zds.initialize(model=model, config=cfg)
    return engine


def _batches(rank, n, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(n)]


def _train(engine, batches, hook=None):
    """One optimizer step per ``ga`` batches; returns the per-step mean micro-batch loss."""
    ga = engine.gradient_accumulation_steps()
    losses, acc = [], 0.0
    for i, x in enumerate(batches):
        if hook is not None:
            hook(i)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        acc += loss.float().item()
        if (i + 1) % ga == 0:
            losses.append(acc / ga)
            acc = 0.0
    return losses


def _weights(engine):
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


LOSSLESS_CASES = [  # (name, stage, dtype, gradient accumulation)
    ("zero0_fp32", 0, "fp32", 1), ("zero1_fp32", 1, "fp32", 1), ("zero2_fp32", 2, "fp32", 1),
    ("zero0_bf16", 0, "bf16", 1), ("zero1_bf16", 1, "bf16", 1), ("zero1_bf16_optimizer", 1, "bf16_optimizer", 1),
    ("zero0_fp16", 0, "fp16", 1), ("zero0_ga2", 0, "fp32", 2), ("zero2_ga2", 2, "fp32", 2),
]


def _lossless_worker(rank, world):
    from deepspeed.runtime.engine import DeepSpeedEngine

    from zen_ext.engines.deepspeed_compat import bf16_reduces_before_accumulating

    out = {}
    for name, stage, dtype, ga in LOSSLESS_CASES:
        batches = _batches(rank, 3 * ga)
        if dtype == "bf16_optimizer" and bf16_reduces_before_accumulating(DeepSpeedEngine):
            try:  # DeepSpeed before 0.19 reduces BF16_Optimizer's buffers before accumulating into them
                _engine(_ds_config(stage, dtype, ga=ga, zen={"scheme": "zen"}))
                out[name] = {"refused": None}
            except NotImplementedError as exc:
                out[name] = {"refused": str(exc)}
            continue
        dense = _engine(_ds_config(stage, dtype, ga=ga))
        zen = _engine(_ds_config(stage, dtype, ga=ga, zen={"scheme": "zen", "bucket_cap_mb": 0.05}))
        out[name] = {"dense": _train(dense, batches), "zen": _train(zen, batches),
                     "dense_w": _weights(dense), "zen_w": _weights(zen), "calls": zen.zen.override_calls,
                     "totals": zen.zen.totals, "optimizer": type(zen.optimizer).__name__,
                     "last": zen.zen.stats.last}
    # zen.async_sync: the ZEN buckets of each engine bucket pipelined over the communication worker
    # (bucket_cap_mb 0.05 re-buckets every engine bucket into several), DGC on: bitwise the blocking run.
    out["async"] = {}
    for stage in (0, 1, 2):
        batches = _batches(rank, 3, seed=5)
        zen_cfg = {"scheme": "zen", "bucket_cap_mb": 0.05, "dgc": {"enabled": True, "min_numel": 1024}}
        blocking = _engine(_ds_config(stage, zen=dict(zen_cfg)))
        piped = _engine(_ds_config(stage, zen=dict(zen_cfg, async_sync=True)))
        out["async"][stage] = {"blocking": _train(blocking, batches), "async": _train(piped, batches),
                               "blocking_w": _weights(blocking), "async_w": _weights(piped),
                               "worker": piped.zen.worker is not None,
                               "buckets": piped.zen.stats.last.get("buckets")}
        piped.zen.close()
        out["async"][stage]["released"] = piped.zen.worker is None
    # ZeRO overlap_comm + zen.async_sync: whole IPG buckets go to the worker while the backward pass
    # fills the other IPG buffer. 20000-element IPG buckets: several per layer, and the 64000-element
    # embedding and head take DeepSpeed's oversized-parameter path (blocking, after a drain).
    out["async_ipg"] = {}
    for stage in (1, 2):
        batches = _batches(rank, 3, seed=6)
        zen_cfg = {"scheme": "zen", "bucket_cap_mb": 0.05, "dgc": {"enabled": True, "min_numel": 1024}}
        zero = {"overlap_comm": True, "reduce_bucket_size": 20000}
        blocking = _engine(_ds_config(stage, zen=dict(zen_cfg), zero=zero))
        piped = _engine(_ds_config(stage, zen=dict(zen_cfg, async_sync=True), zero=zero))
        # Proof of overlap: the worker holds each bucket 50 ms longer, and the training thread's
        # gradient hooks record when the backward pass produced each gradient.
        windows, grad_times = [], []
        finish = piped.zen.async_ipg.finish

        def slow_finish(*a, finish=finish, windows=windows):
            t0 = time.perf_counter()
            time.sleep(0.05)
            res = finish(*a)
            windows.append((t0, time.perf_counter()))
            return res

        piped.zen.async_ipg.finish = slow_finish
        for p in piped.module.parameters():
            p.register_hook(lambda g, ts=grad_times: ts.append(time.perf_counter()))
        out["async_ipg"][stage] = {"blocking": _train(blocking, batches), "async": _train(piped, batches),
                                   "blocking_w": _weights(blocking), "async_w": _weights(piped),
                                   "ipg_buckets": piped.zen.async_ipg_buckets, "off": piped.zen.async_ipg_off,
                                   "blocking_off": blocking.zen.async_ipg_off,
                                   "overlapped": sum(1 for t in grad_times if any(a < t < b for a, b in windows)),
                                   "windows": len(windows),
                                   "step_ipg": piped.zen.stats.last.get("async_ipg_buckets")}
        piped.zen.close()
    # A failing IPG bucket on the worker reaches the training thread (every rank fails in its second
    # bucket before any collective of it, so nobody waits), and later buckets fail fast.
    failing = _engine(_ds_config(2, zen={"scheme": "zen", "async_sync": True},
                                 zero={"overlap_comm": True, "reduce_bucket_size": 20000}))
    finish, calls = failing.zen.async_ipg.finish, []

    def broken(*a, finish=finish, calls=calls):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError(f"broken IPG bucket on rank {rank}")
        return finish(*a)

    failing.zen.async_ipg.finish = broken
    try:
        _train(failing, _batches(rank, 1))
        out["ipg_failure"] = None
    except Exception as exc:  # noqa: BLE001 - the test inspects what reached the training thread
        out["ipg_failure"] = f"{type(exc).__name__}: {exc}"
    failing.zen.close()
    # The override must be what reduces: put DeepSpeed's own method back, as a DeepSpeed release that
    # moved the reduction would, and the step must fail loudly.
    engine = _engine(_ds_config(0, zen={}))
    engine.allreduce_bucket = engine.zen._orig_allreduce_bucket
    try:
        _train(engine, _batches(rank, 1))
        out["moved"] = None
    except RuntimeError as exc:
        out["moved"] = str(exc)
    return out


@pytest.fixture(scope="module")
def lossless():
    return run_workers(_lossless_worker, 2, timeout_s=600)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_async_sync_pipelines_buckets_bitwise(lossless, stage):
    for r in lossless:
        got = r["async"][stage]
        assert got["worker"] and got["released"]
        assert got["buckets"] and got["buckets"] > 1, got["buckets"]
        assert got["async"] == got["blocking"]
        assert torch.equal(got["async_w"], got["blocking_w"])


@pytest.mark.parametrize("stage", [1, 2])
def test_async_sync_overlaps_zero_ipg_buckets_with_the_backward_pass(lossless, stage):
    """ZeRO overlap_comm + zen.async_sync: the worker takes whole IPG buckets, gradients of earlier
    layers are computed while a bucket is being reduced, and the run is bitwise the blocking one."""
    for r in lossless:
        got = r["async_ipg"][stage]
        assert got["off"] is None and got["blocking_off"] == "zen.async_sync is off"
        assert got["ipg_buckets"] >= 6 and got["windows"] == got["ipg_buckets"], got
        assert got["step_ipg"] == got["ipg_buckets"] // 3, got  # per step in the statistics (3 steps)
        assert got["overlapped"] >= 1, got
        assert got["async"] == got["blocking"]
        assert torch.equal(got["async_w"], got["blocking_w"])


def test_async_ipg_failure_reaches_the_training_thread(lossless):
    for rank, r in enumerate(lossless):
        assert r["ipg_failure"] == f"ValueError: broken IPG bucket on rank {rank}", r["ipg_failure"]


@pytest.mark.parametrize("name", [c[0] for c in LOSSLESS_CASES])
def test_natural_sparsity_equals_dense_deepspeed(lossless, name):
    if "refused" in lossless[0][name]:  # deepspeed_compat.late_bf16_refusal (DeepSpeed before 0.19)
        assert lossless[0][name]["refused"].startswith(
            "zen with BF16_Optimizer (bf16 with data_types.grad_accum_dtype fp32) needs bf16.immediate_grad_update "
            "true on deepspeed 0."), lossless[0][name]
        return
    for rank in range(2):
        r = lossless[rank][name]
        assert r["zen"] == r["dense"], (name, rank)
        assert torch.equal(r["zen_w"], r["dense_w"]), (name, rank)
        assert r["totals"]["bytes_sent"] > 0
        # The embedding really took the sparse path: its rows, found inside DeepSpeed's buckets.
        last = r["last"]
        per_step = 2 if name == "zero2_ga2" else 1  # ZeRO-2 reduces every micro-batch
        assert last["numel"]["natural"] == per_step * 1000 * 64, last
        assert 0 < last["nnz"]["natural"] < last["numel"]["natural"] // 4, last
        assert "zen" in last["schemes"]
    assert torch.equal(lossless[0][name]["zen_w"], lossless[1][name]["zen_w"])  # replicas agree
    if name == "zero1_bf16_optimizer":
        assert lossless[0][name]["optimizer"] == "BF16_Optimizer"


def test_override_is_called_and_moving_it_fails_loudly(lossless):
    import deepspeed

    r = lossless[0]
    # ZeRO-0 reduces one bucket per optimizer step; ZeRO-2 once per micro-batch.
    assert r["zero0_fp32"]["calls"] == 3 and r["zero0_ga2"]["calls"] == 3
    assert r["zero2_ga2"]["calls"] >= 6 and r["zero1_fp32"]["calls"] >= 3
    assert r["moved"] is not None and r["moved"].startswith(
        f"zen: DeepSpeed {deepspeed.__version__} did not call the ZEN gradient reduction during this optimizer "
        "step (ZeRO-0)")


# --- DGC, stats, monitor, resume, fp16 guard, refusals ------------------------------------------------
def _dgc_worker(rank, world, tmp):
    out = {}
    dgc = {"enabled": True, "density": 0.05, "min_numel": 256, "momentum_correction": False,
           "momentum_masking": False}
    # Training with DGC: 4 fixed batches, 24 steps; stats JSONL and DeepSpeed's CSV monitor.
    zen = {"scheme": "zen", "dgc": dgc, "stats": {"jsonl_path": os.path.join(tmp, "zen_stats.jsonl")}}
    engine = _engine(_ds_config(1, zen=zen, csv_monitor={"enabled": True, "output_path": tmp, "job_name": "mon"}))
    fixed = _batches(rank, 4, seed=1)

    def annotate(i):
        engine.zen.annotate(note=i)

    out["dgc_losses"] = _train(engine, fixed * 6, hook=annotate)
    out["dgc_totals"] = engine.zen.totals
    out["summary"] = engine.zen.summary(print_it=False)
    engine.zen.close()

    # Resume: 8 steps with a checkpoint after 4; a fresh engine continues from it bit-exactly.
    ckpt = os.path.join(tmp, "ckpt")
    batches = _batches(rank, 8, seed=2)
    zen = {"scheme": "zen", "dgc": dgc}
    a = _engine(_ds_config(1, zen=zen))
    first = _train(a, batches[:4])
    a.save_checkpoint(ckpt, tag="s4")
    out["resume_full"] = first + _train(a, batches[4:])
    b = _engine(_ds_config(1, zen=zen))
    b.load_checkpoint(ckpt, tag="s4")
    out["resume_b"] = _train(b, batches[4:])
    out["state_file"] = os.path.isfile(os.path.join(ckpt, "s4", "zen_ext", f"rank{rank:05d}.pt"))
    os.remove(os.path.join(ckpt, "s4", "zen_ext", f"rank{rank:05d}.pt"))  # without ZEN's state ...
    c = _engine(_ds_config(1, zen=zen))
    c.load_checkpoint(ckpt, tag="s4")
    out["resume_fresh"] = _train(c, batches[4:])  # ... DGC residuals restart: a different run

    # fp16 loss scaling: a NaN in one element of one rank's DGC-routed gradient (which top-k alone
    # could drop) must be seen as an overflow on both ranks: the step is skipped everywhere.
    f = _engine(_ds_config(0, "fp16", zen={"scheme": "zen", "dgc": dgc}))
    w = f.module.lm_head.weight
    poison = {"on": False}
    w.register_hook(lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("nan"),
                    dtype=g.dtype)) if poison["on"] else g)

    def arm(i):
        poison["on"] = rank == 1 and i == 1

    out["fp16_losses"] = _train(f, _batches(rank, 4, seed=3), hook=arm)
    out["fp16_skipped"] = f.skipped_steps
    out["fp16_w"] = _weights(f)
    out["fp16_nonfinite_steps"] = f.zen.totals["nonfinite_steps"]

    # Refused settings, with the text users see.
    for name, cfg in [("zero2_ga_dgc", _ds_config(2, ga=2, zen={"dgc": dgc})),
                      ("zero3_ga_dgc", _ds_config(3, ga=2, zen={"dgc": dgc}))]:
        try:
            _engine(cfg)
            out[name] = None
        except NotImplementedError as exc:
            out[name] = str(exc)
    return out


@pytest.fixture(scope="module")
def dgc_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zen_ds"))
    return run_workers(_dgc_worker, 2, tmp, timeout_s=600), tmp


def test_dgc_training_loss_falls_and_sends_less(dgc_run):
    res, tmp = dgc_run
    for rank in range(2):
        losses = res[rank]["dgc_losses"]
        assert all(map(torch.isfinite, torch.tensor(losses)))
        assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
        t = res[rank]["dgc_totals"]
        assert 0 < t["bytes_sent"] < 0.5 * t["dense_bytes"], t
    assert "ZEN gradient synchronization summary (2 ranks, 24 optimizer steps)" in res[0]["summary"]


def test_stats_jsonl_and_monitor(dgc_run):
    res, tmp = dgc_run
    with open(os.path.join(tmp, "zen_stats.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == list(range(1, 25))
    r = recs[-1]
    for key in ("bytes_sent", "dense_bytes", "sent_vs_dense", "density", "schemes", "sync_s", "hash_s",
                "gamma_natural", "reduce_calls"):
        assert key in r, key
    assert r["note"] == 23 and r["density"]["dgc"] < 0.2 and r["schemes"] == ["dense", "zen"]
    assert r["sent_vs_dense"] == pytest.approx(r["bytes_sent"] / r["dense_bytes"])
    csvs = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs if f.startswith("Zen_")]
    names = {os.path.basename(p) for p in csvs}
    assert {"Zen_bytes_sent.csv", "Zen_dense_bytes.csv"} <= names, names


def test_resume_from_checkpoint_is_exact(dgc_run):
    res, _ = dgc_run
    for rank in range(2):
        r = res[rank]
        assert r["state_file"]
        assert r["resume_b"] == r["resume_full"][4:], rank
        # Without the saved residuals the continuation differs after its first update.
        assert r["resume_fresh"][0] == r["resume_full"][4] and r["resume_fresh"][1:] != r["resume_full"][5:]


def test_fp16_overflow_is_seen_on_every_rank(dgc_run):
    res, _ = dgc_run
    for rank in range(2):
        assert res[rank]["fp16_skipped"] == 1 and res[rank]["fp16_nonfinite_steps"] == 1, rank
        assert torch.isfinite(res[rank]["fp16_w"]).all()
    assert torch.equal(res[0]["fp16_w"], res[1]["fp16_w"])


def test_refused_settings(dgc_run):
    res, _ = dgc_run
    assert res[0]["zero2_ga_dgc"] == (
        "zen with zen.dgc on supports ZeRO-2 only with gradient_accumulation_steps = 1: ZeRO-2 reduces every "
        "micro-batch, and the dgc sparsifier's memory (e.g. momentum correction) must advance once per optimizer "
        "step; use ZeRO-1 (reduces once per step) or ZeRO-0")
    assert res[0]["zero3_ga_dgc"].startswith("zen with zen.dgc on supports ZeRO-3 only with gradient_accumulation_steps = 1")

