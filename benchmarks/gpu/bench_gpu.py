"""GPU cost of DGC and ZEN, each as a ratio to a baseline measured in the same run (docs/kernels.md).

Usage (on a GPU machine, after the extension is built; ~1 minute)::

    python benchmarks/gpu/bench_gpu.py --out benchmarks/gpu/results/gpu_bench.md
    python benchmarks/gpu/bench_gpu.py --device cpu --small      # the CPU smoke run that CI does

1. DGC per bucket (``bench_dgc.py``'s ``large`` and ``bench`` buckets, fp32 and bf16, AdamW settings:
   momentum correction off): time of one compression (CUDA events, after warm-up) against 8 memory
   passes over the bucket (``torch.add(bucket, other, out=buf)`` eight times, timed interleaved);
   kernel launches (profiler), host synchronizations (``torch.cuda.set_sync_debug_mode``) and transient
   memory (peak allocated above the start, in multiples of the bucket) of one compression.
2. ZEN per rank against AGsparse on the same input, in SimWorld on one GPU (n = 8 and 16, 50 M elements,
   1 % and 5 % per rank): GPU busy time (sum of the profiled kernels) per rank, and against one memory
   pass over the rank's result (a write of ``numel`` elements).
3. Hashing (``hash_partition``) at the paper's scale, 214 M elements at 5.2 %: median time.
4. The optimizer step DGC runs under: ``zen_ext.optim.CatchUpAdamW`` against torch's AdamW (foreach;
   fused on a GPU) on the ``large`` bucket's tensors and on one flat tensor of the same size (what a
   ZeRO-1/2 partition is), a DGC-like gradient (5 % of the entries non-zero); kernel launches per step.

Each figure is min / median / max over ``--reps`` repeats; ratios are taken per repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.comm.bench_dgc import BUCKETS, grads_of, make_bucket  # noqa: E402

from zen_ext import SimWorld, SparseGrad, build_scheme, ops  # noqa: E402
from zen_ext.compress import DGCConfig  # noqa: E402
from zen_ext.compress import dgc as dgc_mod  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="small sizes (the CPU smoke run)")
    p.add_argument("--reps", type=int, default=10, help="timed repeats per case (default 10)")
    p.add_argument("--out", default=None, help="markdown report (default: print only)")
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error(f"--reps ({a.reps}) must be >= 1")
    return a


# --- timing helpers -----------------------------------------------------------------------------------------
class Timer:
    """Seconds of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def mmm(xs: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return "/".join(fmt.format(v * scale) for v in (min(xs), statistics.median(xs), max(xs)))


def kernels_and_busy_s(fn, device: str) -> tuple[int, float]:
    """Kernel launches (and copies) of one call, and the GPU time they took (profiler)."""
    if device != "cuda":
        return 0, 0.0
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kern), sum(e.time_range.elapsed_us() for e in kern) / 1e6


def host_syncs(fn, device: str) -> tuple[int, list[str]]:
    """Host synchronizations inside ``fn`` (``torch.cuda.set_sync_debug_mode``) and the Python line of
    each (the warning is attributed to the line that made the synchronizing call)."""
    if device != "cuda":
        return 0, []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    hits = [w for w in got if "synchroniz" in str(w.message).lower()]
    return len(hits), [f"{_where(w.filename)}:{w.lineno}" for w in hits]


def _where(filename: str) -> str:
    """A synchronizing line's file, relative to the repository, or from its package (no machine path)."""
    rel = os.path.relpath(filename, ROOT)
    return rel if not rel.startswith("..") else filename.rpartition("site-packages" + os.sep)[2]


# --- 1. DGC per bucket ---------------------------------------------------------------------------------------
def bench_dgc(device: str, reps: int, small: bool) -> list[str]:
    timer = Timer(device)
    rows = ["| bucket | dtype | threshold search | tensors | MiB | DGC ms (min/med/max) | 8 passes ms | DGC / 8 passes | "
            "launches | host syncs | transient × bucket |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    sync_lines: list[str] = []
    for name, dtype_name, dtype, search in [(b, dn, dt, s) for b in ("large", "bench")
                                            for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                                            for s in ("op", "torch loop")]:
        # The same bucket with the dgc_threshold_search op and with its torch-loop reference, same run.
        with ops.force_reference(*(() if search == "op" else ("dgc_threshold_search",))):
            shapes = BUCKETS[name] if not small else BUCKETS[name][:5]
            bucket, numels = make_bucket(shapes if not small else [(s[0] // 8, s[1] // 8) for s in shapes], dtype,
                                         device, 0)
            sp = dgc_mod.DGCSparsifier(DGCConfig(enabled=True, density=0.01, momentum_correction=False))
            other, buf = torch.randn_like(bucket), torch.empty_like(bucket)
            step = [0]

            def compress():
                step[0] += 1
                sp.state.step = step[0]
                sp.compress(grads_of(bucket, numels))

            def passes():
                for _ in range(8):
                    torch.add(bucket, other, out=buf)

            for _ in range(3):
                compress()
                passes()
            t_dgc, t_pass, ratio = [], [], []
            for _ in range(reps):
                a, b = timer(compress), timer(passes)
                t_dgc.append(a)
                t_pass.append(b)
                ratio.append(a / b)
            launches, _ = kernels_and_busy_s(compress, device)
            syncs, where = host_syncs(compress, device)
            if where:
                sync_lines.append(f"- {name} {dtype_name} ({search}): " + ", ".join(where))
            if device == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                compress()
                transient = (torch.cuda.max_memory_allocated() - base) / (bucket.numel() * bucket.element_size())
            else:
                transient = float("nan")
            mib = bucket.numel() * bucket.element_size() / 2**20
            rows.append(f"| {name} | {dtype_name} | {search} | {len(numels)} | {mib:.1f} | "
                        f"{mmm(t_dgc, 1e3)} | {mmm(t_pass, 1e3)} | {mmm(ratio, 1, '{:.1f}')}× | {launches} | {syncs} | "
                        f"{transient:.2f} |")
    if sync_lines:
        rows += ["", "Where each bucket's host synchronizations come from:", ""] + sync_lines
    return rows


def sim_sync_cost(name: str, options: dict, n: int, inputs, outs, reps: int, device: str):
    """One scheme's sync of ``inputs`` in SimWorld (n ranks on one device), after a warm-up: the run
    itself, GPU busy seconds per rank over ``reps // 3`` profiled runs, and kernels per rank."""
    sch = [build_scheme(name, **options) for _ in range(n)]

    def run():
        SimWorld(n, device=device).run(lambda c, x: sch[c.rank].sync(c, x, out=outs[c.rank]), inputs)

    run()
    busy, kernels = [], 0
    for _ in range(max(1, reps // 3)):
        kernels, b = kernels_and_busy_s(run, device)
        busy.append(b / n)
    return run, busy, kernels / n


# --- 2. ZEN vs AGsparse per rank -------------------------------------------------------------------------
def bench_zen(device: str, reps: int, small: bool) -> list[str]:
    numel = 50_000_000 if not small else 200_000
    rows = ["| n | density | ZEN GPU ms per rank | AGsparse GPU ms per rank | ZEN / AGsparse | one pass over the "
            "result ms | ZEN / pass | ZEN kernels per rank |", "|---|---|---|---|---|---|---|---|"]
    timer = Timer(device)
    for n in (8, 16):
        for density in (0.01, 0.05):
            g = torch.Generator(device=device).manual_seed(n)
            k = int(numel * density)
            inputs = []
            for _ in range(n):
                idx = torch.randint(0, numel, (k,), device=device, generator=g).unique()
                inputs.append(SparseGrad(idx, torch.randn(idx.numel(), device=device, generator=g), numel))
            outs = [torch.empty(numel, device=device) for _ in range(n)]
            per = {}
            for name in ("zen", "agsparse"):
                run, busy, kernels = sim_sync_cost(name, {}, n, inputs, outs, reps, device)
                if device != "cuda":  # no profiler: wall time of all ranks, per rank
                    busy = [timer(run) / n for _ in range(max(1, reps // 3))]
                per[name] = (busy, kernels)
            pass_s = [timer(lambda: outs[0].fill_(1.0)) for _ in range(reps)]
            z, a = per["zen"][0], per["agsparse"][0]
            rows.append(f"| {n} | {density:.0%} | {mmm(z, 1e3)} | {mmm(a, 1e3)} | "
                        f"{statistics.median(z) / statistics.median(a):.2f}× | {mmm(pass_s, 1e3, '{:.3f}')} | "
                        f"{statistics.median(z) / statistics.median(pass_s):.1f}× | {per['zen'][1]:.0f} |")
    return rows


# --- 2b. embedding rows: the bitmap pull against the COO pull -------------------------------------------------
def bench_zen_rows(device: str, reps: int, small: bool) -> list[str]:
    """ZEN's bitmap pull and COO pull (``zen_coo``) on embedding rows, n = 16 (cluster_rows16.md: in the emulated
    cluster ``zen`` took 2.3x ``zen_coo``'s time on rows 256 wide). GPU busy time per rank and each ZEN
    variant's five most expensive kernels."""
    n, width = 16, 256
    rows_total = (1 << 22) // width if not small else 512
    per_rank = rows_total // 8
    g = torch.Generator(device=device).manual_seed(5)
    inputs = []
    for _ in range(n):
        idx = torch.randperm(rows_total, device=device, generator=g)[:per_rank]
        inputs.append(SparseGrad(idx, torch.randn(per_rank, width, device=device, generator=g), rows_total))
    outs = [torch.empty(rows_total * width, device=device) for _ in range(n)]
    lines = [f"n {n}, {rows_total} rows of width {width}, {per_rank} rows per rank", "",
             "| scheme | GPU ms per rank (min/med/max) | kernels per rank | wall ms per sync of all ranks |",
             "|---|---|---|---|"]
    top = []
    timer = Timer(device)
    for name, kw in (("zen", {"pull_format": "bitmap"}), ("zen_coo", {}), ("agsparse", {})):
        run, busy, kernels = sim_sync_cost(name, kw, n, inputs, outs, reps, device)
        wall = [timer(run) for _ in range(max(1, reps // 3))]
        lines.append(f"| {name}{' (bitmap pull)' if kw else ''} | {mmm(busy, 1e3, '{:.3f}')} | {kernels:.0f} | "
                     f"{mmm(wall, 1e3)} |")
        if device == "cuda" and name in ("zen", "zen_coo"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            avg = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:5]
            top += ["", f"{name}'s most expensive kernels:"] + [
                f"- {e.key[:90]}: {e.device_time_total / n / 1e3:.3f} ms per rank, {e.count / n:.0f} calls per rank"
                for e in avg]
    return lines + top


# --- 3. hashing at the paper's scale ----------------------------------------------------------------------
def bench_hash(device: str, reps: int, small: bool) -> list[str]:
    numel = 214_000_000 if not small else 2_000_000
    k = int(numel * 0.052)
    g = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, numel, (k,), device=device, generator=g)
    keys = ops.derive_keys(77).to(device)
    timer = Timer(device)
    for _ in range(3):
        ops.hash_partition(idx, numel, 16, keys)
    t = [timer(lambda: ops.hash_partition(idx, numel, 16, keys)) for _ in range(reps)]
    rows = [f"hash_partition, {numel:,} elements at 5.2 % ({k:,} indices), 16 partitions: {mmm(t, 1e3)} ms "
            "(min/median/max; the paper: 6 ms on a V100)"]

    # The same grouping by a stable radix sort of the partition ids (one byte each) after h0, for
    # comparison in the same run: what Algorithm 1's hash memory is measured against.
    bounds = torch.arange(17, device=device, dtype=torch.uint8)

    def by_sort():
        y = ops.permute(idx, numel, keys)
        part = (y % 16).to(torch.uint8)
        sorted_p, order = torch.sort(part, stable=True)
        counts = torch.diff(torch.searchsorted(sorted_p, bounds))
        return counts, order, (y // 16).index_select(0, order)

    for _ in range(3):
        by_sort()
    t_sort = [timer(by_sort) for _ in range(reps)]
    counts_h, order_h, _, _ = ops.hash_partition(idx, numel, 16, keys)
    counts_s, order_s, _ = by_sort()
    part_h = torch.repeat_interleave(torch.arange(16, device=device), counts_h.to(torch.int64))
    same = torch.equal(counts_h.to(torch.int64).cpu(), counts_s.cpu()) and torch.equal(
        torch.sort(part_h * numel + idx[order_h]).values, torch.sort(part_h * numel + idx[order_s]).values)
    rows.append(f"the same grouping by permute + a stable sort of 1-byte partition ids: {mmm(t_sort, 1e3)} ms; "
                f"hash_partition / sort (medians) {sorted(t)[len(t) // 2] / sorted(t_sort)[len(t_sort) // 2]:.2f}×; "
                f"same partitions: {same}")
    return rows


# --- 4. the optimizer step ------------------------------------------------------------------------------------
def bench_optimizer(device: str, reps: int, small: bool) -> list[str]:
    from zen_ext import optim

    timer = Timer(device)
    shapes = BUCKETS["large"] if not small else BUCKETS["small"]
    rows = ["| layout | optimizer | step ms (min/med/max) | × AdamW foreach | launches per step |", "|---|---|---|---|---|"]
    numel = sum(r * c for r, c in shapes)
    for layout, sizes in (("the large bucket's tensors" if not small else "the small bucket's tensors",
                           [r * c for r, c in shapes]), ("one flat tensor (a ZeRO partition)", [numel])):
        gen = torch.Generator(device=device).manual_seed(0)
        grads = [torch.randn(n, generator=gen, device=device) * (torch.rand(n, generator=gen, device=device) < 0.05)
                 for n in sizes]

        def make(kind):
            ps = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
            for p, g in zip(ps, grads):
                p.grad = g
            kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
            if kind.startswith("CatchUpAdamW"):
                opt = optim.CatchUpAdamW(ps, **kw)
                if "torch path" in kind:  # the per-parameter torch ops, as where the fused op has no kernel
                    opt.step = lambda: _torch_path_step(opt)
                return opt
            impl = {"AdamW fused": {"fused": True}, "AdamW for-loop": {"foreach": False}}.get(kind, {"foreach": True})
            return torch.optim.AdamW(ps, **kw, **impl)

        z = torch.zeros(1, device=device)
        fused = ops._catch_up_fits([z], [z])
        # The for-loop AdamW is what DeepSpeed's "torch_adam" runs on CPU tensors (foreach is CUDA-only by
        # default), so the lab's step times were measured with it.
        kinds = (["AdamW foreach", "AdamW for-loop", "CatchUpAdamW (fused op)" if fused else "CatchUpAdamW (torch path)"]
                 + (["CatchUpAdamW (torch path)"] if fused else []) + (["AdamW fused"] if device == "cuda" else []))
        opts = {k: make(k) for k in kinds}
        for opt in opts.values():  # state allocated, kernels warm
            for _ in range(3):
                opt.step()
        times = {k: [] for k in kinds}
        for _ in range(reps):  # interleaved, so drift hits every optimizer alike
            for k, opt in opts.items():
                times[k].append(timer(opt.step))
        for k in kinds:
            ratio = [t / b for t, b in zip(times[k], times["AdamW foreach"])]
            launches, _ = kernels_and_busy_s(opts[k].step, device)
            rows.append(f"| {layout}, {len(sizes)} × {numel / len(sizes) / 1e6:.2f} M | {k} | {mmm(times[k], 1e3)} | "
                        f"{mmm(ratio)} | {launches if device == 'cuda' else 'n/a (CPU)'} |")
    return rows


def _torch_path_step(opt) -> None:
    """``opt.step()`` (a CatchUpAdamW) with the fused op turned off."""
    saved = ops._catch_up_fits
    ops._catch_up_fits = lambda p_T, g_T: False  # ops.catch_up_adamw_ then takes its torch reference
    try:
        type(opt).step(opt)
    finally:
        ops._catch_up_fits = saved


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU is visible; --device cpu runs the smoke version", file=sys.stderr)
        return 2
    env = (f"{torch.cuda.get_device_name()} " if a.device == "cuda" else "CPU ") + \
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; reps {a.reps}"
    parts = [f"# GPU cost of DGC and ZEN ({a.device})", "", env, "",
             "## 1. DGC per bucket vs 8 memory passes over it (density 1 %, momentum correction off)", ""]
    parts += bench_dgc(a.device, a.reps, a.small)
    parts += ["", "## 2. ZEN vs AGsparse, GPU time per rank (SimWorld on one device, same input)", ""]
    parts += bench_zen(a.device, a.reps, a.small)
    parts += ["", "## 2b. ZEN on embedding rows: bitmap pull vs COO pull (SimWorld on one device)", ""]
    parts += bench_zen_rows(a.device, a.reps, a.small)
    parts += ["", "## 3. Hashing", ""] + bench_hash(a.device, a.reps, a.small)
    parts += ["", "## 4. Optimizer step: CatchUpAdamW vs torch's AdamW (5 % of the gradient non-zero)", ""]
    parts += bench_optimizer(a.device, a.reps, a.small)
    text = "\n".join(parts) + "\n"
    print(text, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
