"""DGC's state per rank under FSDP2: a 1-D mesh (ZEN's reduce-scatter, DGC on the rank's whole gradient)
against HSDP (ZEN's all-reduce of the node-summed shard across the replicas), on real gloo processes.

The tiny untied Llama (configs/models/llama-tiny-untied.json), ``fully_shard`` on each decoder layer, the
input embedding and the model (as recipes/finetune_llm_fsdp.py does), natural rows + DGC 5 % (no warm-up,
fp32 residual, no momentum correction), 3 SGD steps of random tokens. Per rank: the bytes of every tensor
in ``zen.state_dict()["sync"]`` (DGC's residuals and thresholds, what zen_ext keeps between steps) against
``P_dgc``, the elements of the parameters routed to DGC, and the bytes sent against the engine's dense
collective. Run::

    OMP_NUM_THREADS=1 python benchmarks/memory/bench_fsdp_hsdp_state.py --out benchmarks/memory/results/fsdp_hsdp_state.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

STEPS = 3
ZEN = {"scheme": "zen", "stats": {"summary": False},
       "dgc": {"enabled": True, "density": 0.05, "min_numel": 256, "momentum_correction": False, "warmup_steps": 0}}
NOTE = ("Under HSDP, \"sent\" and \"dense collective\" are the cross-replica all-reduce only (ZEN's, and FSDP's "
        "ring all-reduce of the same shards); FSDP's reduce-scatter over the shard dim stays dense and is in "
        "neither. DGC's state per element is 4 B / L, L the shard dim's size: the residual of the rank's shard.")
MESHES = [("1-D FSDP, 4 ranks", (4,)), ("HSDP 2 x 2 (replicate x shard)", (2, 2)),
          ("HSDP 4 x 1 (replicate only)", (4, 1))]


def _tensor_bytes(sd) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(_tensor_bytes(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(_tensor_bytes(v) for v in sd)
    return 0


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zen_ext.fsdp
    from recipes.common import build_model

    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 1000, (2, 16), generator=g) for _ in range(STEPS)]
    out = {}
    for label, shape in MESHES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
        model = build_model(os.path.join(ROOT, "configs/models/llama-tiny-untied.json"), seed=0)
        for unit in [*model.model.layers, model.get_input_embeddings()]:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        zen = zen_ext.fsdp.attach(model, ZEN)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for x in batches:
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        p_dgc = sum(p.numel() for n, p in model.named_parameters() if zen.sync.param_kinds.get(n) == "dgc")
        out[label] = {"state_bytes": _tensor_bytes(zen.state_dict()["sync"]), "p_dgc": p_dgc,
                      "p": sum(p.numel() for p in model.parameters()), "bytes_sent": zen.totals["bytes_sent"],
                      "dense_bytes": zen.totals["dense_bytes"]}
        zen.close()
    return out


def main() -> None:
    from zen_ext.comm.local import run_workers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args()
    per_rank = run_workers(_worker, 4, timeout_s=1200)
    lines = ["| mesh | P_dgc | DGC state per rank (bytes, min-max) | per DGC element | sent per rank | "
             "dense collective | ratio |", "|---|---|---|---|---|---|---|"]
    for label, _ in MESHES:
        rows = [r[label] for r in per_rank]
        lo, hi = min(r["state_bytes"] for r in rows), max(r["state_bytes"] for r in rows)
        mean = sum(r["state_bytes"] for r in rows) / len(rows)
        sent = sum(r["bytes_sent"] for r in rows) / len(rows)
        dense = sum(r["dense_bytes"] for r in rows) / len(rows)
        lines.append(f"| {label} | {rows[0]['p_dgc']:,} | {lo:,}-{hi:,} | {mean / rows[0]['p_dgc']:.2f} B | "
                     f"{sent / 1024:.1f} KiB | {dense / 1024:.1f} KiB | {sent / dense:.1%} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# DGC state per rank: 1-D FSDP vs HSDP\n\n{' '.join(__doc__.split(chr(10) * 2)[0].split())}\n\n"
                    f"`OMP_NUM_THREADS=1 python benchmarks/memory/bench_fsdp_hsdp_state.py --out {args.out}` "
                    f"(4 gloo ranks, {STEPS} steps, P = {per_rank[0][MESHES[0][0]]['p']:,} parameters)\n\n"
                    f"{text}\n\n{NOTE}\n")


if __name__ == "__main__":
    main()
