"""zen.outer's state per rank under FSDP2 HSDP (``zen_ext.engines.fsdp_outer``) against P / L, on real gloo
processes.

The tiny untied Llama (configs/models/llama-tiny-untied.json), ``fully_shard`` on each decoder layer, the
input embedding and the model (as recipes/finetune_llm_fsdp.py does), on ``(R, L)`` meshes of 4 ranks;
3 AdamW inner steps of random tokens with the outer sync every 3 (so the state has been used once). Per
rank: ``outer.state_bytes()`` (θ_global, error feedback, momentum held now) against the formula
(``state_bytes_per_param`` × the rank's shard elements) and against the formula × P / L (FSDP pads dim 0,
so a rank's shard is within one row of P / L), for SparseLoCo's defaults (8 B/element), dense DiLoCo
(8 B) and a sparse density with momentum (12 B). Run::

    OMP_NUM_THREADS=1 python benchmarks/memory/bench_fsdp_outer_state.py \\
        --out benchmarks/memory/results/fsdp_outer_state.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

STEPS = 3
CONFIGS = [("SparseLoCo defaults", {"enabled": True, "every": STEPS}),
           ("dense DiLoCo", {"enabled": True, "every": STEPS, "density": 1, "lr": 0.7, "momentum": 0.9,
                             "nesterov": True, "average": "mean"}),
           ("density 1/64 + momentum 0.9", {"enabled": True, "every": STEPS, "momentum": 0.9})]
MESHES = [(4, 1), (2, 2)]


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recipes.common import build_model
    from zen_ext.engines.fsdp_outer import register_outer
    from zen_ext.outer.sync import state_bytes_per_param

    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 1000, (2, 16), generator=g) for _ in range(STEPS)]
    out = {}
    for shape in MESHES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for label, cfg in CONFIGS:
            model = build_model(os.path.join(ROOT, "configs/models/llama-tiny-untied.json"), seed=0)
            for unit in [*model.model.layers, model.get_input_embeddings()]:
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            outer = register_outer(model, {"scheme": "zen", "stats": {"summary": False}, "outer": cfg}, opt)
            for x in batches:
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            local = sum(p.to_local().numel() for p in model.parameters())
            out[(shape, label)] = {"state": outer.state_bytes(), "local": local,
                                   "per": state_bytes_per_param(outer.cfg),
                                   "p": sum(p.numel() for p in model.parameters()), "outer_steps": outer.outer_steps}
            outer.close()
    return out


def main() -> None:
    from zen_ext.comm.local import run_workers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args()
    per_rank = run_workers(_worker, 4, timeout_s=1200)
    lines = ["| mesh (R x L) | config | B/element | state per rank (bytes, min-max) | = formula x shard elements | "
             "formula x P/L | max / (formula x P/L) |", "|---|---|---|---|---|---|---|"]
    for shape in MESHES:
        for label, _ in CONFIGS:
            rows = [r[(shape, label)] for r in per_rank]
            assert all(r["outer_steps"] == 1 for r in rows)
            exact = all(r["state"] == r["per"] * r["local"] for r in rows)
            lo, hi = min(r["state"] for r in rows), max(r["state"] for r in rows)
            ideal = rows[0]["per"] * rows[0]["p"] / shape[1]
            lines.append(f"| {shape[0]} x {shape[1]} | {label} | {rows[0]['per']} | {lo:,}-{hi:,} | "
                         f"{'yes' if exact else 'NO'} | {ideal:,.0f} | {hi / ideal:.4f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# zen.outer state per rank under FSDP2 HSDP\n\n{' '.join(__doc__.split(chr(10) * 2)[0].split())}"
                    f"\n\n`OMP_NUM_THREADS=1 python benchmarks/memory/bench_fsdp_outer_state.py --out {args.out}` "
                    f"(4 gloo ranks, P = {per_rank[0][(MESHES[0], CONFIGS[0][0])]['p']:,} parameters, state on "
                    f"the CPU, fp32)\n\n{text}\n\nUnder HSDP each rank holds the outer state of its shard only: "
                    f"L = 2 halves it against every rank a replica (4 x 1), as the DDP form would keep it.\n")


if __name__ == "__main__":
    main()
