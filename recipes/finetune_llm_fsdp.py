"""Fine-tune a causal LM with torch FSDP2 (``fully_shard``) and ZEN's sparse reduce-scatter.

The model, data and tokenizer come from recipes/common.py, as in the DeepSpeed recipe. Each decoder
layer, the input embedding and the whole model are ``fully_shard``-ed; with a ``"zen"`` section in the
config, ``zen_ext.fsdp.attach`` sets ZEN's reduce-scatter on every FSDP module (docs/fsdp.md), without
one the run is plain FSDP2 (the dense baseline). Launch::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 recipes/finetune_llm_fsdp.py \\
        --config configs/fsdp2_zen_dgc5.json --output_dir runs/fsdp

The config is JSON: ``"fsdp"`` (the training settings below; unknown keys are refused) and an optional
``"zen"`` section. Outputs in ``--output_dir``: ``tokenizer.json``, ``train_log.jsonl`` (loss, tokens/s,
bytes per step, eval loss), ``summary.json``, ``loss.png``; each rank's peak resident memory is printed
at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes import common  # noqa: E402

FSDP_DEFAULTS = {"micro_batch": 8, "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01, "grad_clip": 1.0,
                 "param_dtype": "fp32"}
"""The ``"fsdp"`` section's keys: micro-batch per rank, AdamW's settings, the gradient-norm clip (0: off),
and the parameters' dtype (``fp32`` or ``bf16``: weights, gradients and the reduce-scatter in it)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON with an \"fsdp\" section and optionally a \"zen\" section")
    common.add_run_args(p, default_output_dir="runs/fsdp")
    return p.parse_args(argv)


def load_config(path: str) -> tuple[dict, dict | None]:
    """The ``"fsdp"`` settings (defaults filled in) and the ``"zen"`` section (None: plain FSDP2),
    validated before any process group, data or model exists."""
    from zen_ext.config import ZenConfig, load_json_config

    cfg = load_json_config(path)
    unknown = sorted(set(cfg) - {"fsdp", "zen", "_comment"})
    if unknown:
        raise common.ConfigError(f"config keys {unknown} must be among ['fsdp', 'zen']")
    fsdp = {**FSDP_DEFAULTS, **(cfg.get("fsdp") or {})}
    unknown = sorted(set(fsdp) - set(FSDP_DEFAULTS))
    if unknown:
        raise common.ConfigError(f"fsdp keys {unknown} must be among {sorted(FSDP_DEFAULTS)}")
    if fsdp["param_dtype"] not in DTYPES:
        raise common.ConfigError(f"fsdp.param_dtype ({fsdp['param_dtype']!r}) must be one of {sorted(DTYPES)}")
    zen = cfg.get("zen")
    try:
        if zen is not None and not ZenConfig.from_json_section(zen).enabled:
            zen = None
    except (ValueError, TypeError) as exc:
        raise common.ConfigError(str(exc)) from exc
    return fsdp, zen


def shard(model) -> int:
    """``fully_shard`` each decoder layer, the input embedding (its rows are naturally sparse: a bucket of
    their own) and the model; returns the number of FSDP modules."""
    from torch.distributed.fsdp import fully_shard

    units = [*model.model.layers, model.get_input_embeddings()]
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return len(units) + 1


def main(argv=None) -> list[dict]:
    """Run the fine-tuning; returns the per-step records (rank 0's view) for tests and scripts."""
    import zen_ext.fsdp

    args = parse_args(argv)
    # Step 1: config, processes.
    if args.resume or args.save_every:
        raise common.ConfigError("--resume and --save_every are not served by the FSDP2 recipe (no checkpoints yet); "
                                 "docs/fsdp.md shows how to save zen_ext's state next to a distributed checkpoint")
    fsdp, zen_section = load_config(args.config)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    dist.init_process_group("nccl" if device is not None else "gloo")
    if device is not None:
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.output_dir, exist_ok=True)

    # Step 2: data, model, FSDP2, ZEN.
    tokenizer, train_blocks, eval_blocks = common.prepare_data(args, rank)
    vocab = len(tokenizer) if args.model.endswith(".json") else None
    model = common.build_model(args.model, seed=args.seed, vocab_size=vocab, dtype=DTYPES[fsdp["param_dtype"]])
    if device is not None:
        model.to(device)
    units = shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=fsdp["lr"], betas=tuple(fsdp["betas"]),
                                  weight_decay=fsdp["weight_decay"])
    zen = zen_ext.fsdp.attach(model, zen_section, optimizer=optimizer) if zen_section is not None else None
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:
        print(f"fsdp recipe: zen={'on (' + zen.cfg.scheme + ')' if zen else 'off'} world={world} "
              f"fsdp_modules={units} param_dtype={fsdp['param_dtype']} micro_batch={fsdp['micro_batch']} "
              f"train_blocks={len(train_blocks)} eval_blocks={len(eval_blocks)}", flush=True)

    # Step 3: train.
    batches = common.train_batches(train_blocks, fsdp["micro_batch"], rank, world, seed=args.seed)
    log_file = open(os.path.join(args.output_dir, "train_log.jsonl"), "a") if rank == 0 else None
    progress = common.progress_bar(rank, 0, args.steps)
    records: list[dict] = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = next(batches).to(common.model_device(model))
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        if zen is not None:
            zen.annotate(loss=loss.item())  # the record closes at the end of the backward pass
        loss.backward()
        if fsdp["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        rec = {"step": step, "loss": common.all_reduce_mean(loss.item(), dist.group.WORLD),
               "tokens_per_s": fsdp["micro_batch"] * args.seq_len * world / (time.perf_counter() - t0)}
        if zen is not None:
            rec["bytes_sent"], rec["dense_bytes"] = zen.totals["bytes_sent"], zen.totals["dense_bytes"]
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            rec["eval_loss"] = common.evaluate(model, eval_blocks, fsdp["micro_batch"], rank, world, dist.group.WORLD)
        common.log_step(rec, log_file, records, progress)

    # Step 4: summary and each rank's peak memory (resident set: CPU tensors live there; KiB on Linux).
    text = zen.summary() if zen is not None else None
    peak = common.gather_peak_memory(world, peak_rss_at_start_mib=rss_start / 1024,
                                     cuda_peak_mib=torch.cuda.max_memory_allocated() / 2**20 if device else None)
    if rank == 0:
        log_file.close()
        common.write_outputs(args.output_dir, records, text)
        print("fsdp recipe: peak memory per rank: " + json.dumps(peak), flush=True)
    if zen is not None:
        zen.close()
    return records


if __name__ == "__main__":
    common.exit_on_config_error(main)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
