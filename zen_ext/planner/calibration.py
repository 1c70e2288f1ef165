"""``auto``'s calibration (``auto.py``): one rank's link (a probe of two all-reduce sizes for the
latency per round and the bandwidth, and of a tiny all-to-all for the cost of simultaneous flows,
unless configured) and compute rates (``compute_model.calibrate_compute``), agreed over the ranks as the slowest
rank's numbers, so every rank predicts with the same inputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..comm.base import Communicator
from ..core.cost import PRIMITIVES
from .compute_model import ComputeRates, calibrate_compute
from .network import Network

logger = logging.getLogger("zen_ext.planner")

_PROBE_SMALL_BYTES, _PROBE_BIG_BYTES, _PROBE_REPS = 8, 1 << 20, 3
_MAX_BANDWIDTH_GBPS = 10_000.0  # what a probe too fast to resolve reports


@dataclass
class Calibration:
    """One rank's agreed calibration: the link and the compute rates."""

    network: Network
    rates: ComputeRates
    measured_link: bool

    def state(self) -> dict:
        return {"bandwidth_gbps": self.network.bandwidth_gbps, "latency_us": self.network.latency_us,
                "flow_us": self.network.flow_us, "rates": self.rates.as_list(),
                "measured_link": self.measured_link}

    @classmethod
    def from_state(cls, st: dict) -> "Calibration":
        flow = st.get("flow_us")  # absent in states saved before flows had a cost of their own: the latency
        return cls(Network(float(st["bandwidth_gbps"]), float(st["latency_us"]),
                           None if flow is None else float(flow)),
                   ComputeRates.from_list(st["rates"]), bool(st["measured_link"]))


def calibrate(comm: Communicator, device: torch.device, fixed: tuple, model: str) -> Calibration:
    """Measure and agree this rank's calibration (a collective: every rank calls it once).

    1. Link probe (best of a few all-reduces of two sizes, and of a few 8-byte ``exchange_v`` with
       every peer at once), unless ``fixed`` = (bandwidth Gbit/s, latency us) configures both.
    2. Compute micro-benchmark (``model`` "compute"; "alpha_beta" models no computation).
    3. Agree on the slowest rank's numbers, one all-reduce MAX.
    Calibration traffic is control traffic, like the agreement gathers: the byte counters report what
    gradients cost, so they are restored (in place: SimWorld holds the same object) at the end.
    """
    bw, lat = fixed
    probe = comm.size > 1 and (bw is None or lat is None)
    saved_stats = comm.stats.snapshot()
    saved_ops = {k: v.snapshot() for k, v in comm.op_stats.items()}
    # Step 1: link probe (best of a few all-reduces of two sizes).
    small_s = big_s = flows_s = 0.0
    if probe:
        small_s = _best_all_reduce_s(comm, _PROBE_SMALL_BYTES, device)
        big_s = _best_all_reduce_s(comm, _PROBE_BIG_BYTES, device)
        flows_s = _best_exchange_s(comm, device)
    # Step 2: compute micro-benchmark.
    rates = calibrate_compute(device) if model == "compute" else ComputeRates()
    # Step 3: agree on the slowest rank's numbers, one all-reduce MAX.
    if comm.size > 1:
        agreed = torch.tensor([small_s, big_s, flows_s, *rates.as_list()], dtype=torch.float64, device=device)
        vals = comm.all_reduce(agreed, "max").tolist()
        small_s, big_s, flows_s, rates = vals[0], vals[1], vals[2], ComputeRates.from_list(vals[3:])
    flow = None
    if probe:
        n = comm.size
        # Ring all-reduce: 2(n−1) messages, 2(n−1)/n · size bytes per rank.
        lat_probe = small_s / (2 * (n - 1)) * 1e6
        extra = big_s - small_s
        bw_probe = (2 * (n - 1) / n * (_PROBE_BIG_BYTES - _PROBE_SMALL_BYTES) * 8 / extra / 1e9
                    if extra > 0 else _MAX_BANDWIDTH_GBPS)
        bw = bw if bw is not None else min(_MAX_BANDWIDTH_GBPS, bw_probe)
        lat = lat if lat is not None else max(0.0, lat_probe)
        if n > 2:
            # exchange_v: 2 rounds (counts, payloads) of n−1 simultaneous messages each way.
            flow = max(0.0, (flows_s * 1e6 - 2 * lat) / (2 * (n - 2)))
    cal = Calibration(Network(bw if bw is not None else 10.0, lat if lat is not None else 50.0, flow), rates,
                       measured_link=probe)
    for key, value in saved_stats.as_dict().items():
        setattr(comm.stats, key, value)
    comm.op_stats.clear()
    comm.op_stats.update(saved_ops)
    if comm.rank == 0:
        logger.info("auto: calibrated: link %.3g Gbit/s, %.3g us per round, %s us per extra flow (%s); compute %s",
                    cal.network.bandwidth_gbps, cal.network.latency_us,
                    "=latency" if flow is None else f"{flow:.3g}", "probe" if probe else "configured",
                    ", ".join(f"{k} {v:.3g}" for k, v in zip(PRIMITIVES, rates.as_list()))
                    if model == "compute" else "not modeled")
    return cal


def _best_exchange_s(comm: Communicator, device: torch.device) -> float:
    """Best of ``_PROBE_REPS`` timed ``exchange_v`` of 8 bytes to every peer (after one warm-up)."""
    send = [torch.zeros(2, dtype=torch.float32, device=device) for _ in range(comm.size)]
    cuda = device.type == "cuda"
    best = float("inf")
    for i in range(_PROBE_REPS + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        comm.exchange_v(send)
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def _best_all_reduce_s(comm: Communicator, nbytes: int, device: torch.device) -> float:
    """Best of ``_PROBE_REPS`` timed all-reduces of ``nbytes`` (after one warm-up) on ``device``."""
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    best = float("inf")
    for i in range(_PROBE_REPS + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        comm.all_reduce(t, "sum")
        if cuda:
            torch.cuda.synchronize(device)
        if i:  # the first one warms the connection up
            best = min(best, time.perf_counter() - t0)
    return best
