"""Fine-tune a causal LM with ColossalAI and ZEN gradient synchronization (data or tensor + data parallel).

The same models, data and tokenizer as the DeepSpeed recipe (recipes/common.py); the parallelism and
ZEN come from a ColossalAI JSON config (``configs/colossalai_*.json``: plugin, plugin_kwargs, zen,
train). Launch with torchrun or the ``deepspeed`` launcher (its ``--local_rank`` is accepted)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 recipes/finetune_llm_colossalai.py \\
        --config configs/colossalai_tp2_dgc.json --model configs/models/llama-tiny-untied.json \\
        --data pydoc --tokenizer train --steps 50 --output_dir runs/cai_tp2_dgc
    deepspeed --num_gpus 4 recipes/finetune_llm_colossalai.py --config ... (same arguments)

Outputs in ``--output_dir``: ``tokenizer.json`` (a trained tokenizer), ``train_log.jsonl`` (loss,
tokens/s, bytes per step; eval loss), ``zen_stats.jsonl`` (ZEN's per-step record, rank 0),
``checkpoints/step_<n>/`` (model and optimizer through the booster, each rank's ZEN state, the step),
and a summary printed at the end (bytes vs dense all-reduce, loss curve).
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


@dataclass(kw_only=True)
class TrainSettings:
    """The ``"train"`` section of a ColossalAI config (the recipe's knobs)."""

    micro_batch_size: int = 4
    """Sequences per data-parallel rank per micro-batch (TP ranks of a replica share it). Default 4."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; DDP (and ZEN) synchronize only the last one. Default 1."""
    seq_len: int = 128
    """Tokens per packed sequence. Default 128."""
    lr: float = 1e-3
    """AdamW learning rate, > 0. Default 1e-3."""
    weight_decay: float = 0.0
    """AdamW weight decay, >= 0. Default 0."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps, >= 0. Default 0."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end). Default 0."""
    eval_fraction: float = 0.05
    """Share of the packed blocks held out for evaluation, in [0, 0.5]. Default 0.05."""
    save_every: int = 0
    """Checkpoint every this many steps (0: only at the end). Default 0."""
    seed: int = 0
    """Seed of the model initialization and the data order. Default 0."""

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSettings":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"train got unknown key(s) {unknown}; valid keys are {sorted(names)}")
        s = cls(**d)
        for f in dataclasses.fields(cls):
            v = getattr(s, f.name)
            want = (int,) if f.type == "int" else (int, float)
            if isinstance(v, bool) or not isinstance(v, want):
                raise TypeError(f"train.{f.name} ({v!r}) must be {'an integer' if f.type == 'int' else 'a number'}")
        rules = [("micro_batch_size", s.micro_batch_size >= 1, "be >= 1"),
                 ("gradient_accumulation_steps", s.gradient_accumulation_steps >= 1, "be >= 1"),
                 ("seq_len", s.seq_len >= 2, "be >= 2"), ("lr", s.lr > 0, "be > 0"),
                 ("weight_decay", s.weight_decay >= 0, "be >= 0"), ("warmup_steps", s.warmup_steps >= 0, "be >= 0"),
                 ("eval_every", s.eval_every >= 0, "be >= 0"), ("save_every", s.save_every >= 0, "be >= 0"),
                 ("eval_fraction", 0 <= s.eval_fraction <= 0.5, "be in [0, 0.5]")]
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"train.{name} ({getattr(s, name)!r}) must {rule}")
        return s


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="ColossalAI JSON config (configs/colossalai_*.json)")
    p.add_argument("--model", default="configs/models/llama-tiny-untied.json",
                   help="HF name, checkpoint directory, or model-config JSON (random init)")
    p.add_argument("--data", default=common.BUILTIN_TEXT, help="pydoc, a .txt/.md/.jsonl file or directory, hf:<name>")
    p.add_argument("--tokenizer", default="train", help="HF name or path, or 'train' (BPE on the data)")
    p.add_argument("--vocab_size", type=int, default=1024, help="vocabulary of a trained tokenizer")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--max_docs", type=int, default=0, help="use only the first N documents (0: all)")
    p.add_argument("--output_dir", default="runs/colossalai")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    return p.parse_args(argv)


# --- pieces of the run ----------------------------------------------------------------------------------
def prepare_data(args, train: TrainSettings, rank: int):
    """Texts → tokenizer (trained once, on rank 0) → packed train/eval blocks."""
    texts = common.load_texts(args.data)
    if args.max_docs:
        texts = texts[: args.max_docs]
    if rank == 0:
        tokenizer = common.build_tokenizer(args.tokenizer, texts, args.output_dir, args.vocab_size)
    dist.barrier()
    if rank != 0:
        tokenizer = common.build_tokenizer(args.tokenizer, texts, args.output_dir, args.vocab_size)
    blocks = common.pack_tokens(texts, tokenizer, train.seq_len)
    return tokenizer, *common.split_blocks(blocks, train.eval_fraction, seed=train.seed)


def build_model(args, tokenizer, seed: int):
    model = common.build_model(args.model, seed=seed, vocab_size=len(tokenizer))
    if model.config.model_type == "opt" and model.config._attn_implementation != "eager":
        # ColossalAI 0.5.0's OPT policy maps only eager and flash_attention_2 (sdpa: KeyError).
        model.config._attn_implementation = "eager"
    return model


def data_parallel(plugin) -> tuple[int, int, object]:
    """(dp_rank, dp_size, dp_group) of this rank: TP ranks of one replica read the same batches."""
    group = getattr(plugin, "dp_group", None)
    return dist.get_rank(group), dist.get_world_size(group), group


def evaluate(model, blocks, micro_batch: int, dp_rank: int, dp_size: int, dp_group) -> float:
    """Mean loss over this replica's share of the eval blocks, averaged over the replicas."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in common.eval_batches(blocks, micro_batch, dp_rank, dp_size):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            total += torch.tensor([loss.item() * batch.shape[0], batch.shape[0]], dtype=torch.float64)
    model.train()
    dist.all_reduce(total, group=dp_group)
    return (total[0] / total[1]).item() if total[1] else float("nan")


def save_checkpoint(booster, plugin, model, optimizer, out_dir: str, step: int, rank: int) -> None:
    path = os.path.join(out_dir, "checkpoints", f"step_{step}")
    os.makedirs(path, exist_ok=True)
    booster.save_model(model, os.path.join(path, "model"), shard=True)
    booster.save_optimizer(optimizer, os.path.join(path, "optimizer"), shard=True)
    if plugin.zen is not None:  # DGC residuals and momenta differ per rank
        torch.save(plugin.zen.state_dict(), os.path.join(path, f"zen_rank{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"step": step}, f)
        with open(os.path.join(out_dir, "checkpoints", "latest"), "w") as f:
            f.write(f"step_{step}")
    dist.barrier()


def load_checkpoint(booster, plugin, model, optimizer, out_dir: str, rank: int) -> int:
    """Restore the latest checkpoint; returns its step (0 when there is none)."""
    latest = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(latest):
        return 0
    with open(latest) as f:
        path = os.path.join(out_dir, "checkpoints", f.read().strip())
    booster.load_model(model, os.path.join(path, "model"))
    booster.load_optimizer(optimizer, os.path.join(path, "optimizer"))
    zen_path = os.path.join(path, f"zen_rank{rank:05d}.pt")
    if plugin.zen is not None and os.path.isfile(zen_path):
        plugin.zen.load_state_dict(torch.load(zen_path, map_location="cpu", weights_only=False))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)["step"]


# --- the run --------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    """Run the fine-tuning; returns the final record (rank 0's view) for tests and scripts."""
    import colossalai

    from zen_ext.colossalai import ColossalAIConfig, build_booster
    from zen_ext.engines.colossalai import config_summary

    args = parse_args(argv)
    # Step 1: processes, config (validated before anything heavy runs).
    cfg = ColossalAIConfig.from_json(args.config)
    train = TrainSettings.from_dict(cfg.train)
    if cfg.zen.enabled and cfg.zen.stats.jsonl_path is None:
        cfg.zen.stats.jsonl_path = os.path.join(args.output_dir, "zen_stats.jsonl")
    if not dist.is_initialized():
        colossalai.launch_from_torch(seed=train.seed, verbose=False)
    rank = dist.get_rank()
    os.makedirs(args.output_dir, exist_ok=True)

    # Step 2: data, model, booster.
    tokenizer, train_blocks, eval_blocks = prepare_data(args, train, rank)
    booster = build_booster(cfg)
    plugin = booster.plugin
    model = build_model(args, tokenizer, train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    warmup = max(train.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    dp_rank, dp_size, dp_group = data_parallel(plugin)
    start = load_checkpoint(booster, plugin, model, optimizer, args.output_dir, rank) if args.resume else 0
    if rank == 0:
        print(f"colossalai recipe: {config_summary(cfg)} world={dist.get_world_size()} dp={dp_size} "
              f"train_blocks={len(train_blocks)} eval_blocks={len(eval_blocks)} start_step={start}", flush=True)

    # Step 3: train.
    accum = train.gradient_accumulation_steps
    batches = common.train_batches(train_blocks, train.micro_batch_size, dp_rank, dp_size, seed=train.seed,
                                   start_step=start * accum)
    log_path = os.path.join(args.output_dir, "train_log.jsonl")
    log_file = open(log_path, "a") if rank == 0 else None
    progress = _progress(rank, start, args.steps)
    rec: dict = {}
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for micro in range(accum):
            batch = next(batches)
            last = micro == accum - 1
            with _no_sync(booster, model, optimizer, not last):
                loss = model(input_ids=batch, labels=batch).loss
                loss_sum += loss.item()
                if last and plugin.zen is not None:
                    plugin.zen.annotate(loss=loss_sum / accum)  # the hook closes this step's record
                booster.backward(loss / accum, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        mean = torch.tensor([loss_sum / accum])
        dist.all_reduce(mean, group=dp_group)
        rec = {"step": step, "loss": mean.item() / dp_size,
               "tokens_per_s": accum * train.micro_batch_size * train.seq_len * dp_size / (time.perf_counter() - t0),
               "bytes_sent": plugin.zen.stats.totals["bytes_sent"] if plugin.zen is not None else None}
        if (train.eval_every and step % train.eval_every == 0) or step == args.steps:
            rec["eval_loss"] = evaluate(model, eval_blocks, train.micro_batch_size, dp_rank, dp_size, dp_group)
        if log_file is not None:
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
        progress(rec)
        if (train.save_every and step % train.save_every == 0) or step == args.steps:
            save_checkpoint(booster, plugin, model, optimizer, args.output_dir, step, rank)

    # Step 4: summary.
    if log_file is not None:
        log_file.close()
    if plugin.zen is not None:
        plugin.zen.summary()
        plugin.zen.close()
    return rec


def _no_sync(booster, model, optimizer, skip: bool):
    """DDP's no_sync for the accumulating micro-batches (no gradient synchronization, no ZEN)."""
    from contextlib import nullcontext

    return booster.no_sync(model, optimizer) if skip else nullcontext()


def _progress(rank: int, start: int, steps: int):
    """A tqdm bar on rank 0 showing loss, tokens/s and bytes communicated; a no-op elsewhere."""
    if rank != 0:
        return lambda rec: None
    from tqdm import tqdm

    from zen_ext.engines.stats import format_bytes

    bar = tqdm(total=steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout)

    def update(rec: dict) -> None:
        post = {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}"}
        if rec.get("bytes_sent") is not None:
            post["sent"] = format_bytes(rec["bytes_sent"])
        if "eval_loss" in rec and math.isfinite(rec["eval_loss"]):
            post["eval"] = f"{rec['eval_loss']:.4f}"
        bar.set_postfix(post)
        bar.update(1)
        if rec["step"] == steps:
            bar.close()

    return update


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # DDP + gloo can abort at interpreter exit (shared/research/feasibility.md §3a).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
