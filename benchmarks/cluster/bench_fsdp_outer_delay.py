"""Does ``zen.outer.delay: 1`` hide the outer sync behind the next round on FSDP2 HSDP? Wall time per outer
round, delay 0 vs 1, ``zen_ext.engines.fsdp_outer`` on a ``(replicas, shard)`` mesh.

Usage (2 emulated hosts, 2 ranks each: a replica group per host, its shard traffic on the host's loopback
and the outer sync across the shaped link; or plain torchrun on localhost)::

    NETLAB_PREFIX=zfd- NETLAB_SUBNET=10.81.0 nice -n 10 launch/netlab/launch.sh -n 2 -p 2 -r 25mbit \\
        --port 29631 -- benchmarks/cluster/bench_fsdp_outer_delay.py --out benchmarks/cluster/results/fsdp_outer_delay.jsonl
    nice -n 10 torchrun --nproc_per_node 4 benchmarks/cluster/bench_fsdp_outer_delay.py --out ...

Every rank trains the demo's tiny Llama (``--model``), sharded as the FSDP2 recipe shards it
(``recipes/finetune_llm_fsdp.py``'s ``shard``) on a ``(--replicas, world / replicas)`` mesh, on its own random
tokens (micro-batch ``--micro`` × ``--seq``, AdamW), with zen.outer every H = ``--every`` steps (``--density``;
1: dense DiLoCo's all-reduce of the shard, else SparseLoCo's picks summed by ZEN). Per repeat, a fresh model
per variant: ``inner`` (the same inner steps, FSDP's cross-replica all-reduce off and no outer step: the
compute floor), then delay 0 and delay 1 in alternating order, each ``--rounds`` timed rounds after one
untimed round. A round's wall time is measured on the training thread from the end of one outer step to the
end of the next; rank 0 takes per round the slowest rank and appends one JSON line per variant to ``--out``
(min/median/max over ``repeats × rounds``, the per-round means of ``outer_s``, ``sum_s``, ``wait_s`` and
bytes sent, as ``bench_outer_delay.py`` does for plain replicas). ``--report JSONL --md OUT`` writes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_outer_delay import report_cli, round_cells  # noqa: E402  (the same table as DDP's)


def _variant(a, name, mesh, batches, rank):
    """One variant's rounds on a fresh sharded model: per timed round the seconds, and the sync's totals."""
    import torch.distributed as dist

    from recipes.common import build_model
    from recipes.finetune_llm_fsdp import shard
    from zen_ext.engines.fsdp_outer import register_outer

    model = build_model(a.model, seed=0, vocab_size=a.vocab)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = dict(enabled=True, every=a.every if name != "inner" else 10**9, density=a.density,
               delay=int(name == "delay1"))
    if a.density >= 1:
        cfg.update(lr=0.7, momentum=0.9, nesterov=True, average="mean")
    outer = register_outer(model, {"scheme": "zen", "outer": cfg}, opt)
    times, step = [], 0
    for r in range(a.rounds + 1):
        if r == 1:  # round 0 is untimed (first calls, and delay 1's first sum)
            outer.pop_stats()
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.every):
            x = batches[step % len(batches)]
            model(input_ids=x, labels=x).loss.backward()
            opt.step()  # every H-th: the outer step (a post-step hook)
            opt.zero_grad()
            step += 1
        if r:
            times.append(time.perf_counter() - t0)
    st = outer.pop_stats()  # the timed rounds' (delay 1: the sums waited for in them)
    outer.close()
    dist.barrier()
    return times, {k: st[k] for k in ("outer_s", "sum_s", "wait_s", "bytes_sent")}, \
        sum(p.to_local().numel() for p in model.parameters())


def run(a) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (a.replicas, world // a.replicas), mesh_dim_names=("replicate", "shard"))
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, a.vocab, (a.micro, a.seq), generator=gen) for _ in range(16)]
    rounds: dict[str, list[float]] = {"inner": [], "delay0": [], "delay1": []}
    sync: dict[str, dict] = {"delay0": {}, "delay1": {}}
    local = 0
    for rep in range(a.repeats):
        for name in ["inner"] + (["delay0", "delay1"] if rep % 2 == 0 else ["delay1", "delay0"]):
            times, st, local = _variant(a, name, mesh, batches, rank)
            rounds[name] += times
            if name != "inner":
                for k, v in st.items():
                    sync[name][k] = sync[name].get(k, 0.0) + v
    everyone = [None] * world
    dist.all_gather_object(everyone, (rounds, sync, local))
    if rank == 0:
        n = a.repeats * a.rounds
        slowest = {k: [max(r[0][k][i] for r in everyone) for i in range(n)] for k in rounds}
        base = statistics.median(slowest["delay0"])
        with open(a.out, "a") as f:
            for k, xs in slowest.items():
                rec = {"variant": k, "rate": os.environ.get("NETLAB_RATE", "loopback"), "world": world,
                       "mesh": [a.replicas, world // a.replicas], "shard_elements": everyone[0][2],
                       "density": a.density, "every": a.every, "micro": a.micro, "seq": a.seq,
                       "repeats": a.repeats, "rounds": a.rounds,
                       "round_s": {"min": min(xs), "median": statistics.median(xs), "max": max(xs)},
                       "ratio_to_delay0": statistics.median(xs) / base,
                       "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load1": os.getloadavg()[0]}
                if k != "inner":
                    for s in ("outer_s", "sum_s", "wait_s", "bytes_sent"):
                        rec[s + "_per_round"] = statistics.mean(r[1][k][s] for r in everyone) / n
                f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def report(jsonl: str, md: str, command: str, note: str = "") -> None:
    """One table row per variant and run."""
    from benchmarks.comm.bench_outer_bytes import provenance

    recs = [json.loads(line) for line in open(jsonl) if line.strip()]
    out = ["# zen.outer.delay on FSDP2 HSDP: wall time per outer round, delay 0 vs 1", "",
           f"Command: {command}", "",
           "`zen_ext.engines.fsdp_outer` on a (replicas, shard) mesh; `rate`: the shaped link between emulated "
           "hosts (`launch/netlab`, one replica group per host, its shard traffic on the host's loopback), "
           "`loopback`: torchrun on localhost. Demo Llama sharded as the FSDP2 recipe shards it, each rank on its "
           "own random tokens, H inner AdamW steps per round; `inner`: the same steps without any outer sync (the "
           "compute floor). Round time: the slowest rank's, min / median / max over repeats × rounds, variants "
           "interleaved in one process. Per round, mean over ranks: `outer s` the training thread spent in the "
           "outer step (delay 0: the whole sync), `sum s` the sum took on the communication thread (delay 1), "
           "`wait s` the training thread waited for the previous round's sum (delay 1).", "",
           "| run (UTC) | rate | mesh | density | H | variant | round s min / median / max | median / delay 0 | "
           "outer s | sum s | wait s | bytes sent per round | load1 |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        cells = [r["when"], r["rate"], "{} × {}".format(*r["mesh"]), f"{r['density']:g}", str(r["every"]),
                 r["variant"], *round_cells(r), f"{r['load1']:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", note] if note else []
    out += ["", provenance("load from other jobs varied during the runs: compare rows of one run only")]
    with open(md, "w") as f:
        f.write("\n".join(out) + "\n")


def main() -> None:
    if report_cli(report):
        return
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json"))
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--density", type=float, default=1.0)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    run(a)


if __name__ == "__main__":
    main()
