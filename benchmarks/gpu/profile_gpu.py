"""Profiles of ZEN's GPU kernels: one ``zen`` sync at n = 8 in SimWorld (50 M elements, 1 % per rank,
fp32) and one ``hash_partition`` at the paper's scale (214 M elements, 5.2 %), after a warm-up.

Usage (a GPU machine, the extension built)::

    python benchmarks/gpu/profile_gpu.py --torchprof          # the most expensive kernels of each
    ncu --profile-from-start off --kernel-name regex:decode_kernel --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python benchmarks/gpu/profile_gpu.py
    ncu ... python benchmarks/gpu/profile_gpu.py --hash-only  # the hashing kernels alone

Without ``--torchprof`` the profiled calls run between ``cudaProfilerStart`` and ``cudaProfilerStop``
(what ``ncu --profile-from-start off`` looks at).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from zen_ext import SimWorld, SparseGrad, build_scheme, ops  # noqa: E402

HASH_NUMEL, HASH_K, HASH_PARTS = 214_000_000, 11_128_000, 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torchprof", action="store_true", help="print the torch profiler's top kernels instead")
    p.add_argument("--hash-only", action="store_true", help="profile hash_partition alone")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_gpu: no CUDA GPU is visible", file=sys.stderr)
        return 2
    dev, n, numel, k = "cuda", 8, 50_000_000, 500_000
    g = torch.Generator(device=dev).manual_seed(8)
    inputs = []
    for _ in range(n):
        idx = torch.randint(0, numel, (k,), device=dev, generator=g).unique()
        inputs.append(SparseGrad(idx, torch.randn(idx.numel(), device=dev, generator=g), numel))
    outs = [torch.empty(numel, device=dev) for _ in range(n)]
    schemes = [build_scheme("zen") for _ in range(n)]
    hidx = torch.randint(0, HASH_NUMEL, (HASH_K,), device=dev, generator=g)
    keys = ops.derive_keys(77).to(dev)

    def zen_sync():
        SimWorld(n, device=dev).run(lambda c, x: schemes[c.rank].sync(c, x, out=outs[c.rank]), inputs)

    def hashing():
        ops.hash_partition(hidx, HASH_NUMEL, HASH_PARTS, keys)

    work = [("hash_partition 214 M at 5.2 %", hashing)] if a.hash_only else \
        [(f"zen n={n}, 1 % per rank", zen_sync), ("hash_partition 214 M at 5.2 %", hashing)]
    for _, fn in work:  # warm-up: workspaces, keys on the device, the caching allocator
        fn()
    torch.cuda.synchronize()
    if a.torchprof:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in work:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            print("==", name)
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
                print(f"  {e.key[:100]}: {e.device_time_total / 1e3:.3f} ms total, {e.count} calls")
        return 0
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in work:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
