"""Fine-tune a causal LM with ColossalAI and ZEN gradient synchronization (data or tensor + data parallel).

The same models, data and tokenizer as the DeepSpeed recipe (recipes/common.py); the parallelism and
ZEN come from a ColossalAI JSON config (``configs/colossalai_*.json``: plugin, plugin_kwargs, zen,
train). Launch with torchrun or the ``deepspeed`` launcher (its ``--local_rank`` is accepted)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 recipes/finetune_llm_colossalai.py \\
        --config configs/colossalai_tp2_dgc.json --model configs/models/llama-tiny-untied.json \\
        --data pydoc --tokenizer train --steps 50 --output_dir runs/cai_tp2_dgc
    deepspeed --num_gpus 4 recipes/finetune_llm_colossalai.py --config ... (same arguments)

Outputs in ``--output_dir``, as the DeepSpeed recipe's (whose data, evaluation, progress bar and
output writers this recipe reuses): ``tokenizer.json`` (a trained tokenizer), ``train_log.jsonl``
(loss, tokens/s, bytes per step; eval loss), ``zen_stats.jsonl`` (ZEN's per-step record, rank 0),
``checkpoints/step_<n>/`` (model and optimizer through the booster, each rank's ZEN state, the step),
``summary.json`` and ``loss.png``, and a summary printed at the end (bytes vs dense all-reduce, loss
curve).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes import common  # noqa: E402


OPTIMIZERS = ("auto", "adamw", "catch_up_adamw")


@dataclass(kw_only=True)
class TrainSettings:
    """The ``"train"`` section of a ColossalAI config: what a DeepSpeed config says about batches and
    the optimizer (ColossalAI takes them as Python objects)."""

    micro_batch_size: int = 4
    """Sequences per data-parallel rank per micro-batch (TP ranks of a replica share it). Default 4."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; DDP (and ZEN) synchronize only the last one. Default 1."""
    lr: float = 1e-3
    """AdamW peak learning rate, > 0. Default 1e-3."""
    beta1: float = 0.9
    """AdamW beta1, in [0, 1). Default 0.9."""
    beta2: float = 0.95
    """AdamW beta2, in [0, 1). Default 0.95."""
    weight_decay: float = 0.0
    """AdamW weight decay, >= 0. Default 0."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 over this many steps (DeepSpeed's WarmupLR), >= 0. Default 0."""
    min_lr_ratio: float = 1.0
    """After the warm-up, a cosine decay to this fraction of ``lr`` at the run's last step (``--steps``),
    as DeepSpeed's WarmupCosineLR; in [0, 1], 1: constant. Default 1. Fine-tuning decays: DGC's gap to
    dense shrinks with it (benchmarks/quality/results/time_to_quality.md)."""
    optimizer: str = "auto"
    """``"adamw"`` (torch's AdamW), ``"catch_up_adamw"`` (``zen_ext.optim.CatchUpAdamW``: the tensors
    DGC sparsifies take a gradient held back for k steps as k steps' worth; the rest is AdamW) or
    ``"auto"``: ``"catch_up_adamw"`` when ``zen.dgc`` is on (it closes most of DGC's loss gap to dense),
    ``"adamw"`` otherwise. Default ``"auto"``."""

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSettings":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"train got unknown key(s) {unknown}; valid keys are {sorted(names)}")
        s = cls(**d)
        for f in dataclasses.fields(cls):
            v = getattr(s, f.name)
            if f.type == "str":
                if not isinstance(v, str):
                    raise TypeError(f"train.{f.name} ({v!r}) must be a string")
                continue
            want = (int,) if f.type == "int" else (int, float)
            if isinstance(v, bool) or not isinstance(v, want):
                raise TypeError(f"train.{f.name} ({v!r}) must be {'an integer' if f.type == 'int' else 'a number'}")
        rules = [("micro_batch_size", s.micro_batch_size >= 1, "be >= 1"),
                 ("gradient_accumulation_steps", s.gradient_accumulation_steps >= 1, "be >= 1"),
                 ("lr", s.lr > 0, "be > 0"), ("beta1", 0 <= s.beta1 < 1, "be in [0, 1)"),
                 ("beta2", 0 <= s.beta2 < 1, "be in [0, 1)"), ("weight_decay", s.weight_decay >= 0, "be >= 0"),
                 ("warmup_steps", s.warmup_steps >= 0, "be >= 0"),
                 ("min_lr_ratio", 0 <= s.min_lr_ratio <= 1, "be in [0, 1]"),
                 ("optimizer", s.optimizer in OPTIMIZERS, f"be one of {list(OPTIMIZERS)}")]
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"train.{name} ({getattr(s, name)!r}) must {rule}")
        return s


def lr_factor(train: TrainSettings, step: int, total_steps: int) -> float:
    """The learning rate at ``step`` as a fraction of ``train.lr``: the linear warm-up, then constant or
    a cosine decay to ``train.min_lr_ratio`` at ``total_steps``."""
    warmup = train.warmup_steps
    if step < warmup:
        return step / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_name(train: TrainSettings, zen) -> str:
    """``train.optimizer`` with ``"auto"`` decided: ``"catch_up_adamw"`` when zen's DGC is on."""
    if train.optimizer != "auto":
        return train.optimizer
    return "catch_up_adamw" if zen.enabled and zen.dgc.enabled else "adamw"


def build_optimizer(train: TrainSettings, zen, model) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``model``'s parameters, before the booster wraps it."""
    kw = dict(lr=train.lr, betas=(train.beta1, train.beta2), weight_decay=train.weight_decay)
    if optimizer_name(train, zen) == "catch_up_adamw":
        from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

        return CatchUpAdamW(catch_up_param_groups(model, zen), **kw)
    return torch.optim.AdamW(model.parameters(), **kw)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="ColossalAI JSON config (configs/colossalai_*.json)")
    common.add_run_args(p, default_output_dir="runs/colossalai")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    return p.parse_args(argv)


# --- pieces of the run ----------------------------------------------------------------------------------
def build_model(args, tokenizer):
    vocab = len(tokenizer) if args.model.endswith(".json") else None
    model = common.build_model(args.model, seed=args.seed, vocab_size=vocab)
    if model.config.model_type == "opt" and model.config._attn_implementation != "eager":
        # ColossalAI 0.5.0's OPT policy maps only eager and flash_attention_2 (sdpa: KeyError).
        model.config._attn_implementation = "eager"
    return model


def data_parallel(plugin) -> tuple[int, int, object]:
    """(dp_rank, dp_size, dp_group) of this rank: TP ranks of one replica read the same batches."""
    group = getattr(plugin, "dp_group", None)
    return dist.get_rank(group), dist.get_world_size(group), group


def save_checkpoint(booster, plugin, model, optimizer, scheduler, out_dir: str, step: int, rank: int,
                    optimizer_id: str) -> None:
    """Model and optimizer (sharded, through the booster), the scheduler, each rank's ZEN state, the step
    and the optimizer's name (``train.optimizer`` decided)."""
    path = os.path.join(out_dir, "checkpoints", f"step_{step}")
    os.makedirs(path, exist_ok=True)
    booster.save_model(model, os.path.join(path, "model"), shard=True)
    booster.save_optimizer(optimizer, os.path.join(path, "optimizer"), shard=True)
    booster.save_lr_scheduler(scheduler, os.path.join(path, "scheduler.pt"))
    if plugin.zen is not None:  # DGC residuals and momenta differ per rank
        torch.save(plugin.zen.state_dict(), os.path.join(path, f"zen_rank{rank:05d}.pt"))
    dist.barrier()
    common.save_optimizer_name(path, optimizer_id, rank)
    if rank == 0:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"step": step}, f)
        with open(os.path.join(out_dir, "checkpoints", "latest"), "w") as f:
            f.write(f"step_{step}")
    dist.barrier()


def load_checkpoint(booster, plugin, model, optimizer, scheduler, out_dir: str, rank: int,
                    optimizer_id: str) -> int:
    """Restore the latest checkpoint; returns its step (0 when there is none). One saved with another
    optimizer than ``optimizer_id`` is a ``ConfigError`` naming the ``train.optimizer`` to resume with."""
    latest = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(latest):
        return 0
    with open(latest) as f:
        path = os.path.join(out_dir, "checkpoints", f.read().strip())
    common.check_optimizer_name(path, optimizer_id, lambda saved: f'train.optimizer "{saved}"')
    booster.load_model(model, os.path.join(path, "model"))
    booster.load_optimizer(optimizer, os.path.join(path, "optimizer"))
    booster.load_lr_scheduler(scheduler, os.path.join(path, "scheduler.pt"))
    zen_path = os.path.join(path, f"zen_rank{rank:05d}.pt")
    if plugin.zen is not None and os.path.isfile(zen_path):
        plugin.zen.load_state_dict(torch.load(zen_path, map_location="cpu", weights_only=True))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)["step"]


# --- the run --------------------------------------------------------------------------------------------
def main(argv=None) -> list[dict]:
    """Run the fine-tuning; returns the per-step records (rank 0's view) for tests and scripts."""
    import colossalai

    from zen_ext.colossalai import ColossalAIConfig, build_booster
    from zen_ext.engines.colossalai_config import config_summary

    args = parse_args(argv)
    # Step 1: processes and config (validated before anything heavy runs).
    try:
        cfg = ColossalAIConfig.from_json(args.config)
        train = TrainSettings.from_dict(cfg.train)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise common.ConfigError(str(exc)) from exc
    if cfg.zen.enabled and cfg.zen.stats.jsonl_path is None:
        cfg.zen.stats.jsonl_path = os.path.join(args.output_dir, "zen_stats.jsonl")
    if not dist.is_initialized():
        colossalai.launch_from_torch(seed=args.seed, verbose=False)
    rank = dist.get_rank()
    os.makedirs(args.output_dir, exist_ok=True)

    # Step 2: data, model, booster.
    tokenizer, train_blocks, eval_blocks = common.prepare_data(args, rank)
    booster = build_booster(cfg)
    plugin = booster.plugin
    model = build_model(args, tokenizer)
    optimizer = build_optimizer(train, cfg.zen, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(train, s, args.steps))
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    zen = plugin.zen
    dp_rank, dp_size, dp_group = data_parallel(plugin)
    optimizer_id = optimizer_name(train, cfg.zen)  # recorded with each checkpoint, checked on resume
    start = (load_checkpoint(booster, plugin, model, optimizer, scheduler, args.output_dir, rank, optimizer_id)
             if args.resume else 0)
    micro, accum = train.micro_batch_size, train.gradient_accumulation_steps
    device = common.model_device(model)
    optimizer_text = optimizer_id
    if train.optimizer == "auto":  # say why: DGC under AdamW catches up
        optimizer_text += f" (auto: zen.dgc {'on' if cfg.zen.enabled and cfg.zen.dgc.enabled else 'off'})"
    if rank == 0:
        print(f"colossalai recipe: {config_summary(cfg)} world={dist.get_world_size()} dp={dp_size} "
              f"micro_batch={micro} accum={accum} train_blocks={len(train_blocks)} eval_blocks={len(eval_blocks)} "
              f"start_step={start} lr_schedule=warmup={train.warmup_steps},"
              f"{'constant' if train.min_lr_ratio == 1 else f'cosine_to={train.min_lr_ratio}@{args.steps}'} "
              f"optimizer={optimizer_text}", flush=True)

    # Step 3: train.
    batches = common.train_batches(train_blocks, micro, dp_rank, dp_size, seed=args.seed, start_step=start * accum)
    log = common.StepLog(args.output_dir, rank, start, args.steps)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for i in range(accum):
            batch = next(batches).to(device, non_blocking=True)  # DDP without device_ids does not move it
            last = i == accum - 1
            with _no_sync(booster, model, optimizer, not last):
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                loss_sum += loss.float().item()
                if last and zen is not None:
                    zen.annotate(loss=loss_sum / accum)  # the hook closes this step's record in backward
                booster.backward(loss / accum, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        rec = {"step": step, "loss": common.all_reduce_mean(loss_sum / accum, dp_group),
               "tokens_per_s": accum * micro * args.seq_len * dp_size / (time.perf_counter() - t0)}
        if zen is not None:
            rec["bytes_sent"] = zen.stats.totals["bytes_sent"]
            rec["dense_bytes"] = zen.stats.totals["dense_bytes"]
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            rec["eval_loss"] = common.evaluate(model, eval_blocks, micro, dp_rank, dp_size, dp_group)
        log.log(rec)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            save_checkpoint(booster, plugin, model, optimizer, scheduler, args.output_dir, step, rank,
                            optimizer_id)

    # Step 4: summary.
    text = zen.summary() if zen is not None else None
    log.close(text)
    if zen is not None:
        zen.close()
    return log.records


def _no_sync(booster, model, optimizer, skip: bool):
    """DDP's no_sync for the accumulating micro-batches (no gradient synchronization, no ZEN)."""
    from contextlib import nullcontext

    return booster.no_sync(model, optimizer) if skip else nullcontext()


if __name__ == "__main__":
    common.run_main(main)
    # DDP + gloo can abort at interpreter exit (gloo's pairs are torn down after the interpreter's state).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
