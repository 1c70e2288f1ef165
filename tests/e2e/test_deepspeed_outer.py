"""zen.outer on real DeepSpeed engines (ZeRO-0, fp32, 3 gloo processes, tiny untied Llama): inner steps keep
each replica's own gradients, replicas are bitwise equal after each outer step and apart in between, a
run resumed from a mid-round DeepSpeed checkpoint equals the uninterrupted one bitwise (delay 0 and 1),
delay 1 keeps θ_global bitwise equal and flushes its last round, and what cannot be served is refused by
name. One process launch serves every test (module fixture)."""

import os

import pytest
import torch

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
VOCAB, MICRO, SEQ = 1000, 2, 16
OUTER = {"enabled": True, "every": 3, "density": 0.05, "lr": 0.7, "momentum": 0.9, "nesterov": True}


def _cfg(stage=0, dtype="fp32", delay=0):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
           "zen": {"scheme": "zen", "bucket_cap_mb": 0.2, "outer": dict(OUTER, delay=delay)}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(cfg):
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model

    engine, *_ = zds.initialize(model=build_model(MODEL, seed=0), config=cfg)
    return engine


def _flat(module):
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _worker(rank, world, ckpt_dir):
    from recipes.common import build_model

    out = {}
    engine = _engine(_cfg())
    alone = build_model(MODEL, seed=0)
    params, grads_own = [], []
    for step in range(1, 8):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        alone.load_state_dict(engine.module.state_dict())
        alone.zero_grad()
        alone(input_ids=x, labels=x).loss.backward()
        grads_own.append(all(torch.equal(p.grad, q.grad)
                             for p, q in zip(engine.module.parameters(), alone.parameters())))
        engine.step()
        params.append(_flat(engine.module))
        if step == 4:
            engine.save_checkpoint(ckpt_dir, tag="step4")
    out.update(params=params, grads_own=grads_own, totals=dict(engine.zen.totals), summary=engine.zen.summary())
    # Resume from the mid-round checkpoint (1 inner step after the first outer step) and redo steps 5-7.
    resumed = _engine(_cfg())
    resumed.load_checkpoint(ckpt_dir, tag="step4")
    for step in range(5, 8):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        resumed.backward(resumed(input_ids=x, labels=x).loss)
        resumed.step()
    out["resumed"] = _flat(resumed.module)
    refusals = []
    for stage, dtype in ((1, "fp32"), (0, "bf16")):
        try:
            _engine(_cfg(stage, dtype))
        except NotImplementedError as exc:
            refusals.append(str(exc))
    out["refusals"] = refusals
    out["delayed"] = _delayed(rank, os.path.join(ckpt_dir, "delayed"))
    return out


def _delayed(rank, ckpt_dir):
    """zen.outer.delay 1: 9 steps (outer steps at 3, 6, 9), θ_global after each round's sum, a checkpoint at
    step 4 (round 1 in flight) resumed to step 9, and ``finish`` at the end."""

    def steps(engine, first, last, save=False):
        params, thetas = [], {}
        for step in range(first, last + 1):
            x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            params.append(_flat(engine.module))
            if step % 3 == 0:  # state_dict waits for the round's sum (θ_global holds it), merges nothing
                thetas[step] = torch.cat([b["theta"] for b in engine.zen.outer.state_dict()["buckets"]])
            if save and step == 4:
                engine.save_checkpoint(ckpt_dir, tag="step4")
        engine.zen.finish()
        return params, thetas, _flat(engine.module), torch.cat([b.theta_N for b in engine.zen.outer.buckets])

    engine = _engine(_cfg(delay=1))
    full = steps(engine, 1, 9, save=True)
    totals = dict(engine.zen.totals)
    engine.zen.close()
    resumed_engine = _engine(_cfg(delay=1))
    resumed_engine.load_checkpoint(ckpt_dir, tag="step4")
    resumed = steps(resumed_engine, 5, 9)
    resumed_engine.zen.close()
    return {"full": full, "resumed": resumed, "totals": totals}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_workers(_worker, 3, str(tmp_path_factory.mktemp("ckpt")), timeout_s=600)


def test_inner_steps_keep_each_replicas_own_gradients(run):
    assert all(all(r["grads_own"]) for r in run)


def test_replicas_equal_after_each_outer_step_and_apart_between(run):
    for step in (3, 6):
        assert all(torch.equal(r["params"][step - 1], run[0]["params"][step - 1]) for r in run)
    for step in (1, 4, 7):
        assert not torch.equal(run[1]["params"][step - 1], run[0]["params"][step - 1])
    t = run[0]["totals"]
    assert t["outer_steps"] == 2 and 0 < t["bytes_sent"] < t["dense_bytes"] / 3  # 2 outer syncs for 7 steps
    assert "zen.outer summary (3 replicas, 2 outer steps)" in run[0]["summary"]


def test_resume_from_mid_round_checkpoint_is_bitwise(run):
    assert all(torch.equal(r["resumed"], r["params"][-1]) for r in run)


def test_delay_1_theta_equal_flushed_and_resumed_bitwise(run):
    """delay 1: θ_global bitwise equal on every replica after each round's sum, parameters apart (each carries
    its own round in flight), ``finish`` at an outer step leaves every replica at θ_global, and the run
    resumed from the step-4 checkpoint (round 1 in flight) equals the uninterrupted one bitwise."""
    ref = run[0]["delayed"]["full"]
    for r in run:
        params, thetas, final, theta = r["delayed"]["full"]
        r_params, r_thetas, r_final, r_theta = r["delayed"]["resumed"]
        assert sorted(thetas) == [3, 6, 9] and all(torch.equal(thetas[s], ref[1][s]) for s in (3, 6, 9))
        assert torch.equal(final, theta) and torch.equal(theta, ref[3])
        assert torch.equal(r_final, final) and all(torch.equal(a, b) for a, b in zip(r_params, params[4:]))
        assert all(torch.equal(r_thetas[s], thetas[s]) for s in (6, 9))
        assert r["delayed"]["totals"]["outer_steps"] == 3 and r["delayed"]["totals"]["bytes_sent"] > 0
    for s in (3, 6):
        assert not torch.equal(run[1]["delayed"]["full"][0][s - 1], ref[0][s - 1])


def test_unserved_settings_refused(run):
    z1, bf16 = run[0]["refusals"]
    assert z1.startswith("zen.outer on DeepSpeed supports ZeRO-0 with fp32 weights, each data-parallel rank one "
                         "replica, or ZeRO-1/2 with fp32 weights inside replica groups")
    assert "got ZeRO-1 over a data-parallel group of all 3 ranks (one replica): pass deepspeed.initialize an mpu" in z1
    assert bf16.startswith("zen.outer on DeepSpeed supports ZeRO-0 with fp32 weights") and "got bf16" in bf16


class _ReplicaMPU:
    """What DeepSpeed asks an ``mpu``: the data-parallel group is the rank's replica group (ZeRO partitions and
    reduces inside it); no model parallelism (one-rank groups)."""

    def __init__(self, dp, alone):
        self.dp, self.alone = dp, alone

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_world_size(self):
        return torch.distributed.get_world_size(self.dp)

    def get_data_parallel_rank(self):
        return torch.distributed.get_rank(self.dp)

    def get_model_parallel_group(self):
        return self.alone

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


def _zero_groups_worker(rank, world, stage):
    """4 ranks as 2 replica groups of 2 ({0, 1}, {2, 3}), ZeRO-``stage`` inside each."""
    import logging

    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model
    from zen_ext.outer.sync import state_bytes_per_param

    dps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(world)]
    engine, *_ = zds.initialize(model=build_model(MODEL, seed=0), config=_cfg(stage),
                                mpu=_ReplicaMPU(dps[rank // 2], alone[rank]))
    params, parts = [], []
    for step in range(1, 8):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        params.append(_flat(engine.module))
        parts.append(torch.cat([t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]))
    outer = engine.zen.outer
    refused = None
    try:
        engine.save_checkpoint("/nonexistent", tag="x")
    except NotImplementedError as exc:
        refused = str(exc)
    return {"params": params, "parts": parts, "state": outer.state_bytes(),
            "formula": state_bytes_per_param(outer.cfg) * sum(b.numel for b in outer.buckets),
            "part_numel": parts[-1].numel(), "p": params[-1].numel(), "totals": dict(engine.zen.totals),
            "refused": refused}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_inside_replica_groups(stage):
    """ZeRO-1/2 confined to each replica group by an mpu: inside a group the weights are equal after every
    step (ZeRO's all-gather), across the groups apart between outer steps and bitwise equal after each; the
    outer state is that of the rank's fp32 partition (about P/2 elements); checkpoints refused by name."""
    run = run_workers(_zero_groups_worker, 4, stage, timeout_s=600)
    for i in range(7):
        assert torch.equal(run[0]["params"][i], run[1]["params"][i])
        assert torch.equal(run[2]["params"][i], run[3]["params"][i])
        outer_step = (i + 1) % 3 == 0
        assert torch.equal(run[0]["params"][i], run[2]["params"][i]) == outer_step, i
        assert torch.equal(run[1]["parts"][i], run[3]["parts"][i]) == outer_step, i
    for r in run:
        assert r["state"] == r["formula"] == 12 * r["part_numel"]  # θ_global, e, momentum (fp32)
        assert r["p"] / 2 <= r["part_numel"] < r["p"] / 2 + 64  # a partition: half the weights, padded
        assert r["totals"]["outer_steps"] == 2 and 0 < r["totals"]["bytes_sent"]
        assert r["refused"].startswith(f"zen.outer on DeepSpeed ZeRO-{stage} inside replica groups: save_checkpoint")


def test_recipe_runs_with_outer_flags(tmp_path):
    """recipes/finetune_llm.py under torchrun with configs/demo_ds_outer.json, --outer_every 3 and --outer_delay 1:
    the start line names zen.outer and the overlap, the run ends with its summary (the last round flushed
    before the final eval), and eval losses are logged."""
    import json
    import subprocess
    import sys

    from tests.multiproc.launch import free_port

    out = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(free_port()), os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config",
           os.path.join(ROOT, "configs", "demo_ds_outer.json"), "--data", "pydoc", "--max_docs", "25",
           "--vocab_size", "512", "--seq_len", "64", "--steps", "6", "--eval_every", "3", "--output_dir", out,
           "--outer_every", "3", "--outer_density", "0.05", "--outer_delay", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "zen.outer on DeepSpeed ZeRO-0 (2 replicas): every 3 steps, density 0.05" in proc.stdout
    assert "scheme zen, delay 1 (overlapped)" in proc.stdout
    assert "zen.outer summary (2 replicas, 2 outer steps)" in proc.stdout
    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log if "eval_loss" in r] == [3, 6]
    assert log[-1]["bytes_sent"] < log[-1]["dense_bytes"]
