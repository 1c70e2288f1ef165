"""zen.outer on FSDP2 HSDP (2 replicas × 2 shards, 4 gloo ranks) against the DDP form (2 replicas, SimWorld)
at equal inner steps: the same model, data, inner AdamW and outer settings.

The demo Llama is pretrained densely on the first half of the pydoc text (``--pretrain_steps``), then
fine-tuned ``--steps`` inner steps on the second half by 2 replicas, each on its own shard
(``recipes.common.train_batches``), micro-batch ``--micro_batch`` per replica (AdamW lr ``--lr``, clip 1):

* DDP form: ``benchmarks/quality/bench_outer_quality.py``'s ``run_variant`` (``OuterSync`` over the full
  parameters of each replica, SimWorld ranks);
* FSDP2 HSDP: ``zen_ext.engines.fsdp_outer.register_outer`` on a ``(2, 2)`` mesh; each replica's micro-batch is
  split in halves over its 2 shard ranks (FSDP averages the halves' gradients: the replica's gradient).

Variants: ``diloco`` (density 1, outer lr 0.7, momentum 0.9, Nesterov, mean) and ``outer`` (SparseLoCo's
defaults: top-64 of 4,096, β 0.95, contributors). Reported: the eval loss of θ_global after every outer
step and its gap HSDP vs DDP. At density 1 the two forms compute the same DiLoCo (the gloo test checks it
to 1e-6 for a few steps), so only float order separates them; at density < 1 the top-k chunks run over
each rank's shard under HSDP and over the whole flat vector under DDP, so the picks differ. Usage::

    nice -n 10 python benchmarks/quality/bench_fsdp_outer_quality.py --seeds 0 \\
        --out benchmarks/quality/results/fsdp_outer_quality.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.comm.bench_outer_bytes import provenance  # noqa: E402
from benchmarks.quality import bench_outer_quality as ddp_form  # noqa: E402
from recipes.common import (build_model, build_tokenizer, load_texts, pack_tokens, select_texts,  # noqa: E402
                            split_blocks, train_batches)

R, L = 2, 2


def _hsdp_worker(rank, world, args, variant, start_sd, train, evalb, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zen_ext.engines.fsdp_outer import register_outer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (R, L), mesh_dim_names=("replicate", "shard"))
    model = build_model(args.model, vocab_size=args.vocab)
    model.load_state_dict(start_sd)
    for unit in [*model.model.layers, model.get_input_embeddings()]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ddp_form._opt(model, args.lr)
    cfg = {"scheme": "zen", "stats": {"summary": False},
           "outer": dict(enabled=True, every=args.every, **ddp_form.VARIANTS[variant])}
    outer = register_outer(model, cfg, opt)
    replica, half = divmod(rank, L)
    batches = train_batches(train, args.micro_batch, replica, R, seed=seed)
    plain = build_model(args.model, vocab_size=args.vocab) if rank == 0 else None
    losses, sent = [], 0
    for step in range(1, args.steps + 1):
        x = next(batches).chunk(L)[half]
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the replica's norm (over its shard group)
        opt.step()  # every H-th: the outer step
        opt.zero_grad()
        sent += outer.pop_stats()["bytes_sent"]
        if step % args.every == 0:
            full = [p.full_tensor() for p in model.parameters()]  # θ_global, gathered in the replica group
            if plain is not None:
                with torch.no_grad():
                    for p, f in zip(plain.parameters(), full):
                        p.copy_(f)
                losses.append(ddp_form._eval(plain, evalb))
    outer.close()
    return losses, sent / args.steps


def main() -> None:
    from zen_ext.comm.local import run_workers

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="configs/models/llama-tiny-untied.json")
    p.add_argument("--variants", nargs="+", default=["diloco", "outer"], choices=["diloco", "outer", "outer_mean"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--pretrain_steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=15)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--micro_batch", type=int, default=4, help="per replica (halved over its 2 shard ranks)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    texts = load_texts("pydoc")
    tok = build_tokenizer("train", texts, os.path.join(ROOT, "runs", "outer_bytes_tok"), 1024)
    args.vocab = len(tok)
    args.eval_every = 1
    first = pack_tokens(select_texts(texts, "first"), tok, args.seq_len)
    train, evalb = split_blocks(pack_tokens(select_texts(texts, "second"), tok, args.seq_len), 0.05)
    rows = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = build_model(args.model, seed=seed, vocab_size=args.vocab)
        opt = ddp_form._opt(model, args.lr)
        pre = train_batches(first, args.micro_batch * R, 0, 1, seed=seed)
        for _ in range(args.pretrain_steps):
            ddp_form._step(model, opt, next(pre))
        start_sd = {k: v.clone() for k, v in model.state_dict().items()}
        for v in args.variants:
            ddp_losses, ddp_bps = ddp_form.run_variant(v, args, start_sd, train, evalb, seed, R)
            out = run_workers(_hsdp_worker, R * L, args, v, start_sd, train, evalb, seed, timeout_s=1800)
            hsdp_losses, hsdp_bps = out[0]
            rows.append((seed, v, ddp_losses, hsdp_losses, ddp_bps, sum(o[1] for o in out[:L])))
            print(f"seed {seed} {v}: DDP {ddp_losses} HSDP {hsdp_losses}", flush=True)
    lines = ["# zen.outer on FSDP2 HSDP against the DDP form at equal inner steps", "",
             f"Command: `nice -n 10 python benchmarks/quality/bench_fsdp_outer_quality.py --seeds "
             f"{' '.join(map(str, args.seeds))} --steps {args.steps} --every {args.every} --pretrain_steps "
             f"{args.pretrain_steps} --out {args.out}`", "",
             f"Demo Llama ({os.path.basename(args.model)}), pretrained densely {args.pretrain_steps} steps on the first "
             f"half of the pydoc text, fine-tuned {args.steps} inner steps on the second half by {R} replicas, each on "
             f"its own shard (micro-batch {args.micro_batch} per replica × seq {args.seq_len}, AdamW lr {args.lr}, "
             f"clip 1); H = {args.every}. DDP form: {R} replicas in SimWorld; FSDP2 HSDP: {R} × {L} gloo ranks, each "
             f"replica's micro-batch split over its {L} shard ranks. Eval loss of θ_global after each outer step.", "",
             "| seed | variant | form | " + " | ".join(f"step {args.every * (i + 1)}" for i in
                                                     range(args.steps // args.every)) +
             " | final gap HSDP vs DDP | bytes per replica per inner step |",
             "| --- | --- | --- |" + " --- |" * (args.steps // args.every) + " --- | --- |"]
    for seed, v, d, h, dbps, hbps in rows:
        gap = f"{100 * (h[-1] / d[-1] - 1):+.3f} %"
        lines.append(f"| {seed} | {v} | DDP | " + " | ".join(f"{x:.4f}" for x in d) + f" | | {dbps:,.0f} B |")
        lines.append(f"| {seed} | {v} | HSDP | " + " | ".join(f"{x:.4f}" for x in h) + f" | {gap} | "
                     f"{hbps:,.0f} B (its {L} shard ranks) |")
    lines += ["", f"{provenance('')}; {time.time() - t0:.0f} s in total."]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
