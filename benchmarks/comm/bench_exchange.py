"""Variable-size exchange on gloo: one ``batch_isend_irecv`` (``p2p``) vs one ``all_to_all_single`` (``a2a``).

Usage:
  local processes:  ``python benchmarks/comm/bench_exchange.py --ranks 4``
  under a launcher: ``torchrun --nproc_per_node 4 benchmarks/comm/bench_exchange.py`` (or the emulated cluster
  of launch/, which is where link-rate effects show; on loopback both run at memory speed).

Each rank sends a different number of fp32 elements to each peer (uniform in [0.5, 1.5] × size/n), as a
sparse push does. Both transports run interleaved in the same run; min/median/max over repeats go to
stdout and to ``--out`` (markdown). Under the emulated cluster (``NETLAB_RATE`` set) the table also gives
the link efficiency: the busiest host's payload bytes in its busier direction (TX or RX) over the median
time, divided by the link rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _bench(rank: int, world_size: int, sizes_mb: list[float], reps: int) -> list[tuple]:
    import torch
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator

    comms = {impl: TorchCommunicator(exchange_impl=impl) for impl in ("p2p", "a2a")}
    rows = []
    for mb in sizes_mb:
        per_peer = int(mb * 2**20 / 4 / world_size)
        g = torch.Generator().manual_seed(rank)
        send = [torch.randn(int(per_peer * (0.5 + torch.rand(1, generator=g).item()))) for _ in range(world_size)]
        # The busiest host's payload bytes in its busier direction bound the time on a shaped link.
        tx = sum(4 * t.numel() for j, t in enumerate(send) if j != rank)
        rx = comms["p2p"].exchange_v([torch.tensor([float(4 * t.numel())]) for t in send])
        io = torch.tensor([float(max(tx, sum(float(r) for j, r in enumerate(rx) if j != rank)))])
        dist.all_reduce(io, op=dist.ReduceOp.MAX)
        times = {impl: [] for impl in comms}
        for rep in range(reps + 1):  # the first round warms up connections
            for impl, comm in comms.items():
                dist.barrier()
                t0 = time.perf_counter()
                comm.exchange_v(send)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rep:
                    times[impl].append(float(t))
        for impl, ts in times.items():
            rows.append((mb, impl, min(ts), statistics.median(ts), max(ts), float(io)))
    return rows


def _rate_bps(rate: str | None) -> float | None:
    """``NETLAB_RATE`` (``1gbit``, ``2500mbit``) in bits per second; None when not shaped."""
    if not rate or rate == "none":
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    return None


def _report(rows, world_size: int, out: str | None) -> None:
    rate = _rate_bps(os.environ.get("NETLAB_RATE"))
    lines = ["| MiB per rank | transport | min s | median s | max s | median vs a2a | busiest host MiB | link efficiency |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    med = {(mb, impl): m for mb, impl, _, m, _, _ in rows}
    for mb, impl, lo, m, hi, io in rows:
        eff = f"{8 * io / m / rate:.0%}" if rate else "n/a (unshaped)"
        lines.append(f"| {mb:g} | {impl} | {lo:.4f} | {m:.4f} | {hi:.4f} | {med[(mb, 'a2a')] / m:.2f}× | "
                     f"{io / 2**20:.1f} | {eff} |")
    where = f"emulated cluster, {os.environ.get('NETLAB_RATE')} links" if rate else "local processes (loopback)"
    text = f"# Variable-size exchange on gloo, {world_size} ranks, {where}\n\n" + "\n".join(lines) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="local processes (ignored under a launcher)")
    p.add_argument("--sizes-mb", default="1,16,64")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    sizes = [float(x) for x in a.sizes_mb.split(",")]
    if "RANK" in os.environ:  # started by torchrun / deepspeed / the emulated-cluster launcher
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rows = _bench(dist.get_rank(), dist.get_world_size(), sizes, a.reps)
        if dist.get_rank() == 0:
            _report(rows, dist.get_world_size(), a.out)
        dist.destroy_process_group()
        return 0
    from zen_ext.comm.local import run_workers

    rows = run_workers(_bench, a.ranks, sizes, a.reps, timeout_s=1800)[0]
    _report(rows, a.ranks, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
