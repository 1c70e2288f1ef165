"""Train the time-to-quality benchmark's model on plain torch DDP with zen_ext or one of its peers.

A recipe-like script (run under ``torchrun``) for ``benchmarks/quality/bench_peers.py``: the model, data,
tokenizer, batches and evaluation come from ``recipes/common.py`` exactly as in the DeepSpeed recipe, and the
optimizer settings from the same DeepSpeed config (``configs/demo_ds.json``: AdamW lr 3e-3, betas 0.9/0.95,
weight decay 0.01, DeepSpeed's log warm-up over 10 steps step for step (``common.warmup_lr_factor``), global
gradient-norm clip 1.0, micro-batch 8), so losses compare with the DeepSpeed runs at the same seed.

Methods (``--method``):

* ``dense``: DDP's own all-reduce.
* ``zen``: ``zen_ext.engines.ddp.register_zen_hook`` with ``{"dgc": {"enabled": true, "density": d}}``
  (``--zen_density``; ``--zen_residual_dtype int4`` for the 4-bit residual) and CatchUpAdamW, the
  project's defaults under DGC; ``--zen_warmup_steps`` / ``--zen_value_bits`` set ``dgc.warmup_steps`` (0: no
  density ramp, the steady state a timing run wants) and ``dgc.value_bits``.
* ``powersgd``: torch's ``powerSGD_hook`` (``PowerSGDState``: ``--powersgd_rank``, ``--powersgd_start_iter``
  — torch's docstring recommends 10 % of the steps and no less than the warm-up; warm start and error
  feedback on, ``min_compression_rate`` 2, as torch's defaults).
* ``diloco``: torchft 0.2.0's ``DiLoCo`` (``--sync_every`` H, outer SGD lr 0.7, momentum 0.9, Nesterov as
  the DiLoCo paper) with an in-process lighthouse on rank 0 and one replica group per rank (gloo).
* ``sparseloco``: ``benchmarks/quality/sparseloco.py`` at its published settings (H = 15 by default).
* ``zen_outer``: zen_ext's own outer synchronization (``zen_ext.engines.ddp_outer.register_outer``, ``zen.outer``,
  ``zen.scheme: zen``) at a setting of the outer harness (``--zen_outer``: a variant of
  ``benchmarks/quality/bench_outer_quality.py``'s ``VARIANTS``, e.g. ``diloco``, ``outer_d25_4bit``,
  ``outer_d25_h5_4bit``; H is the variant's own, else ``--sync_every``, else 15, the harness's default).
  DDP's per-step all-reduce is off (``register_outer``'s local-gradients hook); the outer step runs from the
  inner AdamW's post-step hook, so the loop is the same as the other methods'.

For the DiLoCo family (``diloco``, ``sparseloco``, ``zen_outer``) the eval loss at a step is the loss of the
replicas' averaged parameters (an all-reduce for evaluation only, not counted in bytes): at a synchronization
step the replicas are equal and this is the global model. ``train_log.jsonl`` records per step the loss, the cumulative ``bytes_sent`` by
this rank (each method's actual messages: see ``bytes_per_step`` below), step seconds and eval losses;
``summary.json`` as the other recipes. ``elapsed_s`` is the time from the start of step 1 to the end of the
step's loss all-reduce: differences of it are the step's wall time including the wait for the slowest rank, which
a DiLoCo inner step (no communication) otherwise leaves out (``benchmarks/cluster/bench_peers_lab.py`` times with
it on the emulated cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from recipes import common  # noqa: E402

METHODS = ("dense", "zen", "powersgd", "diloco", "sparseloco", "zen_outer")
LOCAL_STEPS = ("diloco", "sparseloco", "zen_outer")
"""The DiLoCo family: inner steps without communication, evaluated on the replicas' mean parameters."""
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
"""The DiLoCo paper's outer optimizer (arXiv 2311.08105; torchtitan's torchft experiment uses the same)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_args(p, default_output_dir="runs/peers")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--ds_config", default=os.path.join(ROOT, "configs/demo_ds_dense.json"),
                   help="the DeepSpeed config whose optimizer, warm-up, clip and micro-batch the run takes")
    p.add_argument("--zen_density", type=float, default=0.05)
    p.add_argument("--zen_residual_dtype", default="float32", choices=("float32", "int4"))
    p.add_argument("--zen_warmup_steps", type=int, default=None, help="zen.dgc.warmup_steps (default: the project's)")
    p.add_argument("--zen_value_bits", type=int, default=None, help="zen.dgc.value_bits (8 or 4; default: off)")
    p.add_argument("--powersgd_rank", type=int, default=1)
    p.add_argument("--powersgd_start_iter", type=int, default=None,
                   help="default: 10 %% of --steps, at least the warm-up steps and 2 (torch's rule with warm start)")
    p.add_argument("--ddp_bucket_cap_mb", type=float, default=None,
                   help="DDP's bucket_cap_mb (default DDP's: 25 MB, the first bucket 1 MB); set, every bucket is this size")
    p.add_argument("--torchft_init_sync", action=argparse.BooleanOptionalAction, default=True,
                   help="torchft Manager(init_sync=...): replica 0's state sent to the others at the first quorum "
                        "(torchft's docstring: False when every replica is initialized identically, as here)")
    p.add_argument("--sync_every", type=int, default=None,
                   help="H (diloco: required; sparseloco: 15; zen_outer: the variant's, else this, else 15)")
    p.add_argument("--zen_outer", default=None,
                   help="zen_outer: a variant of benchmarks/quality/bench_outer_quality.py's VARIANTS (not dense)")
    return p.parse_args(argv)


def optimizer_settings(path: str) -> dict:
    """AdamW, warm-up, clip and micro-batch from a DeepSpeed config (only the types the demo uses)."""
    with open(path) as f:
        cfg = json.load(f)
    opt, sched = cfg["optimizer"], cfg.get("scheduler") or {}
    if opt["type"].lower() not in ("adamw", "adam") or (sched and sched["type"] != "WarmupLR"):
        raise common.ConfigError(f"--ds_config ({path}) must use AdamW and WarmupLR (the demo's)")
    p = opt["params"]
    return {"lr": p["lr"], "betas": tuple(p["betas"]), "eps": p.get("eps", 1e-8), "weight_decay": p["weight_decay"],
            "warmup_steps": (sched.get("params") or {}).get("warmup_num_steps", 0),
            "warmup_type": (sched.get("params") or {}).get("warmup_type", "log"),
            "clip": cfg.get("gradient_clipping", 0.0), "micro_batch": cfg["train_micro_batch_size_per_gpu"]}


def ring_allreduce_bytes(elements: int, itemsize: int, world: int) -> int:
    """What one rank sends in a ring all-reduce (reduce-scatter + all-gather)."""
    return 2 * (world - 1) * elements * itemsize // world


def powersgd_step_bytes(model, rank: int, world: int, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank sends in a PowerSGD step after ``start_powerSGD_iter``, from torch's own rule
    (``powerSGD_hook._should_compress`` on each gradient viewed as ``shape[0] × rest``): the uncompressed
    tensors' all-reduce and the P (n × r) and Q (m × r) all-reduces, fp32."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    dense = p_el = q_el = 0
    for p in model.parameters():
        if p.dim() <= 1:
            dense += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        if _should_compress(n, m, r, min_compression_rate)[0]:
            p_el += n * r
            q_el += m * r
        else:
            dense += p.numel()
    return sum(ring_allreduce_bytes(e, 4, world) for e in (dense, p_el, q_el) if e)


def averaged_eval(model, eval_blocks, micro: int, rank: int, world: int) -> float:
    """Eval loss of the replicas' mean parameters (DiLoCo family), the local ones restored after."""
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data.div_(world)
    loss = common.evaluate(model, eval_blocks, micro, rank, world, dist.group.WORLD)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    return loss


def reachable_address() -> str:
    """This rank's address as the other ranks reach it: ``localhost`` on one machine, else the address of the
    interface that routes to ``MASTER_ADDR`` (on the emulated cluster each rank is a network namespace, where
    ``localhost`` and the machine's host name are that namespace's own loopback)."""
    master = os.environ.get("MASTER_ADDR", "localhost")
    if master in ("localhost", "") or master.startswith("127."):
        return "localhost"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # UDP connect sends nothing: it only picks the route and source address
        return s.getsockname()[0]


def start_torchft(model, inner, sync_every: int, rank: int, world: int, init_sync: bool = True):
    """torchft's DiLoCo: a lighthouse on rank 0 (in process, as torchft's CPU tests start it), one Manager per
    rank (a replica group of one rank, its own TCPStore), the outer Nesterov SGD. Returns (manager, DiLoCo)."""
    from datetime import timedelta

    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    lighthouse = None
    addr = [None]
    here = reachable_address()
    if rank == 0:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world)
        # The lighthouse advertises the machine's host name; the other ranks reach it at rank 0's address.
        addr = [f"http://{here}:{lighthouse.address().rsplit(':', 1)[1]}"]
    dist.broadcast_object_list(addr, src=0)
    store = dist.TCPStore(host_name=here, port=0, is_master=True, wait_for_workers=False)
    outer = torch.optim.SGD(model.parameters(), **DILOCO_OUTER)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=world,
                      load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
                      use_async_quorum=False, replica_id=f"peers_replica_{rank}", store_addr=here,
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=addr[0],
                      hostname=here, timeout=timedelta(seconds=120),
                      quorum_timeout=timedelta(seconds=120), init_sync=init_sync)
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
    return manager, diloco, (lighthouse, store)


def zen_outer_config(variant: str | None, sync_every: int | None) -> dict:
    """The ``zen`` section of a ``zen_outer`` run: the outer harness's variant (its own ``every``, else
    ``sync_every``, else 15) summed by ZEN (``value_bits`` needs a ZEN scheme; ``bench_outer_quality`` uses it)."""
    from bench_outer_quality import VARIANTS

    if not VARIANTS.get(variant):
        raise common.ConfigError(f"--zen_outer ({variant}) must be one of "
                                 f"{[v for v, c in VARIANTS.items() if c]} (bench_outer_quality.py's VARIANTS)")
    outer = {"enabled": True, "every": sync_every or 15, **VARIANTS[variant]}
    return {"scheme": "zen", "outer": outer, "stats": {"summary": False}}


def start_zen_outer(ddp_model, optimizer, variant: str | None, sync_every: int | None):
    """zen.outer on the DDP model as a user sets it up (``register_outer`` with the inner optimizer, whose
    post-step hook runs the outer step). Returns (OuterSync, the ``zen`` section)."""
    from zen_ext.engines.ddp_outer import register_outer

    cfg = zen_outer_config(variant, sync_every)
    return register_outer(ddp_model, cfg, optimizer=optimizer), cfg


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    # Step 1: settings, processes.
    opt = optimizer_settings(args.ds_config)
    if not dist.is_initialized():  # benchmarks/cluster/peers_lab_runs.py runs several methods in one process
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.output_dir, exist_ok=True)

    # Step 2: data and model as the DeepSpeed recipe builds them; the method's wrapper and optimizer.
    tokenizer, train_blocks, eval_blocks = common.prepare_data(args, rank)
    vocab = len(tokenizer) if args.model.endswith(".json") else None
    model = common.build_model(args.model, seed=args.seed, vocab_size=vocab)
    n_params = sum(p.numel() for p in model.parameters())
    kw = dict(lr=opt["lr"], betas=opt["betas"], eps=opt["eps"], weight_decay=opt["weight_decay"])
    hook_state, diloco, sparseloco, keep, outer = None, None, None, None, None
    per_step_bytes = 0
    train_model = model
    if args.method in ("dense", "zen", "powersgd", "zen_outer"):
        from torch.nn.parallel import DistributedDataParallel

        # zen_outer: DDP must not broadcast rank 0's buffers (the rotary tables) at every forward
        train_model = DistributedDataParallel(model, bucket_cap_mb=args.ddp_bucket_cap_mb,
                                              broadcast_buffers=args.method != "zen_outer")
    if args.method == "zen":
        from zen_ext.config import ZenConfig
        from zen_ext.engines.ddp import register_zen_hook
        from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

        dgc = {"enabled": True, "density": args.zen_density, "residual_dtype": args.zen_residual_dtype}
        dgc.update({k: v for k, v in (("warmup_steps", args.zen_warmup_steps), ("value_bits", args.zen_value_bits))
                    if v is not None})
        zen_cfg = ZenConfig.from_dict({"dgc": dgc, "stats": {"summary": False}})
        optimizer = CatchUpAdamW(catch_up_param_groups(model, zen_cfg), **kw)
        hook_state = register_zen_hook(train_model, zen_cfg, optimizer=optimizer)
        described = (f"zen DDP hook (DGC {args.zen_density:g}, residual {args.zen_residual_dtype}, warmup_steps "
                     f"{args.zen_warmup_steps}, value_bits {args.zen_value_bits}, CatchUpAdamW)")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **kw)
    if args.method == "dense":
        per_step_bytes = ring_allreduce_bytes(n_params, 4, world)
        described = "DDP all-reduce"
    elif args.method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        start_iter = args.powersgd_start_iter or max(2, opt["warmup_steps"], args.steps // 10)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=start_iter, min_compression_rate=2,
                                       use_error_feedback=True, warm_start=True, random_seed=0)
        train_model.register_comm_hook(state, powersgd.powerSGD_hook)
        compressed_bytes = powersgd_step_bytes(model, args.powersgd_rank, world)
        described = (f"torch powerSGD_hook (rank {args.powersgd_rank}, start_powerSGD_iter {start_iter}, warm start, "
                     f"error feedback)")
    elif args.method == "diloco":
        if not args.sync_every:
            raise common.ConfigError("--sync_every must be set for diloco (H; the benchmark runs 10 and 50)")
        manager, diloco, keep = start_torchft(model, optimizer, args.sync_every, rank, world,
                                               args.torchft_init_sync)
        diloco.__enter__()
        outer_bytes = ring_allreduce_bytes(n_params, 4, world)  # torchft: one fp32 all-reduce per parameter
        described = f"torchft DiLoCo (H {args.sync_every}, outer SGD {DILOCO_OUTER})"
    elif args.method == "sparseloco":
        from sparseloco import SparseLoCo

        sparseloco = SparseLoCo(model, sync_every=args.sync_every or 15)
        described = f"SparseLoCo (direct implementation, {sparseloco.s})"
    elif args.method == "zen_outer":
        outer, zen_cfg = start_zen_outer(train_model, optimizer, args.zen_outer, args.sync_every)
        described = f"zen.outer {args.zen_outer} via register_outer ({zen_cfg['outer']}, scheme zen)"
    peak_lrs = [g["lr"] for g in optimizer.param_groups]
    if rank == 0:
        print(f"peers recipe: {described} world={world} params={n_params} micro_batch={opt['micro_batch']} "
              f"train_blocks={len(train_blocks)} eval_blocks={len(eval_blocks)}", flush=True)

    # Step 3: train.
    batches = common.train_batches(train_blocks, opt["micro_batch"], rank, world, seed=args.seed)
    log_file = open(os.path.join(args.output_dir, "train_log.jsonl"), "w") if rank == 0 else None
    progress = common.progress_bar(rank, 0, args.steps)
    records: list[dict] = []
    sent = 0
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = next(batches)
        loss = train_model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        if opt["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt["clip"])
        factor = common.warmup_lr_factor(step, opt["warmup_steps"], opt["warmup_type"])
        for group, peak in zip(optimizer.param_groups, peak_lrs):
            group["lr"] = peak * factor
        optimizer.step()  # DiLoCo's outer step runs in torchft's post-step hook
        optimizer.zero_grad()
        synced = None
        if sparseloco is not None:
            synced = sparseloco.after_inner_step()
        step_s = time.perf_counter() - t0
        # Bytes this rank sent in this step.
        if args.method == "dense":
            sent += per_step_bytes
        elif args.method == "zen":
            sent = hook_state.totals["bytes_sent"]
        elif args.method == "powersgd":
            # torch's hook all-reduces the whole bucket before start_powerSGD_iter (state.iter counts steps)
            sent += ring_allreduce_bytes(n_params, 4, world) if step <= start_iter else compressed_bytes
        elif args.method == "diloco":
            sent += outer_bytes if step % args.sync_every == 0 else 0
        elif args.method == "zen_outer":
            sent += outer.pop_stats()["bytes_sent"]  # the outer sums' own count (TorchCommunicator)
        else:
            sent = sparseloco.bytes_sent
        rec = {"step": step, "loss": common.all_reduce_mean(loss.item(), dist.group.WORLD), "step_s": step_s,
               "elapsed_s": time.perf_counter() - start,
               "tokens_per_s": opt["micro_batch"] * args.seq_len * world / step_s, "bytes_sent": sent,
               "dense_bytes": step * ring_allreduce_bytes(n_params, 4, world)}
        if synced is not None:
            rec["synced"] = synced
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            if args.method in LOCAL_STEPS:
                rec["eval_loss"] = averaged_eval(model, eval_blocks, opt["micro_batch"], rank, world)
            else:
                rec["eval_loss"] = common.evaluate(train_model, eval_blocks, opt["micro_batch"], rank, world,
                                                   dist.group.WORLD)
        common.log_step(rec, log_file, records, progress)

    # Step 4: summary.
    if diloco is not None:
        diloco.__exit__(None, None, None)
        manager.shutdown(wait=False)
    if hook_state is not None:
        hook_state.close()
    if outer is not None:
        outer.finish()  # delay 0: nothing in flight; the call a delay-1 setting would need
        outer.close()
    peak = common.gather_peak_memory(world)
    if rank == 0:
        log_file.close()
        common.write_outputs(args.output_dir, records, None, {"method": described, "memory": peak})
    dist.barrier()
    if keep and keep[0] is not None:
        keep[0].shutdown()  # the lighthouse (rank 0), so that a next run in this process starts its own
    del keep
    return records


if __name__ == "__main__":
    common.exit_on_config_error(main)
    if dist.is_initialized():
        dist.destroy_process_group()
