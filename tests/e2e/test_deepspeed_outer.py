"""zen.outer on real DeepSpeed engines (ZeRO-0, fp32, 3 gloo processes, tiny untied Llama): inner steps keep
each replica's own gradients, replicas are bitwise equal after each outer step and apart in between, a
run resumed from a mid-round DeepSpeed checkpoint equals the uninterrupted one bitwise (delay 0 and 1),
delay 1 keeps θ_global bitwise equal and flushes its last round, and what cannot be served is refused by
name. One process launch serves those tests (module fixture). ZeRO-1 and ZeRO-2 inside 2 replica groups of 2
ranks (4 gloo processes, one launch per stage serving its three tests): the same properties at delay 0 and
1, checkpoints per replica group resumed bitwise, and the late merge of delay 1 reaching the weights."""

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
                saved_totals.update(engine.zen.totals)
        engine.zen.finish()
        return params, thetas, _flat(engine.module), torch.cat([b.theta_N for b in engine.zen.outer.buckets])

    saved_totals = {}
    engine = _engine(_cfg(delay=1))
    full = steps(engine, 1, 9, save=True)
    totals = dict(engine.zen.totals)
    engine.zen.close()
    resumed_engine = _engine(_cfg(delay=1))
    resumed_engine.load_checkpoint(ckpt_dir, tag="step4")
    loaded_totals = dict(resumed_engine.zen.totals)
    resumed = steps(resumed_engine, 5, 9)
    resumed_engine.zen.close()
    return {"full": full, "resumed": resumed, "totals": totals, "saved_totals": saved_totals,
            "loaded_totals": loaded_totals}


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
        # the round the checkpoint waited for counts in the totals it saves (round 1's sum: bytes sent)
        assert r["delayed"]["loaded_totals"] == r["delayed"]["saved_totals"]
        assert r["delayed"]["saved_totals"]["bytes_sent"] > 0
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


def _zero_state(engine):
    """What a resumed ZeRO-1/2 run must reproduce bitwise: the weights, the rank's fp32 partition, the inner
    optimizer's (Adam's) state of that partition, the OuterSync state (θ_global, e, momentum, anchor)."""
    opt, outer = engine.optimizer, engine.zen.outer.state_dict()
    return {"params": _flat(engine.module),
            "parts": torch.cat([t.detach().clone() for t in opt.single_partition_of_fp32_groups]),
            "adam": [t.clone() for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)],
            "outer": [b[k] for b in outer["buckets"] for k in ("theta", "error", "momentum", "anchor")],
            "in_flight": [b["in_flight"] for b in outer["buckets"]]}


def _lp_is_fp32(engine):
    """The rank's slice of the model's flat weights equals its fp32 partition (``update_lp_params`` ran)."""
    opt = engine.optimizer
    return all(torch.equal(lp[torch.distributed.get_rank(opt.real_dp_process_group[i])], fp32)
               for i, (lp, fp32) in enumerate(zip(opt.parallel_partitioned_bit16_groups,
                                                  opt.single_partition_of_fp32_groups)))


def _zero_groups_worker(rank, world, stage, ckpt_dir):
    """4 ranks as 2 replica groups of 2 ({0, 1}, {2, 3}), ZeRO-``stage`` inside each: delay 0 for 7 steps with
    a checkpoint at step 4 (tag and ``latest`` by default), resumed to 7; delay 1 for 9 steps (outer steps at
    3, 6, 9) with a checkpoint at step 4 (round 1 in flight), ``finish``, resumed to 9."""
    import logging

    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model
    from zen_ext.outer.sync import state_bytes_per_param

    dps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(world)]
    mpu = _ReplicaMPU(dps[rank // 2], alone[rank])

    def build(delay):
        engine, *_ = zds.initialize(model=build_model(MODEL, seed=0), config=_cfg(stage, delay=delay), mpu=mpu)
        return engine

    def steps(engine, first, last, save=None):
        rec = {"params": [], "parts": [], "lp": [], "pre": {}, "theta": {}}
        outer = engine.zen.outer
        orig = outer.outer_step

        def outer_step():  # the partition the outer step starts from (θ_local after the inner step)
            rec["pre"][outer.inner_steps] = torch.cat([outer._read(b) for b in outer.buckets])
            orig()

        outer.outer_step = outer_step
        for step in range(first, last + 1):
            x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            rec["params"].append(_flat(engine.module))
            rec["parts"].append(torch.cat([t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]))
            rec["lp"].append(_lp_is_fp32(engine))
            if step % 3 == 0 and outer.cfg.delay:  # state_dict waits for the round's sum, merges nothing
                rec["theta"][step] = torch.cat([b["theta"] for b in outer.state_dict()["buckets"]])
            if step == save:
                if outer.cfg.delay:
                    engine.save_checkpoint(os.path.join(ckpt_dir, "d1"), tag="mid")
                else:
                    engine.save_checkpoint(os.path.join(ckpt_dir, "d0"))  # tag global_step4, `latest` names it
        rec["state"] = _zero_state(engine)
        return rec

    out = {}
    engine = build(0)
    out["d0"] = steps(engine, 1, 7, save=4)
    o = engine.zen.outer
    out.update(state=o.state_bytes(), formula=state_bytes_per_param(o.cfg) * sum(b.numel for b in o.buckets),
               part_numel=out["d0"]["parts"][-1].numel(), p=out["d0"]["params"][-1].numel(),
               totals=dict(engine.zen.totals), replica=engine.zen.replica,
               files=sorted(os.path.relpath(os.path.join(d, f), ckpt_dir) for d, _, fs in os.walk(ckpt_dir) for f in fs),
               latest=open(os.path.join(ckpt_dir, "d0", "latest")).read())
    engine.zen.close()
    resumed = build(0)
    resumed.load_checkpoint(os.path.join(ckpt_dir, "d0"))
    out["d0_resumed"] = steps(resumed, 5, 7)
    resumed.zen.close()
    # Every rank's file claims the other replica group: each rank refuses it (after DeepSpeed's load).
    path = os.path.join(ckpt_dir, "d0", "global_step4", "zen_ext", f"outer_rank{rank}.pt")
    sd = torch.load(path, weights_only=False)
    torch.save(dict(sd, replica=1 - sd["replica"]), path)
    dist.barrier()
    wrong = build(0)
    try:
        wrong.load_checkpoint(os.path.join(ckpt_dir, "d0"))
    except ValueError as exc:
        out["wrong_group"] = str(exc)
    wrong.zen.close()

    engine = build(1)
    out["d1"] = steps(engine, 1, 9, save=4)
    engine.zen.finish()
    out["d1_final"] = {"params": _flat(engine.module), "lp": _lp_is_fp32(engine), "state": _zero_state(engine),
                       "theta": torch.cat([b.theta_N for b in engine.zen.outer.buckets]),
                       "totals": dict(engine.zen.totals)}
    engine.zen.close()
    resumed = build(1)
    resumed.load_checkpoint(os.path.join(ckpt_dir, "d1"), tag="mid")
    out["d1_resumed"] = steps(resumed, 5, 9)
    resumed.zen.finish()
    out["d1_resumed_final"] = _zero_state(resumed)
    resumed.zen.close()
    return out


def _same_state(a, b):
    return (all(torch.equal(a[k], b[k]) for k in ("params", "parts")) and a["in_flight"] == b["in_flight"]
            and len(a["adam"]) == len(b["adam"]) > 0 and all(torch.equal(x, y) for x, y in zip(a["adam"], b["adam"]))
            and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a["outer"], b["outer"])))


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def zero_run(request, tmp_path_factory):
    stage = request.param
    return stage, run_workers(_zero_groups_worker, 4, stage, str(tmp_path_factory.mktemp(f"zero{stage}")),
                              timeout_s=600)


def test_zero_inside_replica_groups(zero_run):
    """ZeRO-1/2 confined to each replica group by an mpu: inside a group the weights are equal after every
    step (ZeRO's all-gather), across the groups apart between outer steps and bitwise equal after each; the
    outer state is that of the rank's fp32 partition (about P/2 elements)."""
    stage, run = zero_run
    for i in range(7):
        p = [r["d0"]["params"][i] for r in run]
        assert torch.equal(p[0], p[1]) and torch.equal(p[2], p[3])
        outer_step = (i + 1) % 3 == 0
        assert torch.equal(p[0], p[2]) == outer_step, i
        assert torch.equal(run[1]["d0"]["parts"][i], run[3]["d0"]["parts"][i]) == outer_step, i
        assert all(r["d0"]["lp"][i] for r in run)
    for r in run:
        assert r["state"] == r["formula"] == 12 * r["part_numel"]  # θ_global, e, momentum (fp32)
        assert r["p"] / 2 <= r["part_numel"] < r["p"] / 2 + 64  # a partition: half the weights, padded
        assert r["totals"]["outer_steps"] == 2 and 0 < r["totals"]["bytes_sent"]
    assert [r["replica"] for r in run] == [0, 0, 1, 1]


def test_zero_checkpoint_per_replica_group_resumes_bitwise(zero_run):
    """save_checkpoint under ZeRO-1/2 writes each replica group's DeepSpeed checkpoint into a directory of its
    own (no file written twice) and each rank's OuterSync state; a run resumed mid-round (step 4, through
    ``latest``) equals the uninterrupted one bitwise at every step: weights, fp32 partition, Adam's state,
    θ_global, e, momentum; a rank whose per-rank file another replica group saved refuses it."""
    stage, run = zero_run
    for r in run:
        full, res = r["d0"], r["d0_resumed"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], full["params"][4:]))
        assert all(torch.equal(a, b) for a, b in zip(res["parts"], full["parts"][4:]))
        assert _same_state(res["state"], full["state"])
    files = run[0]["files"]
    assert [f for f in files if os.path.basename(f) == "latest"] == ["d0/latest"]  # one, where DeepSpeed's is
    assert run[0]["latest"] == "global_step4"
    for g in (0, 1):
        for dp in (0, 1):
            assert f"d0/global_step4/replica{g}/global_step4/zero_pp_rank_{dp}_mp_rank_00_optim_states.pt" in files
        assert f"d0/global_step4/replica{g}/global_step4/mp_rank_00_model_states.pt" in files
    assert [f for f in files if f.startswith("d0/global_step4/zen_ext/")] == [
        f"d0/global_step4/zen_ext/outer_rank{r}.pt" for r in range(4)]
    assert not torch.equal(run[0]["d0_resumed"]["params"][0], run[2]["d0_resumed"]["params"][0])  # mid-round
    for rank, r in enumerate(run):
        assert f"was saved by a rank of replica group {1 - rank // 2}, this rank is in {rank // 2}: resume with the " \
               f"same replica groups" in r["wrong_group"]


def test_zero_delay_1_merges_into_the_weights(zero_run):
    """delay 1 under ZeRO-1/2: θ_global bitwise equal across the replica groups after each round's sum; each
    late merge is the documented one, θ_local ← θ_global(round t−1) + (θ_local − θ_a), computed here from the
    recorded partitions, and reaches the weights (the model's slice equals the fp32 partition after every
    step and after ``finish``); ``finish`` leaves every replica at θ_global; resumed from a checkpoint with a
    round in flight, bitwise equal to the uninterrupted run."""
    stage, run = zero_run
    for r, peer in zip(run, (run[2], run[3], run[0], run[1])):
        d1 = r["d1"]
        assert sorted(d1["theta"]) == [3, 6, 9] and all(torch.equal(d1["theta"][s], peer["d1"]["theta"][s])
                                                        for s in (3, 6, 9))
        assert torch.equal(d1["parts"][2], d1["pre"][3])  # the first outer step: nothing in flight to merge
        for s in (6, 9):  # the anchor is the partition right after the previous outer step
            merged = torch.sub(d1["pre"][s], d1["parts"][s - 4]).add_(d1["theta"][s - 3])
            assert torch.equal(d1["parts"][s - 1], merged), s
            assert not torch.equal(d1["parts"][s - 1], d1["pre"][s]), s
        assert all(d1["lp"])
        fin = r["d1_final"]
        assert fin["lp"] and torch.equal(fin["state"]["parts"], fin["theta"]) and torch.equal(fin["theta"],
                                                                                                 d1["theta"][9])
        assert torch.equal(fin["params"], run[0]["d1_final"]["params"])  # every replica at θ_global
        assert fin["totals"]["outer_steps"] == 3
        res = r["d1_resumed"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], d1["params"][4:])) and all(res["lp"])
        assert all(torch.equal(res["theta"][s], d1["theta"][s]) for s in (6, 9))
        assert _same_state(r["d1_resumed_final"], fin["state"])
    assert not torch.equal(run[0]["d1"]["params"][5], run[2]["d1"]["params"][5])  # each carries its own round


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
