"""Helpers shared by the emulated-cluster benchmarks (bench_comm, bench_e2e, bench_overhead).

They run one process per emulated host under ``launch/netlab/launch.sh``, which sets the
torch.distributed env variables and ``NETLAB_RATE`` / ``NETLAB_MTU`` / ``NETLAB_IFNAME``. What is
measured and why (shared/research/netlab.md):

* the time of one operation is the span from the first rank's start to the **last rank's end**
  (all ranks share ``CLOCK_MONOTONIC``, which ``time.perf_counter`` reads on Linux); a gloo send
  returns once its data is in the socket buffer, so one rank's own time can be megabytes early;
* the bytes each host really sent come from ``/proc/net/dev`` of its namespace (TCP/IP headers and
  gloo's own messages included, read after a barrier), next to the Communicator's logical byte count;
* the machine's CPU: the ranks' own CPU time and the whole machine's busy fraction (``/proc/stat``),
  so a result taken while the 2 cores were saturated, or busy with other programs, shows it;
* the link-rate bound uses TCP goodput, ``rate · (MTU − 52) / (MTU + 14)``: tbf counts Ethernet,
  IP and TCP (with timestamps) headers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

_HEADER_BYTES = 52 + 14  # IPv4 + TCP with timestamps, plus the Ethernet header tbf also counts


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root: recorded paths inside it are written relative to it."""


def portable_path(path: str, work: str | None = None) -> str:
    """A path as results record it: never the machine's checkout or scratch location.

    Inside the repository it is repo-relative (``benchmarks/cluster/configs/llama-bench.json``); under the
    scratch directory ``work`` (default ``$WORK``, as ``run_cluster_report.sh`` exports it) it is
    ``$WORK/<rest>``; anywhere else only its last two components are kept (``dgc1/step_00000005.pt``).
    """
    absolute = os.path.abspath(path)
    if os.path.commonpath([absolute, ROOT]) == ROOT:
        return os.path.relpath(absolute, ROOT)
    work = work if work is not None else os.environ.get("WORK")
    if work and os.path.commonpath([absolute, os.path.abspath(work)]) == os.path.abspath(work):
        return os.path.join("$WORK", os.path.relpath(absolute, os.path.abspath(work)))
    return os.path.join(*absolute.split(os.sep)[-2:])


# --- the link -----------------------------------------------------------------------------------
def rate_bps(rate: str) -> float:
    """A tc rate string (``1gbit``, ``2500mbit``) in bits/s; ``none``/empty → 0 (unshaped)."""
    s = (rate or "").strip().lower()
    if s in ("", "none", "0", "unlimited"):
        return 0.0
    for unit, mult in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0),
                       ("gbps", 8e9), ("mbps", 8e6), ("kbps", 8e3), ("bps", 8.0)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * mult
    return float(s) * 8  # tc: a bare number is bytes/s


def goodput_bytes_per_s(rate: str, mtu: int = 1500) -> float:
    """TCP payload bytes/s one host can send (and receive) on a link of ``rate`` (0: unshaped)."""
    return rate_bps(rate) / 8 * (mtu - 52) / (mtu + 14)


@dataclass(frozen=True)
class Lab:
    """The emulated cluster this process runs in (from the launcher's environment)."""

    rate: str
    mtu: int
    ifname: str

    @classmethod
    def from_env(cls) -> "Lab":
        return cls(rate=os.environ.get("NETLAB_RATE", "none"), mtu=int(os.environ.get("NETLAB_MTU", "1500")),
                   ifname=os.environ.get("NETLAB_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo")))

    @property
    def goodput(self) -> float:
        return goodput_bytes_per_s(self.rate, self.mtu)

    def meta(self) -> dict:
        return dict(rate=self.rate, rate_bps=rate_bps(self.rate), mtu=self.mtu, goodput_Bps=self.goodput,
                    ncpu=os.cpu_count(), host=platform.node(), torch=torch.__version__,
                    loadavg=open("/proc/loadavg").read().split()[:3])


# --- counters ------------------------------------------------------------------------------------
def iface_bytes(ifname: str) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of ``ifname`` in this process's network namespace (0, 0 if absent)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if ":" in line:
                name, rest = line.split(":", 1)
                if name.strip() == ifname:
                    v = rest.split()
                    return int(v[8]), int(v[0])
    return 0, 0


def cpu_ticks() -> tuple[int, int]:
    """Machine-wide ``(busy, total)`` jiffies from ``/proc/stat`` (busy excludes idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])
    return total - v[3] - v[4], total


def busy_fraction(interval_s: float = 0.5) -> float:
    """Whole-machine busy fraction over ``interval_s``."""
    a = cpu_ticks()
    time.sleep(interval_s)
    b = cpu_ticks()
    return (b[0] - a[0]) / max(1, b[1] - a[1])


def wait_quiet(max_s: float, level: float) -> float:
    """Block until the machine's busy fraction is below ``level`` or ``max_s`` passed; returns the last one.

    Other programs on the 2 cores stretch results (shared/research/netlab.md, Variance); waiting for
    an idle moment before each measured point keeps most of that out, and the value is recorded.
    """
    t_end = time.time() + max_s
    while True:
        busy = busy_fraction()
        if busy < level or time.time() > t_end:
            return busy


def wait_quiet_all(max_s: float, level: float, rank: int) -> float:
    """``wait_quiet`` on rank 0, then a barrier, so every rank starts its repeats together; rank 0's busy
    fraction (``-1.0`` elsewhere, and when ``max_s`` is 0: no wait)."""
    if max_s <= 0:
        return -1.0
    import torch.distributed as dist

    busy = wait_quiet(max_s, level) if rank == 0 else -1.0
    dist.barrier()
    return busy


def rotated(names: list, rep: int) -> list:
    """Repeat ``rep``'s order: ``names`` rotated by ``rep``, so a slow drift of the shared machine hits
    every variant alike (interleaved repeats)."""
    k = rep % len(names)
    return names[k:] + names[:k]


# --- one timed operation over all ranks ---------------------------------------------------------
class SpanProbe:
    """Measures one operation on every rank; ``finish`` all-gathers the numbers to every rank.

    Usage (every rank)::

        probe = SpanProbe(lab)          # after a barrier
        op()
        rec = probe.finish(extra=[...]) # a dict on every rank: span, per-rank time, bytes, CPU

    ``extra`` carries per-rank floats (e.g. logical bytes) gathered alongside.
    """

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.tx0, self.rx0 = iface_bytes(lab.ifname)
        self.c0 = time.process_time()
        self.s0 = cpu_ticks()
        self.t0 = time.perf_counter()

    def finish(self, extra: list[float] | None = None) -> dict:
        import torch.distributed as dist

        t1 = time.perf_counter()
        s1 = cpu_ticks()
        c1 = time.process_time()
        # A send returns once its data is in the socket buffer, possibly before it left the shaped
        # interface: read the counters only when every rank has received everything.
        dist.barrier()
        tx1, rx1 = iface_bytes(self.lab.ifname)
        extra = list(extra or [])
        mine = torch.tensor([self.t0, t1, c1 - self.c0, tx1 - self.tx0, rx1 - self.rx0,
                             s1[0] - self.s0[0], s1[1] - self.s0[1], *extra], dtype=torch.float64)
        allv = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(allv, mine)
        m = torch.stack(allv)
        span = float(m[:, 1].max() - m[:, 0].min())
        ncpu = os.cpu_count() or 1
        busy, total = float(m[0, 5]), float(m[0, 6])
        cpu_ours = float(m[:, 2].sum()) / (span * ncpu) if span > 0 else 0.0
        cpu_all = busy / total if total else 0.0
        return dict(span=span, rank_s=[float(x) for x in m[:, 1] - m[:, 0]],
                    cpu_ours=cpu_ours, cpu_all=cpu_all, foreign=max(0.0, cpu_all - cpu_ours),
                    wire_tx=[int(x) for x in m[:, 3]], wire_rx=[int(x) for x in m[:, 4]],
                    extra=[[float(x) for x in row] for row in m[:, 7:]])


# --- statistics and output -----------------------------------------------------------------------
def mmm(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def init_from_env() -> tuple[int, int]:
    """``init_process_group("gloo")`` from the launcher's env variables; returns (rank, world_size)."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit("run this under launch/netlab/launch.sh (or torchrun): RANK is not set")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def append_jsonl(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finish_process(code: int = 0) -> None:
    """Leave the process group and exit without interpreter teardown.

    gloo on torch 2.13 aborts at interpreter exit in a few percent of runs (zen_ext/comm/local.py);
    the launcher would read that as a failed rank.
    """
    import sys

    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)
