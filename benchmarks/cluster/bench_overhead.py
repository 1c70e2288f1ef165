"""ZEN's compute overhead (hashing, encoding, aggregation, decoding) vs the communication time it saves.

Usage (``benchmarks/cluster/run_cluster_report.sh`` runs it after ``bench_comm.py``)::

    .venv/bin/python benchmarks/cluster/bench_overhead.py --workload synth_dgc1=/tmp/zen_cluster/workloads/synth_dgc1 \\
        --comm benchmarks/cluster/results/cluster_comm.jsonl --out benchmarks/cluster/results/cluster_overhead.jsonl

Compute is measured without any network and without the other ranks competing for the CPU, as each
rank would see it on a machine of its own:

1. Record: the scheme runs once on ``n`` SimWorld ranks, each rank's Communicator wrapped so that
   everything it receives (exchange, all-gather, all-reduce results) is kept.
2. Replay: each rank's sync runs again, alone, on a Communicator that hands back the recorded
   data at once; the scheme's own phase timers (``timings``) then hold pure compute — ``hash_s``
   (h0 partition: the C++ op when built), ``push_s``/``pull_s`` (packing the payloads and the hash
   bitmap: the encoding), ``aggregate_s`` and ``decode_s``. Repeated ``--reps`` times, interleaved
   over ranks; per repeat the slowest rank counts.

The time saved comes from the emulated-cluster runs (``--comm``: bench_comm's JSON lines, same
workload label and lab rate): ``dense`` median − scheme median. That saving is already net of the
overhead (the lab run includes it), so ``overhead / saved`` is the fraction the paper's target
(hashing ≤ 5 % of the time saved) refers to.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_comm import LOW_BIT, load_workload  # noqa: E402
from cluster_common import append_jsonl, mmm, portable_path, read_jsonl  # noqa: E402

from zen_ext import SimWorld, build_scheme  # noqa: E402
from zen_ext.comm.base import Communicator  # noqa: E402

ENCODE_PHASES = ("push_s", "pull_s")


class RecordingComm(Communicator):
    """Delegates to a SimWorld rank and keeps a copy of everything this rank receives, in order."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__()
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.log: list[tuple[str, object]] = []

    def _exchange_v(self, send):
        out = self.inner._exchange_v(send)
        self.log.append(("exchange_v", [t.clone() for t in out]))
        return out

    def _all_gather_v(self, t):
        out = self.inner._all_gather_v(t)
        self.log.append(("all_gather_v", [x.clone() for x in out]))
        return out

    def _all_reduce(self, t, op):
        self.inner._all_reduce(t, op)
        self.log.append(("all_reduce", t.clone()))

    def _broadcast(self, t, src):
        self.inner._broadcast(t, src)
        self.log.append(("broadcast", t.clone()))


class ReplayComm(Communicator):
    """Hands back what ``RecordingComm`` recorded for one rank, instantly (no peers, no network)."""

    def __init__(self, rank: int, size: int, log: list[tuple[str, object]]) -> None:
        super().__init__()
        self.rank, self.size, self._log, self._at = rank, size, log, 0

    def _next(self, kind: str):
        got, data = self._log[self._at]
        if got != kind:
            raise RuntimeError(f"replay of rank {self.rank}: call {self._at} is {kind}, recorded {got}")
        self._at += 1
        return data

    def _exchange_v(self, send):
        return list(self._next("exchange_v"))

    def _all_gather_v(self, t):
        return list(self._next("all_gather_v"))

    def _all_reduce(self, t, op):
        t.copy_(self._next("all_reduce"))

    def _broadcast(self, t, src):
        t.copy_(self._next("broadcast"))


def rank_inputs(step, n: int) -> list[dict]:
    """Every rank's slices; beyond the trace's ranks, rank ``r`` replays trace rank ``r % world_size``
    (the union and the per-rank density stay the trace's; only the number of ranks grows)."""
    keys = list(step.slices)
    return [{k: step.slices[k][r % step.world_size] for k in keys} for r in range(n)]


def with_low_bits(inputs: list[dict], bits: int) -> list[dict]:
    """Every rank's slices as DGC hands them over with ``zen.dgc.value_bits`` = ``bits``: each with its
    ``LowBitValues`` and its own owner residual (zeros at first, kept across calls as training keeps it)."""
    import dataclasses

    from zen_ext.core.lowbit import LowBitValues

    out = []
    for mine in inputs:
        res: dict = {}
        out.append({k: dataclasses.replace(g, lowbit=LowBitValues(bits, owner_residual=(
            lambda m, device, k=k, res=res: res.setdefault(k, torch.zeros(m, device=device))))) for k, g in mine.items()})
    return out


def measure(scheme_name: str, step, n: int, reps: int, use_out: bool = False) -> dict:
    """Per-phase compute seconds of ``scheme_name`` on every slice of ``step`` (see the module docstring);
    ``zen_v8`` / ``zen_v4``: ZEN with ``zen.dgc.value_bits`` (``bench_comm.LOW_BIT``).

    With ``use_out`` the result goes into a preallocated buffer per slice (``sync(..., out=)``), as an
    engine passes its bucket; ``cpu_total_s`` is the thread's CPU time (less sensitive to foreign load).
    """
    scheme = build_scheme("zen" if scheme_name in LOW_BIT else scheme_name)
    keys = list(step.slices)
    inputs = rank_inputs(step, n)
    if scheme_name in LOW_BIT:
        inputs = with_low_bits(inputs, LOW_BIT[scheme_name])

    # Step 1: record what every rank receives.
    def record(comm, mine):
        rec = RecordingComm(comm)
        for k in keys:
            scheme.sync(rec, mine[k], key=k)
        return rec.log

    logs = SimWorld(n, max_active=1).run(record, inputs)

    # Step 2: replay each rank alone; the slowest rank of a repeat counts.
    per_rep: list[dict[str, float]] = []
    for _ in range(reps):
        worst: dict[str, float] = {}
        for r in range(n):
            replay = ReplayComm(r, n, logs[r])
            phases: dict[str, float] = {}
            outs = {k: torch.zeros(inputs[r][k].dense_numel, dtype=inputs[r][k].values.dtype) for k in keys} \
                if use_out else {}
            t0, c0 = time.perf_counter(), time.thread_time()
            for k in keys:
                t: dict = {}
                scheme.sync(replay, inputs[r][k], key=k, timings=t, out=outs.get(k))
                for name, v in t.items():
                    if isinstance(v, float):
                        phases[name] = phases.get(name, 0.0) + v
            phases["total_s"] = time.perf_counter() - t0
            phases["cpu_total_s"] = time.thread_time() - c0
            for name, v in phases.items():
                worst[name] = max(worst.get(name, 0.0), v)
        per_rep.append(worst)
    names = sorted({k for p in per_rep for k in p})
    return {name: mmm([p.get(name, 0.0) for p in per_rep]) for name in names}


def decode_profile(step, n: int, reps: int, seed: int = 0) -> dict:
    """Where ``zen``'s decode goes on one rank, piece by piece, and what a ``P⁻¹`` table would change.

    ``zen`` decodes the pulled union with the building blocks timed here: a dense result of
    ``numel`` rows (every scheme builds one), the hash bitmap of each server's ``|𝕀_i|`` positions,
    ``P⁻¹`` of all ``|∪I|`` positions (the table-free bitmap: a keyed Feistel permutation of
    ``[0, 2^bits)`` with cycle walking back into ``[0, numel)``), and the scatter of the values. The paper instead keeps each
    server's ordered index set in memory; a ``numel``-entry inverse table turns ``P⁻¹`` into a gather.
    Timed on the first slice (medians over ``reps``).
    """
    from zen_ext import ops
    from zen_ext.core.bitmap import decode_bitmap, encode_bitmap
    from zen_ext.core.hashing import HashPartitioner

    grads = next(iter(step.slices.values()))[:n]
    numel, width = grads[0].numel, grads[0].row_width
    part = HashPartitioner(numel, n, seed)
    y = ops.permute(torch.unique(torch.cat([g.indices for g in grads])), numel, part.keys)
    bitmaps = []
    for i in range(n):
        mask = torch.zeros(part.part_size(i), dtype=torch.bool)
        mask[y[y % n == i] // n] = True
        bitmaps.append((encode_bitmap(mask), mask.numel()))
    vals = torch.ones(y.numel(), width) if width > 1 else torch.ones(y.numel())
    t0 = time.perf_counter()
    table = part.unpermute(torch.arange(numel, dtype=torch.int64)).to(torch.int32)
    build_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    for _ in range(reps):
        out = timed("dense_result_s", lambda: torch.zeros((numel, width) if width > 1 else numel))
        timed("bitmap_decode_s", lambda: [decode_bitmap(b, m) for b, m in bitmaps])
        idx = timed("unpermute_s", lambda: part.unpermute(y))
        timed("table_gather_s", lambda: table[y])
        timed("scatter_s", lambda: out.__setitem__(idx, vals))
    bits = max(2, (numel - 1).bit_length())  # the Feistel domain 2^bits (csrc/hashing.h domain_bits)
    return dict(union=y.numel(), numel=numel, row_width=width, **{k: statistics.median(v) for k, v in times.items()},
                table_build_s=build_s, table_bytes=table.numel() * 4, cycle_walk_domain=(1 << bits) / numel)


def _old_decode(pulled: list[tuple[torch.Tensor, torch.Tensor]], part, numel: int) -> torch.Tensor:
    """The decode zen did before the fused op (commit 6dcf3db), for the before/after comparison:
    a fresh dense result, numpy bitmap unpacking per server, ``P⁻¹`` of the concatenated union, a scatter."""
    from zen_ext.core.bitmap import decode_bitmap

    n = part.num_parts
    ys, vs = [], []
    for i, (bm, vals) in enumerate(pulled):
        pos = decode_bitmap(bm, part.part_size(i))
        ys.append(pos * n + i)
        vs.append(vals)
    out = torch.zeros(numel, dtype=pulled[0][1].dtype)
    out[part.unpermute(torch.cat(ys))] = torch.cat(vs)
    return out


def decode_compare(step, n: int, reps: int, seed: int = 0) -> dict:
    """zen's decode of the pulled union of the first slice, before (``_old_decode``) and after
    (zero the caller's buffer + ``zen_ext::decode_pull_`` per server), interleaved in one run.

    Wall and thread-CPU seconds, (min, median, max) over ``reps``; both results are checked equal.
    """
    from zen_ext import ops
    from zen_ext.core.bitmap import encode_bitmap
    from zen_ext.core.hashing import HashPartitioner
    from zen_ext.ops import _reference

    grads = [next(iter(step.slices.values()))[r % step.world_size] for r in range(n)]
    numel = grads[0].numel
    if grads[0].row_width != 1:
        return {}
    part = HashPartitioner(numel, n, seed)
    y = ops.permute(torch.unique(torch.cat([g.indices for g in grads])), numel, part.keys)
    old_in, new_in = [], []
    for i in range(n):
        p = torch.sort(y[y % n == i] // n).values  # ascending: the bitmap's value order
        m = part.part_size(i)
        mask = torch.zeros(m, dtype=torch.bool)
        mask[p] = True
        vals = torch.randn(p.numel())
        old_in.append((encode_bitmap(mask), vals))
        acc, words, count = ops.aggregate_push([torch.cat([p.to(torch.int32).view(torch.uint8), vals.view(torch.uint8)])],
                                               m, 1, torch.float32, 4)
        new_in.append(ops.encode_pull(acc, words, ops.read_aggregate_count(count), _reference.FMT_BITMAP, 1, torch.float32, 4))
    out = torch.empty(numel)
    keys = part.keys_on("cpu")

    def new():
        out.zero_()
        for i, msg in enumerate(new_in):
            ops.decode_pull_(out, msg, i, n, keys, 4)
        return out

    assert torch.equal(_old_decode(old_in, part, numel), new()), "old and new decode disagree"
    t = {k: [] for k in ("before_wall_s", "after_wall_s", "before_cpu_s", "after_cpu_s", "after_zero_cpu_s")}
    for _ in range(reps):
        for name, fn in (("before", lambda: _old_decode(old_in, part, numel)), ("after", new)):
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            t[f"{name}_cpu_s"].append(time.thread_time() - c0)
            t[f"{name}_wall_s"].append(time.perf_counter() - w0)
        c0 = time.thread_time()
        out.zero_()
        t["after_zero_cpu_s"].append(time.thread_time() - c0)
    # Pipelined pull, modelled with the measured per-message decode times: messages land one after
    # another at the link rate (the own message at once); decoding each on arrival ends at
    # max(arrival, previous end) + its decode, decoding after the whole all-gather at last arrival + all.
    per_msg = []
    for i, msg in enumerate(new_in):
        c0 = time.thread_time()
        ops.decode_pull_(out, msg, i, n, keys, 4)
        per_msg.append(time.thread_time() - c0)
    pipe = {}
    for rate_bps in (1e9, 10e9):
        arrive, at = [], 0.0
        for i, msg in enumerate(new_in):
            at += 0.0 if i == 0 else msg.numel() * 8 / rate_bps
            arrive.append(at)
        end = 0.0
        for a_i, d_i in zip(arrive, per_msg):
            end = max(end, a_i) + d_i
        pipe[f"{rate_bps / 1e9:g}gbit"] = dict(blocking_s=arrive[-1] + sum(per_msg), pipelined_s=end,
                                                wire_s=arrive[-1])
    return dict(union=y.numel(), numel=numel, n=n, pipeline_model=pipe, **{k: mmm(v) for k, v in t.items()})


def transient_bytes(scheme_name: str, step, n: int, use_out: bool = True) -> dict:
    """Peak bytes of tensors allocated during one replayed sync of the first slice by rank 0, over
    the bucket's bytes. Counted with a TorchDispatchMode (every op output with a fresh storage adds
    its bytes until the tensor is freed); the caller's ``out`` and the received messages are not
    counted (they exist in any scheme). An approximation: a view that outlives its base is not seen.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    key = next(iter(step.slices))
    inputs = rank_inputs(step, n)
    grad = inputs[0][key]
    scheme = build_scheme(scheme_name)

    def record(comm, mine):
        rec = RecordingComm(comm)
        scheme.sync(rec, mine[key], key=key)
        return rec.log

    log = SimWorld(n, max_active=1).run(record, inputs)[0]

    class Peak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0

        def _free(self, nbytes):
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    nb = t.untyped_storage().nbytes()
                    self.live += nb
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, nb)
            return out

    out = torch.zeros(grad.dense_numel, dtype=grad.values.dtype) if use_out else None
    with Peak() as pk:
        scheme.sync(ReplayComm(0, n, log), grad, key=key, out=out)
    bucket = grad.dense_numel * grad.values.element_size()
    return dict(scheme=scheme_name, peak_bytes=pk.peak, bucket_bytes=bucket, ratio=pk.peak / bucket)


def saved_s(comm_rows: list[dict], label: str, scheme: str, rate: str) -> tuple[float, float] | None:
    """(dense median, scheme median) of the newest bench_comm rows for ``label`` at ``rate``."""
    med = {}
    for r in comm_rows:
        if r.get("workload") == label and r.get("rate") == rate:
            med[r["scheme"]] = r["t_med"]
    if "dense" in med and scheme in med:
        return med["dense"], med[scheme]
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", required=True, help="label=path[@step]; repeatable")
    p.add_argument("--schemes", type=lambda s: s.split(","), default=["zen", "zen_coo"])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--comm", default=None, help="bench_comm JSON lines (time saved per rate)")
    p.add_argument("--rates", default="1gbit,2500mbit", help="lab rates to relate the overhead to")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--use-out", action="store_true", help="schemes write into a preallocated buffer (out=)")
    p.add_argument("--compare", default="", help="scheme to relate zen's compute to (e.g. agsparse)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    comm_rows = read_jsonl(a.comm) if a.comm else []
    print(f"{'workload':>16} {'scheme':>8} {'hash ms':>8} {'encode ms':>9} {'aggr ms':>8} {'decode ms':>9} "
          f"{'total ms':>8}  saved / overhead per rate", flush=True)
    for spec in a.workload:
        label, path, step = load_workload(spec)
        n = a.ranks  # beyond the trace's ranks, ranks replay trace ranks (rank_inputs)
        dp = decode_profile(step, min(n, step.world_size), a.reps)
        dc = decode_compare(step, n, a.reps)
        if dc:
            f = lambda v: "/".join(f"{1e3 * x:.1f}" for x in v)  # noqa: E731
            print(f"{label:>16} decode of the union ({dc['union']:,} of {dc['numel']:,}, n={n}) min/med/max ms: before "
                  f"wall {f(dc['before_wall_s'])} cpu {f(dc['before_cpu_s'])}; after wall {f(dc['after_wall_s'])} "
                  f"cpu {f(dc['after_cpu_s'])} (zeroing the buffer alone: cpu {f(dc['after_zero_cpu_s'])}); "
                  f"cpu median ratio after/before {dc['after_cpu_s'][1] / dc['before_cpu_s'][1]:.2f}", flush=True)
            for rate, pm in dc["pipeline_model"].items():
                print(f"{label:>16} pull + decode at {rate} (model, measured decodes): wire {1e3 * pm['wire_s']:.1f} ms, "
                      f"decode after the all-gather {1e3 * pm['blocking_s']:.1f} ms, on arrival "
                      f"{1e3 * pm['pipelined_s']:.1f} ms", flush=True)
        totals = {}
        for scheme in a.schemes + ([a.compare] if a.compare and a.compare not in a.schemes else []):
            mem = transient_bytes(scheme, step, n, use_out=a.use_out)
            print(f"{label:>16} {scheme:>8} transient memory of one sync: {mem['peak_bytes'] / 2**20:.1f} MiB = "
                  f"{mem['ratio']:.2f}x the bucket ({mem['bucket_bytes'] / 2**20:.1f} MiB)", flush=True)
            ph = measure(scheme, step, n, a.reps, use_out=a.use_out)
            totals[scheme] = ph
            print(f"{label:>16} {scheme:>8} whole sync compute min/med/max ms: wall "
                  f"{'/'.join(f'{1e3 * x:.1f}' for x in ph['total_s'])}, cpu "
                  f"{'/'.join(f'{1e3 * x:.1f}' for x in ph['cpu_total_s'])}", flush=True)
            med = {k: v[1] for k, v in ph.items()}
            compute = sum(med.get(k, 0.0) for k in ("hash_s", *ENCODE_PHASES, "aggregate_s", "decode_s"))
            vs = {}
            for rate in a.rates.split(","):
                got = saved_s(comm_rows, label, scheme, rate)
                if got:
                    dense_s, scheme_s = got
                    saved = dense_s - scheme_s
                    vs[rate] = dict(dense_s=dense_s, scheme_s=scheme_s, saved_s=saved,
                                    hash_over_saved=med.get("hash_s", 0.0) / saved if saved > 0 else None,
                                    overhead_over_saved=compute / saved if saved > 0 else None)
            rec = dict(bench="overhead", workload=label, path=portable_path(path), step=step.step, n=n, scheme=scheme,
                       reps=a.reps, use_out=a.use_out, decode_compare=dc, transient_memory=mem,
                       phases={k: dict(min=v[0], med=v[1], max=v[2]) for k, v in ph.items()},
                       hash_s=med.get("hash_s", 0.0), encode_s=sum(med.get(k, 0.0) for k in ENCODE_PHASES),
                       aggregate_s=med.get("aggregate_s", 0.0), decode_s=med.get("decode_s", 0.0),
                       compute_s=compute, vs_lab=vs, decode_profile=dp, torch=torch.__version__,
                       loadavg=open("/proc/loadavg").read().split()[:3])
            rel = "  ".join(f"{rate}: saved {v['saved_s'] * 1e3:.0f} ms, overhead {100 * v['overhead_over_saved']:.1f} %"
                            for rate, v in vs.items() if v["overhead_over_saved"] is not None)
            print(f"{label:>16} {scheme:>8} {1e3 * rec['hash_s']:8.2f} {1e3 * rec['encode_s']:9.2f} "
                  f"{1e3 * rec['aggregate_s']:8.2f} {1e3 * rec['decode_s']:9.2f} {1e3 * compute:8.2f}  {rel}", flush=True)
            if a.out:
                append_jsonl(a.out, rec)
        print(f"{label:>16} decode pieces: dense result {1e3 * dp['dense_result_s']:.2f} ms, bitmaps "
              f"{1e3 * dp['bitmap_decode_s']:.2f} ms, P^-1 of the union ({dp['union']:,} of {dp['numel']:,}; Feistel "
              f"domain {dp['cycle_walk_domain']:.2f}x numel) {1e3 * dp['unpermute_s']:.2f} ms, scatter "
              f"{1e3 * dp['scatter_s']:.2f} ms; a {dp['table_bytes'] / 2**20:.0f} MiB inverse table would replace "
              f"P^-1 by a {1e3 * dp['table_gather_s']:.2f} ms gather (built once in {dp['table_build_s']:.2f} s)",
              flush=True)
        if a.compare and a.compare in totals:
            for scheme in a.schemes:
                if scheme != a.compare and scheme in totals:
                    for kind in ("total_s", "cpu_total_s"):
                        r = [x / y for x, y in zip(totals[scheme][kind], totals[a.compare][kind])]
                        print(f"{label:>16} {scheme} / {a.compare} whole compute ({kind}, n={n}): min/med/max of "
                              f"the per-statistic ratios {r[0]:.2f}/{r[1]:.2f}/{r[2]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
