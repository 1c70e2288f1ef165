"""What ``exchange_v``'s count round costs, and what carrying the counts in the payload saves.

Usage (the emulated cluster, where rounds cost what they cost on a network):
  ``launch/netlab/launch.sh -n 16 -r 100mbit -- benchmarks/comm/bench_count_round.py --sizes-kb 40,315,1200``

Each rank sends every peer ~size/n bytes of fp32 (±5 % per pair, fixed per run, as a sparse push's
per-pair counts move little between steps). Forms, interleaved in one run, time = the slowest rank's:

* ``count round``: ``exchange_v`` outside a slot: the counts (one ``all_to_all_single``), then the
  payloads (one ``batch_isend_irecv``);
* ``counts in payload``: ``exchange_v`` inside ``comm.slot``: one ``batch_isend_irecv`` whose messages
  carry their count and 1/16 headroom (comm/base.py, "Counts in the payload");
* ``payload only``: the same batch with the sizes known beforehand, no count anywhere: the floor of
  any one-round form;
* ``counts alone``: the count round by itself.

min / median / max over ``--reps`` repeats (after one warm-up that also sets the slot's capacities).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _bench(rank: int, n: int, sizes_kb: list[float], reps: int) -> list[tuple]:
    import torch
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    others = [j for j in range(n) if j != rank]
    rows = []
    for kb in sizes_kb:
        per_peer = int(kb * 1024 / 4 / n)
        g = torch.Generator().manual_seed(rank)
        send = [torch.randn(int(per_peer * (0.95 + 0.1 * torch.rand(1, generator=g).item()))) for _ in range(n)]
        sizes = [int(t.numel()) for t in comm.exchange_v([torch.zeros(t.numel()) for t in send])]

        def counts_alone():
            head = torch.zeros(2 * n, dtype=torch.int64)
            got = torch.empty_like(head)
            dist.all_to_all_single(got, head)
            got.tolist()

        def payload_only():
            ops = [dist.P2POp(dist.irecv, torch.empty(sizes[j]), group_peer=j) for j in others]
            ops += [dist.P2POp(dist.isend, send[j], group_peer=j) for j in others]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def in_payload():
            with comm.slot(("bench", kb)):
                comm.exchange_v(send)

        forms = {"count round": lambda: comm.exchange_v(send), "counts in payload": in_payload,
                 "payload only": payload_only, "counts alone": counts_alone}
        times: dict[str, list[float]] = {k: [] for k in forms}
        for rep in range(reps + 1):  # the first repeat warms up connections and sets the slot's capacities
            for name, fn in forms.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rep:
                    times[name].append(float(t))
        for name, ts in times.items():
            rows.append((kb, name, min(ts), statistics.median(ts), max(ts)))
    return rows


def _report(rows, n: int, reps: int, out: str | None) -> None:
    med = {(kb, name): m for kb, name, _, m, _ in rows}
    lines = [f"{n} ranks, links {os.environ.get('NETLAB_RATE', 'unshaped (local processes)')}, {reps} repeats",
             "", "| KB per rank | form | min ms | median ms | max ms | median vs count round |",
             "|---:|---|---:|---:|---:|---:|"]
    for kb, name, lo, m, hi in rows:
        lines.append(f"| {kb:g} | {name} | {1e3 * lo:.1f} | {1e3 * m:.1f} | {1e3 * hi:.1f} | "
                     f"{med[(kb, 'count round')] / m:.2f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="local processes (ignored under a launcher)")
    p.add_argument("--sizes-kb", default="40,315,1200")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None, help="append the markdown table here (rank 0)")
    a = p.parse_args(argv)
    sizes = [float(x) for x in a.sizes_kb.split(",")]
    if "RANK" in os.environ:  # under a launcher (torchrun, the emulated cluster)
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rows = _bench(dist.get_rank(), dist.get_world_size(), sizes, a.reps)
        if dist.get_rank() == 0:
            _report(rows, dist.get_world_size(), a.reps, a.out)
        dist.destroy_process_group()
        return 0
    from zen_ext.comm.local import run_workers

    rows = run_workers(_bench, a.ranks, sizes, a.reps, timeout_s=1800)[0]
    _report(rows, a.ranks, a.reps, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
