"""DGC compression of one bucket vs 8 memory passes over it, and its transient memory.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_dgc.py [--dtypes fp32,fp16] [--memory]   # this code
    git show <old-commit>:zen_ext/compress/dgc/sparsifier.py > /tmp/dgc_old.py   # zen_ext/compress/dgc.py before the package
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_dgc.py --old-src /tmp/dgc_old.py   # before

1. Buckets of LLM-shaped DGC tensors (a decoder layer at hidden 640: q/o 640×640, GQA k/v 160×640,
   gate/up/down 1728×640): ``large`` = 7 layers (49 tensors, 30.4 M elements, 122 MB fp32) and
   ``small`` = 2 layers (14 tensors, 8.7 M elements, 35 MB), and ``bench`` = the DGC tensors of the
   end-to-end bench model (benchmarks/cluster/configs/llama-bench.json: 30 tensors, 21 M elements, 84 MB),
   passed as flat views of one bucket, as the Synchronizer does. Gaussian gradients, a new draw per
   step; default DGC config at ``--density`` (momentum correction and masking on;
   ``--momentum-correction off`` as zen_ext chooses under AdamW).
2. Time: after one warm-up step, ``--reps`` steps, each timed together with ``8 ×`` one out-of-place
   add over the same bucket, interleaved, so that both see the same machine load: ``bucket + other``
   (a new tensor, as eager PyTorch does; on the CPU every tensor over 64 KiB is a fresh mapping, so
   this includes first-touch page faults, as do DGC's own temporaries) and ``torch.add(bucket,
   other, out=buf)`` (a pure memory pass into a reused buffer, the stricter baseline). The process
   re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc's dynamic threshold otherwise
   makes the allocating baseline depend on what ran before (2.5× apart between runs).
   Reported: min/median/max of the times and of the per-step ratios.
3. Memory (``--memory``): each case in a fresh subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
   large tensor is its own mapping, returned on free); the peak RSS is reset (``/proc/self/clear_refs``)
   after the warm-up step and read (``VmHWM``) after one more step; transient = peak − RSS before
   the step, reported in MB and in multiples of the bucket's bytes. On CUDA: peak allocated.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from zen_ext.compress import DGCConfig, NamedGrad  # noqa: E402
from zen_ext.compress.dgc import sparsifier as dgc_new  # noqa: E402

LAYER = [(640, 640), (160, 640), (160, 640), (640, 640), (1728, 640), (1728, 640), (640, 1728)]
# The DGC tensors of benchmarks/cluster/configs/llama-bench.json (the end-to-end bench model, 21 M elements):
# embedding and untied head 8192 x 512, 4 decoder layers at hidden 512, intermediate 1376.
BENCH_LAYER = [(512, 512)] * 4 + [(1376, 512), (1376, 512), (512, 1376)]
BUCKETS = {"large": LAYER * 7, "small": LAYER * 2, "bench": [(8192, 512)] + BENCH_LAYER * 4 + [(8192, 512)]}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def load_impl(old_src: str | None):
    """The DGC module to measure: this tree's, or an older one loaded inside its package (``dgc.py`` in
    ``zen_ext.compress`` before DGC became a package, ``sparsifier.py`` in ``zen_ext.compress.dgc`` since)."""
    if not old_src:
        return dgc_new
    with open(old_src) as f:
        package = "zen_ext.compress.dgc" if "from ..base import" in f.read() else "zen_ext.compress"
    spec = importlib.util.spec_from_file_location(f"{package}._dgc_old", old_src)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = package
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_bucket(shapes: list, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, list[int]]:
    numels = [r * c for r, c in shapes]
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(sum(numels), generator=gen, device=device).to(dtype), numels


def grads_of(bucket: torch.Tensor, numels: list[int]) -> list[NamedGrad]:
    return [NamedGrad(f"layer{i // len(LAYER)}.w{i % len(LAYER)}", t) for i, t in enumerate(bucket.split(numels))]


def sparsifier(mod, args, dtype_name: str):
    extra = {"residual_dtype": args.residual_dtype} if args.residual_dtype != "float32" else {}
    if args.momentum_correction == "off":
        extra["momentum_correction"] = False
    cfg = mod.DGCConfig(enabled=True, density=args.density, threshold=args.threshold, **extra) \
        if mod is not dgc_new else DGCConfig(enabled=True, density=args.density, threshold=args.threshold, **extra)
    return mod.DGCSparsifier(cfg)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def mmm(xs: list[float]) -> str:
    return f"{min(xs):.1f} / {statistics.median(xs):.1f} / {max(xs):.1f}"


def time_case(mod, args, name: str, dtype_name: str) -> dict:
    dtype, dev = DTYPES[dtype_name], args.device
    bucket, numels = make_bucket(BUCKETS[name], dtype, dev, 0)
    other = torch.randn_like(bucket)
    sp = sparsifier(mod, args, dtype_name)
    sp.compress(grads_of(bucket, numels))  # warm-up: builds memory and layout
    buf = torch.empty_like(bucket)
    comp_ms, add_ms, ratio, pass_ms, ratio_pass = [], [], [], [], []
    nnz = []
    for rep in range(args.reps):
        sp.state.step = rep + 1
        bucket.copy_(make_bucket(BUCKETS[name], dtype, dev, rep + 1)[0])
        sync(dev)
        t0 = time.perf_counter()
        sg = sp.compress(grads_of(bucket, numels))
        sync(dev)
        t1 = time.perf_counter()
        for _ in range(8):
            out = bucket + other
        del out
        sync(dev)
        t2 = time.perf_counter()
        for _ in range(8):
            torch.add(bucket, other, out=buf)
        sync(dev)
        t3 = time.perf_counter()
        comp_ms.append((t1 - t0) * 1e3)
        add_ms.append((t2 - t1) * 1e3)
        pass_ms.append((t3 - t2) * 1e3)
        ratio.append((t1 - t0) / (t2 - t1))
        ratio_pass.append((t1 - t0) / (t3 - t2))
        nnz.append(sg.nnz / bucket.numel())
    return {"bucket": name, "dtype": dtype_name, "tensors": len(numels), "numel": bucket.numel(),
            "mb": bucket.numel() * bucket.element_size() / 2**20, "compress_ms": comp_ms, "add8_ms": add_ms,
            "ratio": ratio, "pass8_ms": pass_ms, "ratio_pass": ratio_pass, "density": statistics.median(nnz)}


def memory_case(mod, args, name: str, dtype_name: str) -> dict:
    """Transient bytes of one steady-state compress (run in a fresh process; see the module doc)."""
    dtype, dev = DTYPES[dtype_name], args.device
    bucket, numels = make_bucket(BUCKETS[name], dtype, dev, 0)
    sp = sparsifier(mod, args, dtype_name)
    sp.compress(grads_of(bucket, numels))
    sp.state.step = 1
    bucket.copy_(make_bucket(BUCKETS[name], dtype, dev, 1)[0])
    if dev == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sg = sp.compress(grads_of(bucket, numels))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _status_kb("VmRSS")
        sg = sp.compress(grads_of(bucket, numels))
        peak = (_status_kb("VmHWM") - before) * 1024
    out_bytes = sg.indices.numel() * 8 + sg.values.numel() * sg.values.element_size()
    nbytes = bucket.numel() * bucket.element_size()
    return {"bucket": name, "dtype": dtype_name, "mb": nbytes / 2**20, "peak_mb": peak / 2**20,
            "x_bucket": peak / nbytes, "output_mb": out_bytes / 2**20}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-src", help="measure this dgc.py (e.g. from git show) instead of the tree's")
    ap.add_argument("--buckets", default="large,small")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--threshold", default="sampled")
    ap.add_argument("--residual-dtype", default="float32")
    ap.add_argument("--momentum-correction", choices=["on", "off"], default="on",
                    help="off: DGC without its momentum (what zen_ext chooses under Adam-family optimizers)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--memory", action="store_true", help="measure transient memory instead of time")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    mod = load_impl(args.old_src)
    label = "before" if args.old_src else "after"
    if args.child:
        name, dt = args.child.split(":")
        print(json.dumps(memory_case(mod, args, name, dt)))
        return
    for name in args.buckets.split(","):
        for dt in args.dtypes.split(","):
            if args.memory:
                cmd = [sys.executable, __file__, "--child", f"{name}:{dt}"] + [
                    a for a in sys.argv[1:] if a != "--memory"]
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
                r = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
                print(f"| {label} | {name} | {dt} | {r['mb']:.0f} | {r['peak_mb']:.0f} | {r['x_bucket']:.2f} |"
                      f" {r['output_mb']:.1f} |", flush=True)
            else:
                r = time_case(mod, args, name, dt)
                rr, rp = r["ratio"], r["ratio_pass"]
                print(f"| {label} | {name} ({r['tensors']} tensors, {r['mb']:.0f} MB {dt}) | {mmm(r['compress_ms'])} |"
                      f" {mmm(r['add8_ms'])} | {min(rr):.2f} / {statistics.median(rr):.2f} / {max(rr):.2f} |"
                      f" {mmm(r['pass8_ms'])} | {min(rp):.2f} / {statistics.median(rp):.2f} / {max(rp):.2f} |"
                      f" {r['density']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
