"""Bytes of DGC state per compressed element, by ``zen.dgc.residual_dtype`` (float32, bfloat16, int4) and
momentum correction (results: benchmarks/quality/results/residual_int4.md).

1. One bucket of the end-to-end bench model's DGC tensors (``bench_dgc.BUCKETS["bench"]``: 30 tensors,
   21 M elements), bf16 gradients (the dtype the recipes train in), two ``compress`` steps.
2. Every tensor the sparsifier's state holds (``SparsifierState``: residuals or 4-bit codes and scales,
   momenta, thresholds, the flat buffers they are views of), each storage counted once by its bytes;
   divided by the bucket's elements ``P``.
3. The formula it confirms: fp32 ``4`` (+4 momentum), bf16 ``2`` (+2), int4 ``(B/2 + 8)/B = 0.53125``
   per element of whole blocks of ``B = 256`` (+4 fp32 momentum), plus the padding of each tensor's
   last block.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_dgc_state.py [--bucket bench]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.comm.bench_dgc import BUCKETS, grads_of, make_bucket  # noqa: E402
from zen_ext.compress import DGCSparsifier  # noqa: E402
from zen_ext.compress.dgc.int4 import INT4_BLOCK  # noqa: E402


def state_bytes(sp: DGCSparsifier) -> int:
    """Bytes of every storage the sparsifier's state holds, each counted once."""
    tensors = [t for e in sp.state.params.values() for t in e.values()] + list(sp.state._flats.values())
    tensors += [v[0] for e in sp.state._lazy.values() for v in e.values()]
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def formula(residual_dtype: str, momentum: bool, numels: list[int]) -> float:
    """Expected bytes per element (thresholds aside)."""
    P = sum(numels)
    if residual_dtype == "int4":
        blocks = sum(-(-n // INT4_BLOCK) for n in numels)
        return (blocks * (INT4_BLOCK // 2 + 8) + (4 * P if momentum else 0)) / P
    per = 4 if residual_dtype == "float32" else 2
    return per * (2 if momentum else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bucket", default="bench", choices=list(BUCKETS))
    ap.add_argument("--density", type=float, default=0.05)
    args = ap.parse_args()
    bucket, numels = make_bucket(BUCKETS[args.bucket], torch.bfloat16, "cpu", 0)
    P = sum(numels)
    print(f"bucket {args.bucket}: {len(numels)} tensors, P = {P:,} elements, bf16 gradients, density {args.density}\n")
    print("| residual_dtype | momentum correction | state bytes | bytes / element of P | formula |")
    print("|---|---|---|---|---|")
    for momentum in (False, True):
        for rd in ("float32", "bfloat16", "int4"):
            sp = DGCSparsifier({"enabled": True, "density": args.density, "residual_dtype": rd,
                                "momentum_correction": momentum, "momentum_masking": momentum})
            for step in range(2):
                sp.compress(grads_of(bucket, numels))
                sp.state.step += 1
            b = state_bytes(sp)
            print(f"| {rd} | {'on' if momentum else 'off'} | {b:,} | {b / P:.4f} | {formula(rd, momentum, numels):.4f} |")


if __name__ == "__main__":
    main()
