"""Does ``zen.outer.delay: 1`` hide the outer sync behind the next round? Wall time per outer round, delay 0 vs 1.

Usage (one process per emulated host; the lab's own prefix and subnet keep it apart from other labs)::

    NETLAB_PREFIX=zdl- NETLAB_SUBNET=10.79.0 nice -n 10 launch/netlab/launch.sh -n 4 -r 100mbit --port 29611 \\
        -- benchmarks/cluster/bench_outer_delay.py --density 1 --out benchmarks/cluster/results/outer_delay.jsonl

Every rank trains the demo's tiny Llama (``--model``) on its own random tokens (micro-batch ``--micro`` ×
``--seq``, AdamW) with zen.outer every H = ``--every`` steps (``--density``; 1: dense DiLoCo's all-reduce,
else SparseLoCo's picks summed by ZEN). Per repeat, in one process and on one model: ``inner`` (the
same inner steps without any outer sync: the compute floor), then delay 0 and delay 1 in alternating
order, each ``--rounds`` timed rounds after one untimed round. A round's wall time is measured on the
training thread from the end of one outer step to the end of the next (H inner steps and the outer
step); ranks start each variant together (a barrier on the default group, outside the timed rounds).
Rank 0 gathers every rank's rounds, takes per round the slowest rank (the replicas advance together:
a round ends for all when the slowest ends) and appends one JSON line per variant to ``--out``:
min/median/max over ``repeats × rounds``, and per timed round (mean over ranks) the training thread's
seconds in the outer step (``outer_s``; at delay 0 the whole sync), the sum's seconds on the thread
(``sum_s``, delay 1), the seconds the training thread waited for it (``wait_s``) and the bytes sent.
``--report JSONL --md OUT`` turns the lines into a markdown table (no training).
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


def _step(model, opt, x) -> None:
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def run(a) -> None:
    import torch.distributed as dist

    from recipes.common import build_model
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.outer import OuterSync

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(a.model, seed=0, vocab_size=a.vocab)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    numel = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, a.vocab, (a.micro, a.seq), generator=gen) for _ in range(16)]
    rounds: dict[str, list[float]] = {"inner": [], "delay0": [], "delay1": []}
    sync: dict[str, dict] = {"delay0": {}, "delay1": {}}
    for rep in range(a.repeats):
        order = ["inner"] + (["delay0", "delay1"] if rep % 2 == 0 else ["delay1", "delay0"])
        for name in order:
            model.load_state_dict(start)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            outer = None
            if name != "inner":
                cfg = dict(enabled=True, every=a.every, density=a.density, delay=int(name[-1]))
                if a.density >= 1:
                    cfg.update(lr=0.7, momentum=0.9, nesterov=True, average="mean")
                outer = OuterSync(model.named_parameters(), TorchCommunicator(), cfg, scheme="zen")
            step = 0
            for r in range(a.rounds + 1):
                if r == 1:  # round 0 is untimed (first calls, and delay 1's first sum)
                    if outer is not None:
                        outer.pop_stats()
                    dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a.every):
                    _step(model, opt, batches[step % len(batches)])
                    step += 1
                    if outer is not None:
                        outer.maybe_step(step)
                if r:
                    rounds[name].append(time.perf_counter() - t0)
            if outer is not None:
                st = outer.pop_stats()  # the timed rounds' (delay 1: the sums waited for in them)
                outer.close()
                for k in ("outer_s", "sum_s", "wait_s", "bytes_sent"):
                    sync[name][k] = sync[name].get(k, 0.0) + st[k]
            dist.barrier()
    everyone = [None] * world
    dist.all_gather_object(everyone, (rounds, sync))
    if rank == 0:
        n = a.repeats * a.rounds
        slowest = {k: [max(r[0][k][i] for r in everyone) for i in range(n)] for k in rounds}
        base = statistics.median(slowest["delay0"])
        with open(a.out, "a") as f:
            for k, xs in slowest.items():
                rec = {"variant": k, "rate": os.environ.get("NETLAB_RATE", "loopback"), "world": world,
                       "model": os.path.basename(a.model), "params": numel, "density": a.density, "every": a.every,
                       "micro": a.micro, "seq": a.seq, "repeats": a.repeats, "rounds": a.rounds,
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
    """One table row per variant and run, grouped by run (lines of one run share ``when``, rate, density)."""
    recs = [json.loads(line) for line in open(jsonl) if line.strip()]
    sys.path.insert(0, ROOT)
    from benchmarks.comm.bench_outer_bytes import provenance

    out = ["# zen.outer.delay: wall time per outer round, delay 0 vs 1", "",
           f"Command: {command}", "",
           "Each rank an emulated host (`launch/netlab`, rate per host and direction; `loopback`: torchrun on "
           "localhost, no shaping). Demo Llama, each rank on its own random tokens, H inner AdamW steps per round; "
           "`inner`: the same steps without any outer sync (the compute floor). Round time: the slowest rank's, "
           "min / median / max over repeats × rounds, variants interleaved in one process per repeat. Per round, "
           "mean over ranks: `outer s` the training thread spent in the outer step (delay 0: the whole sync), "
           "`sum s` the sum took on the communication thread (delay 1), `wait s` the training thread waited for "
           "the previous round's sum (delay 1).", "",
           "| run (UTC) | rate | R | density | H | variant | round s min / median / max | median / delay 0 | outer s "
           "| sum s | wait s | bytes sent per round |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [_row(r) for r in recs]
    out += ["", note] if note else []
    out += ["", provenance("load from other jobs varied during the runs: compare rows of one run only")]
    with open(md, "w") as f:
        f.write("\n".join(out) + "\n")


def round_cells(r: dict) -> list[str]:
    """A record's round time, its ratio to delay 0, the per-round outer / sum / wait seconds and bytes (the
    table columns after ``variant``; ``bench_fsdp_outer_delay.py`` shares them)."""
    rs = r["round_s"]
    cells = [f"{rs['min']:.3f} / {rs['median']:.3f} / {rs['max']:.3f}", f"{r['ratio_to_delay0']:.2f}"]
    cells += [f"{r[k]:.3f}" if k in r else "—" for k in ("outer_s_per_round", "sum_s_per_round", "wait_s_per_round")]
    cells.append(f"{r['bytes_sent_per_round']:,.0f}" if "bytes_sent_per_round" in r else "—")
    return cells


def _row(r: dict) -> str:
    cells = [r["when"], r["rate"], str(r["world"]), f"{r['density']:g}", str(r["every"]), r["variant"]]
    return "| " + " | ".join(cells + round_cells(r)) + " |"


def report_cli(report) -> bool:
    """``--report JSONL --md MD [--command ...] [--note ...]``: render ``report`` and return True; else False."""
    if "--report" not in sys.argv:
        return False
    q = argparse.ArgumentParser()
    q.add_argument("--report", required=True)
    q.add_argument("--md", required=True)
    q.add_argument("--command", default="see the module docstring")
    q.add_argument("--note", default="", help="a paragraph under the table")
    b = q.parse_args()
    report(b.report, b.md, b.command, b.note)
    return True


def main() -> None:
    if report_cli(report):
        return
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json"))
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--density", type=float, default=1.0)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    run(a)


if __name__ == "__main__":
    main()
