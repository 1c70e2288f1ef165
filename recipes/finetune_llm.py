"""Fine-tune a causal LM with DeepSpeed and ZEN gradient synchronization (data or AutoTP + data parallel).

The model, data and tokenizer come from recipes/common.py (an HF name or a model-config JSON; HF
dataset, local text/JSONL or the built-in ``pydoc`` text; an HF tokenizer or one trained on the
data). Parallelism, precision, optimizer and ZEN come from the DeepSpeed config: a ``"zen"`` section
turns ZEN on (docs/deepspeed.md), without one the run is DeepSpeed's dense baseline. Launch::

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 recipes/finetune_llm.py \\
        --deepspeed_config configs/demo_ds.json --output_dir runs/demo
    deepspeed --hostfile launch/hostfile.example recipes/finetune_llm.py --deepspeed_config ... (multi-node)
    torchrun --nproc_per_node 8 recipes/finetune_llm.py --deepspeed_config ... (same arguments)

Outputs in ``--output_dir``: ``tokenizer.json`` (a trained tokenizer, reused on resume),
``train_log.jsonl`` (loss, tokens/s, bytes per step; eval loss), ``zen_stats.jsonl`` (ZEN's per-step
record), ``checkpoints/`` (DeepSpeed checkpoints with each rank's ZEN state), ``summary.json`` (with
``--memory_report`` each rank's memory: ``recipes/memory_report.py``) and
``loss.png``, and a summary printed at the end (bytes vs dense all-reduce, scheme choices, loss curve).

``zen.outer`` (``--outer_every`` and friends, docs/outer.md) trains replicas with local steps: under ZeRO-0
every rank is one; under ZeRO-1/2 ``--replicas R`` makes R replica groups of world/R consecutive ranks
(``zen_ext.engines.deepspeed_replicas``), ZeRO partitions inside each and the outer sync runs across them.
DeepSpeed's data-parallel group is then the replica group, so the data is sharded over the whole world
(every rank a share of its own) and the logged losses are means over every rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes import common, memory_report  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config, optionally with a \"zen\" section")
    common.add_run_args(p, default_output_dir="runs/deepspeed")
    p.add_argument("--save_model", default=None, help="save the final model and tokenizer here with save_pretrained "
                   "(a later run fine-tunes from it: --model DIR --tokenizer DIR)")
    p.add_argument("--frozen_variance_after", default=None, help=argparse.SUPPRESS)  # removed: load_ds_config
    common.add_optimizer_args(p)
    common.add_outer_args(p)
    p.add_argument("--replicas", type=int, default=None,
                   help="zen.outer under ZeRO-1/2: R replica groups of world/R consecutive ranks, ZeRO partitioned "
                   "inside each, the outer sync across them (ZeRO-0 needs none: every rank is a replica)")
    p.add_argument("--memory_report", action="store_true", help="each rank's resident memory after engine init and "
                   "over the training steps, and zen_ext's state bytes, into summary.json (recipes/memory_report.py)")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args(argv)


# --- pieces of the run ----------------------------------------------------------------------------------
def load_ds_config(args) -> dict:
    """The DeepSpeed config, with ZEN's statistics file defaulted into the output directory and a
    scheduler's ``"total_num_steps": "auto"`` (HF Trainer's DeepSpeed convention) set to ``--steps``."""
    from zen_ext.config import load_json_config

    from zen_ext.config import ZenConfig

    ds = copy.deepcopy(load_json_config(args.deepspeed_config))
    common.apply_outer_args(args, ds)  # --outer_every and friends into zen.outer
    try:  # validated again inside initialize; here it fails before processes, data and model exist
        ZenConfig.from_ds_config(ds)
    except (ValueError, TypeError) as exc:
        raise common.ConfigError(str(exc)) from exc
    if args.frozen_variance_after is not None:
        raise common.ConfigError("--frozen_variance_after was removed (its optimizer measured worse than CatchUpAdamW, "
                                 "the default under DGC: docs/results/dgc_history.md); remove the flag")
    opt_type = (ds.get("optimizer") or {}).get("type")
    flags = [f for f, on in (("--catch_up_adam", args.catch_up_adam), ("--plain_adam", args.plain_adam)) if on]
    if len(flags) > 1:
        raise common.ConfigError(f"{' and '.join(flags)} each choose the optimizer: choose one")
    chosen = flags[0] if flags and not args.plain_adam else None
    if chosen and str(opt_type).lower() not in ("adam", "adamw"):
        raise common.ConfigError(f"{chosen} needs an Adam or AdamW \"optimizer\" section in the DeepSpeed config, "
                                 f"got {opt_type!r}")
    sched = (ds.get("scheduler") or {}).get("params") or {}
    if sched.get("total_num_steps") == "auto":  # a decaying rate ends with the run, whatever its length
        sched["total_num_steps"] = args.steps
    for section in ("optimizer", "scheduler"):  # HF Trainer fills other "auto"s from its arguments; we cannot
        for key, value in ((ds.get(section) or {}).get("params") or {}).items():
            if value == "auto":
                raise common.ConfigError(f"{section}.params.{key} (\"auto\") must be a number: this recipe fills "
                                         f"only scheduler.params.total_num_steps (with --steps)")
    zen = ds.get("zen")
    if isinstance(zen, dict) and zen.get("enabled", True):
        stats = zen.setdefault("stats", {})
        if stats.get("jsonl_path") is None:
            stats["jsonl_path"] = os.path.join(args.output_dir, "zen_stats.jsonl")
    return ds


def check_replicas(replicas: int | None, ds_config: dict) -> None:
    """``--replicas`` against the config, before any process group exists: it serves ``zen.outer`` under
    ZeRO-1/2 (R replica groups, ZeRO inside each), and ZeRO-1/2 under ``zen.outer`` need it.

    Raises:
        common.ConfigError: ``--replicas`` without ``zen.outer``, under ZeRO-0 or ZeRO-3, or below 2;
            ``zen.outer`` under ZeRO-1/2 without ``--replicas``.
    """
    from zen_ext.config import ZenConfig

    zen = ZenConfig.from_ds_config(ds_config)  # validated by load_ds_config
    outer = zen.enabled and zen.outer.enabled
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if replicas is None:
        if outer and stage in (1, 2):
            raise common.ConfigError(f"zero_optimization.stage ({stage}) with zen.outer must come with --replicas R: "
                                     f"ZeRO-{stage} partitions inside each of R replica groups of world/R ranks and "
                                     f"the outer sync runs across them (or use stage 0: every rank a replica)")
        return
    if not outer:
        raise common.ConfigError(f"--replicas ({replicas}) must come with zen.outer (--outer_every H, or "
                                 f"zen.outer.enabled in the config): without it nothing would synchronize the "
                                 f"replica groups")
    if stage == 0:
        raise common.ConfigError(f"--replicas ({replicas}) must be left out under ZeRO-0: zen.outer already makes "
                                 f"every rank a replica of its own there; --replicas groups ranks for ZeRO-1/2")
    if stage not in (1, 2):
        raise common.ConfigError(f"--replicas ({replicas}) must be used with zero_optimization.stage 1 or 2, got "
                                 f"{stage}: zen.outer does not serve ZeRO-3 (its parameters are partitioned too)")
    if replicas < 2:
        raise common.ConfigError(f"--replicas ({replicas}) must be >= 2 with zen.outer (the outer sync runs across "
                                 f"replicas)")


def replica_mpu(replicas: int | None):
    """The DeepSpeed ``mpu`` of ``--replicas`` (``zen_ext.engines.deepspeed_replicas``), None without it.

    Raises:
        common.ConfigError: ``replicas`` does not divide the world size.
    """
    if replicas is None:
        return None
    world = dist.get_world_size()
    if world % replicas:
        raise common.ConfigError(f"--replicas ({replicas}) must divide the world size ({world})")
    from zen_ext.engines.deepspeed_replicas import replica_mpu as build

    return build(replicas)


def optimizer_choice(args, ds_config: dict) -> tuple[str, str]:
    """Which optimizer the run trains with, and why (for the start line): ``"catch_up"``
    (``--catch_up_adam``, or the default for DGC under an Adam/AdamW config: it closes most of DGC's loss
    gap to dense, README "Time to quality") or ``"config"`` (the config's optimizer: no DGC, not Adam, or
    ``--plain_adam``)."""
    zen = ds_config.get("zen")
    dgc_on = (isinstance(zen, dict) and zen.get("enabled", True) and isinstance(zen.get("dgc"), dict)
              and zen["dgc"].get("enabled", False))
    opt_type = str((ds_config.get("optimizer") or {}).get("type")).lower()
    return common.optimizer_choice(args, bool(dgc_on), opt_type in ("adam", "adamw"))


def optimizer_identity(args, ds_config: dict) -> str:
    """The name a checkpoint records for the run's optimizer (``common.save_optimizer_name``):
    ``CatchUpAdamW`` or the config's optimizer type."""
    kind, _ = optimizer_choice(args, ds_config)
    return "CatchUpAdamW" if kind == "catch_up" else str((ds_config.get("optimizer") or {}).get("type"))


def _flag_for(saved: str) -> str:
    """What brings back the optimizer a checkpoint was saved with (``optimizer_identity``'s names)."""
    if saved == "CatchUpAdamW":
        return "--catch_up_adam"
    return f"--plain_adam and the config's optimizer {saved}"


def client_optimizer(args, ds_config: dict, model):
    """CatchUpAdamW when ``optimizer_choice`` says so, built from the config's Adam/AdamW settings, whose
    ``optimizer`` section is then removed (DeepSpeed takes one or the other); ``None`` for the config's
    optimizer."""
    kind, _ = optimizer_choice(args, ds_config)
    if kind == "config":
        return None
    from zen_ext.config import ZenConfig
    from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

    params = (ds_config.pop("optimizer", None) or {}).get("params", {})  # checked by load_ds_config
    ds_config.setdefault("zero_allow_untested_optimizer", True)  # ZeRO 1-2 wrap any torch optimizer
    kw = dict(lr=params.get("lr", 1e-3), betas=tuple(params.get("betas", (0.9, 0.999))), eps=params.get("eps", 1e-8),
              weight_decay=params.get("weight_decay", 0.01))
    return CatchUpAdamW(catch_up_param_groups(model, ZenConfig.from_ds_config(ds_config)), **kw)


def _describe_optimizer(client, ds_config: dict) -> str:
    """The optimizer in one token for the start line, e.g. ``CatchUpAdamW(catch_up=15/21)`` (tensors that
    catch up / all) or the config's ``AdamW``."""
    if client is None:
        return str((ds_config.get("optimizer") or {}).get("type"))
    if "catch_up" in client.defaults:
        n = [(len(g["params"]), g["catch_up"]) for g in client.param_groups]
        return f"{type(client).__name__}(catch_up={sum(k for k, c in n if c)}/{sum(k for k, _ in n)})"
    if "freeze_after" in client.defaults:
        return f"{type(client).__name__}(freeze_after={client.defaults['freeze_after']})"
    return type(client).__name__


def _describe_schedule(ds_config: dict) -> str:
    """The scheduler in one token for the start line, e.g. ``WarmupCosineLR(warmup=100,total=1000,min=0.1)``."""
    sched = ds_config.get("scheduler")
    if not sched:
        return "none"
    p = sched.get("params") or {}
    parts = [f"warmup={p['warmup_num_steps']}" if "warmup_num_steps" in p else None,
             f"total={p['total_num_steps']}" if "total_num_steps" in p else None,
             f"min={p['cos_min_ratio']}" if "cos_min_ratio" in p else None]
    return f"{sched.get('type')}({','.join(x for x in parts if x)})"


# --- the run --------------------------------------------------------------------------------------------
def main(argv=None) -> list[dict]:
    """Run the fine-tuning; returns the per-step records (rank 0's view) for tests and scripts."""
    import deepspeed

    import zen_ext.deepspeed

    args = parse_args(argv)
    # Step 1: processes and config (the "zen" section is validated inside initialize, before any step).
    ds_config = load_ds_config(args)
    check_replicas(args.replicas, ds_config)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    mpu = replica_mpu(args.replicas)  # zen.outer under ZeRO-1/2: ZeRO inside each replica group
    os.makedirs(args.output_dir, exist_ok=True)

    # Step 2: data, model, engine.
    tokenizer, train_blocks, eval_blocks = common.prepare_data(args, rank)
    vocab = len(tokenizer) if args.model.endswith(".json") else None
    model = common.build_model(args.model, seed=args.seed, vocab_size=vocab)
    optimizer_why = optimizer_choice(args, ds_config)[1]  # before client_optimizer takes the config's section
    optimizer_id = optimizer_identity(args, ds_config)
    optimizer = client_optimizer(args, ds_config, model)
    optimizer_text = _describe_optimizer(optimizer, ds_config)  # before ZeRO flattens the groups
    engine, _, _, _ = zen_ext.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                                   optimizer=optimizer, mpu=mpu)
    zen = getattr(engine, "zen", None)
    memory = memory_report.MemoryReport() if args.memory_report else None
    if args.save_model and engine.zero_optimization_stage() >= 3:
        raise common.ConfigError(f"--save_model ({args.save_model}) needs ZeRO stage 0, 1 or 2: ZeRO-3 partitions "
                                 "the parameters across ranks")
    dp_group = engine.data_parallel_group  # with AutoTP: the replicas; TP ranks of one replica share batches
    dp_size = dist.get_world_size(dp_group)
    data_group, data_rank, data_size = dp_group, dist.get_rank(dp_group), dp_size  # who reads which batches
    if mpu is not None:  # DeepSpeed's data-parallel group is the replica group: every rank of the world a share
        data_group, data_rank, data_size = dist.group.WORLD, mpu.data_rank, mpu.data_world
    ckpt_dir = os.path.join(args.output_dir, "checkpoints")
    start = 0
    if args.resume and os.path.isfile(os.path.join(ckpt_dir, "latest")):
        with open(os.path.join(ckpt_dir, "latest")) as f:  # DeepSpeed's pointer to the newest tag
            common.check_optimizer_name(os.path.join(ckpt_dir, f.read().strip()), optimizer_id, _flag_for,
                                        optimizer_why)
        engine.load_checkpoint(ckpt_dir)
        start = engine.global_steps
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    device = common.model_device(engine)
    if rank == 0:
        print(f"deepspeed recipe: zen={'on (' + zen.cfg.scheme + ')' if zen else 'off'} ZeRO-"
              f"{engine.zero_optimization_stage()} world={dist.get_world_size()} dp={dp_size} micro_batch={micro} "
              f"accum={accum} train_blocks={len(train_blocks)} eval_blocks={len(eval_blocks)} start_step={start} "
              f"lr_schedule={_describe_schedule(ds_config)} optimizer={optimizer_text} ({optimizer_why})",
              flush=True)
        if mpu is not None:
            print(f"deepspeed recipe: replicas: {mpu.describe()}, ZeRO-{engine.zero_optimization_stage()} inside "
                  f"each, zen.outer across them; data sharded over all {data_size} ranks (rank r reads share r)",
                  flush=True)
        if zen and zen.cfg.dgc.enabled and optimizer_text.lower() in ("adam", "adamw"):
            print("deepspeed recipe: hint: DGC under plain Adam ends well above dense's loss; CatchUpAdamW (the "
                  "default without --plain_adam) closes most of that gap (docs/results/time_to_quality_history.md)",
                  flush=True)

    # Step 3: train.
    if memory is not None:
        memory.at_init()  # after data, model and engine: the peak from here on is the training steps'
    batches = common.train_batches(train_blocks, micro, data_rank, data_size, seed=args.seed, start_step=start * accum)
    log = common.StepLog(args.output_dir, rank, start, args.steps)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for _ in range(accum):
            batch = next(batches).to(device, non_blocking=True)  # engine(...) does not move inputs
            loss = engine(input_ids=batch, labels=batch, use_cache=False).loss
            loss_sum += loss.float().item()
            if zen is not None:
                zen.annotate(loss=loss_sum / accum)  # the step wrapper closes this step's record
            engine.backward(loss)
            engine.step()
        step_s = time.perf_counter() - t0  # the step alone: evaluation and checkpoints come after
        if step == args.steps and zen is not None and hasattr(zen, "finish"):
            zen.finish()  # zen.outer.delay 1: the last round's sum is applied before the final eval and save
        rec = {"step": step, "loss": common.all_reduce_mean(loss_sum / accum, data_group), "step_s": step_s,
               "tokens_per_s": accum * micro * args.seq_len * data_size / step_s}
        if zen is not None:
            rec["bytes_sent"] = zen.totals["bytes_sent"]
            rec["dense_bytes"] = zen.totals["dense_bytes"]
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            rec["eval_loss"] = common.evaluate(engine, eval_blocks, micro, data_rank, data_size, data_group)
        log.log(rec)
        if memory is not None and step == args.steps:  # before the checkpoint save's copies
            memory.at_train_end(zen, engine.module)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            engine.save_checkpoint(ckpt_dir, tag=f"step{step}")
            common.save_optimizer_name(os.path.join(ckpt_dir, f"step{step}"), optimizer_id, rank)

    # Step 4: summary, each rank's peak memory (resident set: CPU tensors live there; KiB on Linux), and the
    # final model where asked (ZeRO-1/2 keep full parameters on every rank).
    text = zen.summary() if zen is not None else None
    peak = common.gather_peak_memory(dist.get_world_size(), **(memory.rec if memory is not None else {}))
    log.close(text, {"memory": peak} if memory is not None else None)
    if rank == 0:
        print("deepspeed recipe: peak memory per rank: " + json.dumps(peak), flush=True)
        if args.save_model:
            engine.module.save_pretrained(args.save_model, safe_serialization=True)
            tokenizer.save_pretrained(args.save_model)
            print(f"deepspeed recipe: final model and tokenizer saved to {args.save_model}", flush=True)
    if zen is not None:
        zen.close()
    return log.records


if __name__ == "__main__":
    common.run_main(main)
