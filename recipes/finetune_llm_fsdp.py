"""Fine-tune a causal LM with torch FSDP2 (``fully_shard``) and ZEN's sparse reduce-scatter.

The model, data and tokenizer come from recipes/common.py, as in the DeepSpeed recipe (any HF causal LM
it trains). Each transformer block (the classes the model's ``_no_split_modules`` names, as HF and
Accelerate find them), the input embedding and the whole model are ``fully_shard``-ed; a unit whose
parameters are shared with a module outside it (a tied input embedding and LM head) stays in the root
unit, so the tie holds. With a ``"zen"`` section in the config, ``zen_ext.fsdp.attach`` sets ZEN's
reduce-scatter on every FSDP module (docs/fsdp.md); without one the run is plain FSDP2 (the dense
baseline). ``--replicas R`` shards over a 2-D ``(replicate, shard)`` mesh of R replica groups (HSDP). With
``zen.outer`` on (``--outer_every`` and friends) each replica group trains alone and the outer
synchronization runs across the replicas on each rank's shard (``zen_ext.engines.fsdp_outer``,
docs/outer.md); without ``--replicas`` every rank is a replica of its own. Launch::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 recipes/finetune_llm_fsdp.py \\
        --config configs/fsdp2_zen_dgc5.json --output_dir runs/fsdp

The config is JSON: ``"fsdp"`` (the training settings below; unknown keys are refused) and an optional
``"zen"`` section. Outputs in ``--output_dir``: ``tokenizer.json``, ``train_log.jsonl`` (loss, tokens/s,
bytes per step, eval loss), ``checkpoints/`` (``torch.distributed.checkpoint`` folders with each rank's
ZEN state: recipes/fsdp_checkpoint.py), ``summary.json``, ``loss.png``; each rank's peak resident
memory is printed at the end.
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

from recipes import common, fsdp_checkpoint, fsdp_outer  # noqa: E402

FSDP_DEFAULTS = {"micro_batch": 8, "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                 "grad_clip": 1.0, "param_dtype": "fp32", "blocks": None, "warmup_steps": 0, "warmup_type": "log"}
"""The ``"fsdp"`` section's keys: micro-batch per rank, AdamW's settings, the gradient-norm clip (0: off),
the stored parameters' dtype (``fp32`` or ``bf16``: weights, optimizer state, gradients and the
reduce-scatter in it; ``--mixed_precision`` keeps fp32 weights and computes in bf16), and ``blocks``: the
class names of the transformer blocks to shard one by one (null: the model's ``_no_split_modules``), and
the learning rate's warm-up from 0 to ``lr`` over ``warmup_steps`` steps (0: none), ``log`` or ``linear``,
step for step DeepSpeed's ``WarmupLR`` (``common.warmup_lr_factor``; ``configs/demo_ds.json``'s is 10, log)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIXED_PRECISION = {"fp32": None, "bf16": (torch.bfloat16, torch.float32),
                   "bf16-reduce-bf16": (torch.bfloat16, torch.bfloat16)}
"""``--mixed_precision``: (param dtype, reduce dtype) of FSDP2's ``MixedPrecisionPolicy``; ``fp32``: none."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="JSON with an \"fsdp\" section and optionally a \"zen\" section")
    common.add_run_args(p, default_output_dir="runs/fsdp")
    common.add_optimizer_args(p)
    common.add_outer_args(p)  # zen.outer: FSDP2 HSDP, each replica group trains alone (--replicas)
    p.add_argument("--replicas", type=int, default=None,
                   help="HSDP: shard over a 2-D (replicate, shard) mesh of this many replica groups of world/R ranks "
                   "(default: a 1-D mesh; with zen.outer: every rank a replica)")
    p.add_argument("--mixed_precision", default="fp32", choices=sorted(MIXED_PRECISION),
                   help="FSDP2's MixedPrecisionPolicy: bf16 = bf16 forward/backward, fp32 gradient reduction and "
                   "fp32 weights; bf16-reduce-bf16 = the reduction in bf16 too; fp32 = no policy")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="recompute each block's activations in the backward pass (HF gradient checkpointing, "
                   "non-reentrant)")
    p.add_argument("--cpu_offload", action="store_true",
                   help="keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy)")
    return p.parse_args(argv)


def load_config(path: str, args=None) -> tuple[dict, dict | None]:
    """The ``"fsdp"`` settings (defaults filled in) and the ``"zen"`` section (None: plain FSDP2),
    validated before any process group, data or model exists; ``args``' ``--outer_*`` flags go into
    ``zen.outer`` (served on an HSDP mesh by ``zen_ext.engines.fsdp_outer``, see ``mesh_shape``)."""
    import copy

    from zen_ext.config import ZenConfig, load_json_config
    cfg = copy.deepcopy(load_json_config(path))
    if args is not None:
        common.apply_outer_args(args, cfg)
    unknown = sorted(set(cfg) - {"fsdp", "zen", "_comment"})
    if unknown:
        raise common.ConfigError(f"config keys {unknown} must be among ['fsdp', 'zen']")
    fsdp = {**FSDP_DEFAULTS, **(cfg.get("fsdp") or {})}
    unknown = sorted(set(fsdp) - set(FSDP_DEFAULTS))
    if unknown:
        raise common.ConfigError(f"fsdp keys {unknown} must be among {sorted(FSDP_DEFAULTS)}")
    if fsdp["param_dtype"] not in DTYPES:
        raise common.ConfigError(f"fsdp.param_dtype ({fsdp['param_dtype']!r}) must be one of {sorted(DTYPES)}")
    steps = fsdp["warmup_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise common.ConfigError(f"fsdp.warmup_steps ({steps!r}) must be an integer >= 0")
    if fsdp["warmup_type"] not in common.WARMUP_TYPES:
        raise common.ConfigError(f"fsdp.warmup_type ({fsdp['warmup_type']!r}) must be one of "
                                 f"{list(common.WARMUP_TYPES)}")
    blocks = fsdp["blocks"]
    if blocks is not None and (not isinstance(blocks, list) or not blocks
                               or not all(isinstance(b, str) for b in blocks)):
        raise common.ConfigError(f"fsdp.blocks ({blocks!r}) must be null or a non-empty list of class names")
    zen = cfg.get("zen")
    try:
        parsed = ZenConfig.from_json_section(zen) if zen is not None else None
        if parsed is not None and not parsed.enabled:
            zen = None
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise common.ConfigError(str(exc)) from exc
    return fsdp, zen


def outer_enabled(zen_section: dict | None) -> bool:
    """Whether the ``"zen"`` section turns ``zen.outer`` on (the outer form instead of a per-step sync)."""
    from zen_ext.config import ZenConfig

    return zen_section is not None and ZenConfig.from_json_section(zen_section).outer.enabled


def mesh_shape(replicas: int | None, world: int, outer: bool) -> tuple[int, ...] | None:
    """The device mesh's shape: None (FSDP's default 1-D mesh), or ``(replicas, world / replicas)``; with
    ``zen.outer`` and no ``--replicas``, ``(world, 1)`` (every rank a replica of its own).

    Raises:
        common.ConfigError: ``replicas`` does not divide ``world``, or is < 2 with ``zen.outer``.
    """
    if replicas is None:
        return (world, 1) if outer else None
    if replicas < 1 or world % replicas:
        raise common.ConfigError(f"--replicas ({replicas}) must divide the world size ({world})")
    if outer and replicas < 2:
        raise common.ConfigError(f"--replicas ({replicas}) must be >= 2 with zen.outer (the outer sync runs across "
                                 f"replicas)")
    return (replicas, world // replicas)


# --- sharding -------------------------------------------------------------------------------------------
def find_blocks(model, class_names: list[str] | None = None) -> tuple[list[torch.nn.Module], str]:
    """The transformer blocks to shard one by one, and where their names came from.

    As HF and Accelerate find them: the modules whose class is named in ``class_names`` (``fsdp.blocks``)
    or else in the model's ``_no_split_modules``. A model that names none falls back to the children of
    its longest ``nn.ModuleList`` (the repeated layers), and says so.

    Raises:
        common.ConfigError: ``class_names`` match no module, or the model names no blocks and has no
            ``ModuleList``.
    """
    names = list(class_names or getattr(model, "_no_split_modules", None) or [])
    source = "fsdp.blocks" if class_names else "_no_split_modules"
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return blocks, f"{source} {names}"
        if class_names:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise common.ConfigError(f"fsdp.blocks ({class_names}) must name classes of the model's modules: "
                                     f"{present}")
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise common.ConfigError(f"{type(model).__name__} names no _no_split_modules and has no ModuleList of "
                                 f"blocks: set fsdp.blocks to the class names of its transformer blocks")
    name, layers = max(lists, key=lambda item: len(item[1]))
    return list(layers), (f"the longest ModuleList {name} ({type(model).__name__} names no _no_split_modules; "
                          f"fsdp.blocks chooses)")


def _shared_outside(unit: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether a parameter of ``unit`` is also a parameter of a module outside it (a tied weight)."""
    mine = {id(p) for p in unit.parameters()}
    inside = {id(m) for m in unit.modules()}
    return any(id(p) in mine for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False))


def shard(model, *, mixed_precision: str = "fp32", cpu_offload: bool = False,
          blocks: list[str] | None = None, mesh=None) -> tuple[int, str]:
    """``fully_shard`` each block, the input embedding (its rows are naturally sparse: a bucket of their
    own) and then the model, under one ``MixedPrecisionPolicy`` and offload policy.

    1. Find the blocks (``find_blocks``); add the input embedding.
    2. Leave in the root unit every candidate whose parameters a module outside it shares: a tied input
       embedding goes with the LM head (two FSDP units cannot hold one parameter).
    3. ``fully_shard`` the units innermost first, then the root (on ``mesh``, None: FSDP's 1-D default).

    Returns:
        ``(number of FSDP modules, what was sharded, for the start line)``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # Step 1: candidates.
    found, source = find_blocks(model, blocks)
    embed = model.get_input_embeddings()
    candidates = found + ([embed] if embed is not None and all(embed is not b for b in found) else [])
    # Step 2: tied parameters stay in the root.
    units = [u for u in candidates if not _shared_outside(u, model)]
    tied = [n for n, m in model.named_modules() if any(m is u for u in candidates) and not any(m is u for u in units)]
    # Step 3: shard.
    dtypes = MIXED_PRECISION[mixed_precision]
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1]) if dtypes
          else MixedPrecisionPolicy(),
          "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload  # pinning needs one
          else OffloadPolicy()}
    if mesh is not None:
        kw["mesh"] = mesh
    order = {id(m): i for i, m in enumerate(model.modules())}
    for unit in sorted(units, key=lambda u: -order[id(u)]):  # children before their parents
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    text = f"{len(found)} blocks from {source}" + (f"; in the root unit (tied parameters): {tied}" if tied else "")
    return len(units) + 1, text


def build_optimizer(args, fsdp: dict, zen_section: dict | None, model) -> tuple[torch.optim.Optimizer, str, str]:
    """torch's AdamW, or ``zen_ext.optim.CatchUpAdamW`` (``common.optimizer_choice``: the default under DGC)
    on the sharded model's DTensor parameters, with the config's AdamW settings. Returns the optimizer,
    its name (recorded with checkpoints) and why it was chosen."""
    from zen_ext.config import ZenConfig
    from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

    zen = ZenConfig.from_json_section(zen_section) if zen_section is not None else ZenConfig.from_dict(
        {"enabled": False})
    kind, why = common.optimizer_choice(args, zen.enabled and zen.dgc.enabled and not zen.outer.enabled, adam=True)
    kw = dict(lr=fsdp["lr"], betas=tuple(fsdp["betas"]), eps=fsdp["eps"], weight_decay=fsdp["weight_decay"])
    if kind == "catch_up":
        return CatchUpAdamW(catch_up_param_groups(model, zen), **kw), "CatchUpAdamW", why
    return torch.optim.AdamW(model.parameters(), **kw), "AdamW", why


def mesh_device_type(device) -> str:
    """The device mesh's device type: the GPU's, else ``cpu``."""
    return device.type if device is not None else "cpu"


def _flag_for(saved: str) -> str:
    """What brings back the optimizer a checkpoint was saved with."""
    return "--catch_up_adam" if saved == "CatchUpAdamW" else "--plain_adam"


def main(argv=None) -> list[dict]:
    """Run the fine-tuning; returns the per-step records (rank 0's view) for tests and scripts."""
    import zen_ext.fsdp

    args = parse_args(argv)
    # Step 1: config, processes.
    fsdp, zen_section = load_config(args.config, args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    dist.init_process_group("nccl" if device is not None else "gloo")
    if device is not None:
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.output_dir, exist_ok=True)

    # Step 2: data, model, FSDP2, optimizer, ZEN, the checkpoint to resume from.
    tokenizer, train_blocks, eval_blocks = common.prepare_data(args, rank)
    vocab = len(tokenizer) if args.model.endswith(".json") else None
    model = common.build_model(args.model, seed=args.seed, vocab_size=vocab, dtype=DTYPES[fsdp["param_dtype"]])
    if args.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise common.ConfigError(f"--activation_checkpointing needs a model with HF gradient checkpointing; "
                                     f"{type(model).__name__} has none")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if device is not None:
        model.to(device)
    outer = outer_enabled(zen_section)
    shape = mesh_shape(args.replicas, world, outer)
    mesh = None
    if shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(mesh_device_type(device), shape, mesh_dim_names=("replicate", "shard"))
    units, sharded = shard(model, mixed_precision=args.mixed_precision, cpu_offload=args.cpu_offload,
                           blocks=fsdp["blocks"], mesh=mesh)
    if shape is not None:
        sharded += f"; HSDP mesh replicate={shape[0]} x shard={shape[1]}"
    optimizer, optimizer_name, optimizer_why = build_optimizer(args, fsdp, zen_section, model)
    peak_lrs = [group["lr"] for group in optimizer.param_groups]  # before a resume loads a warm-up's rate
    if outer:  # each replica group trains alone; the outer sync across the replicas (docs/outer.md)
        zen = fsdp_outer.OuterRun(model, zen_section, optimizer)
        checkpoints = fsdp_outer
    else:
        zen = zen_ext.fsdp.attach(model, zen_section, optimizer=optimizer) if zen_section is not None else None
        checkpoints = fsdp_checkpoint
    ckpt_dir = os.path.join(args.output_dir, "checkpoints")
    start, resume_from = 0, fsdp_checkpoint.latest(ckpt_dir) if args.resume else None
    if resume_from is not None:
        common.check_optimizer_name(resume_from, optimizer_name, _flag_for, optimizer_why)
        start = checkpoints.load(resume_from, model, optimizer, zen)
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    batch_device = device or torch.device("cpu")  # under CPU offload the parameters live on the CPU
    if rank == 0:
        print(f"fsdp recipe: zen={'on (' + zen.cfg.scheme + ')' if zen else 'off'} world={world} "
              f"fsdp_modules={units} ({sharded}) param_dtype={fsdp['param_dtype']} "
              f"warmup={fsdp['warmup_steps']}({fsdp['warmup_type']}) "
              f"mixed_precision={args.mixed_precision} activation_checkpointing={args.activation_checkpointing} "
              f"cpu_offload={args.cpu_offload} micro_batch={fsdp['micro_batch']} train_blocks={len(train_blocks)} "
              f"eval_blocks={len(eval_blocks)} start_step={start} optimizer={optimizer_name} ({optimizer_why})",
              flush=True)

    # Step 3: train; a checkpoint every --save_every steps and at the end.
    batches = common.train_batches(train_blocks, fsdp["micro_batch"], rank, world, seed=args.seed, start_step=start)
    log = common.StepLog(args.output_dir, rank, start, args.steps)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        batch = next(batches).to(batch_device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        if zen is not None:
            zen.annotate(loss=loss.item())  # the record closes at the end of the backward pass
        loss.backward()
        if fsdp["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp["grad_clip"])
        if fsdp["warmup_steps"]:  # a function of the step alone: a resumed run continues on the same rates
            factor = common.warmup_lr_factor(step, fsdp["warmup_steps"], fsdp["warmup_type"])
            for group, peak in zip(optimizer.param_groups, peak_lrs):
                group["lr"] = peak * factor
        optimizer.step()
        optimizer.zero_grad()
        if outer and step == args.steps:
            zen.finish()  # zen.outer.delay 1: the last round's sum is applied before the final eval and save
        rec = {"step": step, "loss": common.all_reduce_mean(loss.item(), dist.group.WORLD),
               "lr": optimizer.param_groups[0]["lr"],
               "tokens_per_s": fsdp["micro_batch"] * args.seq_len * world / (time.perf_counter() - t0)}
        if zen is not None:
            rec["bytes_sent"], rec["dense_bytes"] = zen.totals["bytes_sent"], zen.totals["dense_bytes"]
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            rec["eval_loss"] = common.evaluate(model, eval_blocks, fsdp["micro_batch"], rank, world, dist.group.WORLD,
                                               device=batch_device)
        log.log(rec)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            checkpoints.save(ckpt_dir, step, model, optimizer, zen, optimizer_name)

    # Step 4: summary and each rank's peak memory (resident set: CPU tensors live there; KiB on Linux).
    text = zen.summary() if zen is not None else None
    peak = common.gather_peak_memory(world, peak_rss_at_start_mib=rss_start / 1024,
                                     cuda_peak_mib=torch.cuda.max_memory_allocated() / 2**20 if device else None)
    log.close(text)
    if rank == 0:
        print("fsdp recipe: peak memory per rank: " + json.dumps(peak), flush=True)
    if zen is not None:
        zen.close()
    return log.records


if __name__ == "__main__":
    common.run_main(main)
