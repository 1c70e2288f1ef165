"""Bytes and messages per rank of the sparse reduce-scatters against the dense reduce-scatter and
today's all-reduce-then-keep path (SimWorld, real scheme code; docs/reduce_scatter.md).

Usage: ``.venv/bin/python benchmarks/comm/bench_reduce_scatter.py [--ranks 8,16] [--out benchmarks/comm/results/reduce_scatter.md]``

Workloads (every rank's gradient over one bucket, owner ranges even as FSDP2's chunks):

* ``dgc1`` / ``dgc5``: DGC-like top-k at 1 % / 5 % of a 2^21-element fp32 bucket
  (``zen_ext.analysis.workloads.dgc_topk``: partly shared top-k sets, clustered in the large-scale
  tensors of the bucket, so some ranges are hot);
* ``text rows``: embedding rows from real text: a byte-level BPE tokenizer (8192 tokens) trained on the
  shipped ``pydoc`` text (``recipes/common.py``), every rank a disjoint micro-batch of 8 × 256 tokens;
  its gradient is the touched rows of an 8192 × 256 fp32 embedding (row form). Byte-level BPE gives
  small ids to the frequent bytes and merges, so the first ranges hold most of the rows.

Rows per (workload, n): the dense reduce-scatter, ``direct``, ``zen``, ``auto`` (and its choice), and
today's path under ZeRO-1/2: ``zen``'s all-reduce, after which each rank keeps its partition.
Columns: the busiest rank's bytes sent and received, the ranks' mean, messages sent; ``dense RS /`` is the dense
reduce-scatter's bytes (every rank sends and receives the same) over the scheme's busiest rank
(max of sent and received); ``AR-keep /`` the same against the all-reduce-then-keep path. Bytes are
counted by the Communicator's logical model (identical in SimWorld and on gloo) and are deterministic:
one run each. Wall time is not reported here (SimWorld shares this machine's cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from zen_ext import SimWorld, build_scheme  # noqa: E402
from zen_ext.analysis.workloads import dgc_topk  # noqa: E402
from zen_ext.core.reduce_scatter import build_reduce_scatter  # noqa: E402
from zen_ext.core.rs_base import even_ranges  # noqa: E402
from zen_ext.core.types import SparseGrad  # noqa: E402

TEXT_VOCAB, TEXT_WIDTH, TEXT_BATCH, TEXT_SEQ = 8192, 256, 8, 256


def text_rows(n: int, cache_dir: str) -> list[SparseGrad]:
    """Per rank, the embedding rows a disjoint micro-batch of real text touches (values: token counts)."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from recipes.common import build_tokenizer, load_texts, pack_tokens

    texts = load_texts("pydoc")
    tok = build_tokenizer("train", texts, cache_dir=cache_dir, vocab_size=TEXT_VOCAB)
    blocks = pack_tokens(texts, tok, TEXT_SEQ)
    perm = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    out = []
    for r in range(n):
        ids = blocks[perm[r * TEXT_BATCH : (r + 1) * TEXT_BATCH]].reshape(-1)
        rows, counts = torch.unique(ids, return_counts=True)
        vals = counts.float().unsqueeze(1).expand(-1, TEXT_WIDTH).contiguous()
        out.append(SparseGrad(rows, vals, TEXT_VOCAB))
    return out


def measure(kind: str, name: str, inputs: list[SparseGrad], ranges) -> dict:
    """Run one scheme on every rank; the busiest rank's bytes and messages (and auto's choice)."""
    n = len(inputs)
    world = SimWorld(n)
    choice: dict = {}
    if kind == "rs":
        s = build_reduce_scatter(name)

        def fn(comm, x):
            t = {} if comm.rank == 0 else None
            out = s.reduce_scatter(comm, x, ranges, op="sum", timings=t, key="bucket")
            if t is not None:
                choice.update(t)
            return out
    else:
        s = build_scheme(name)

        def fn(comm, x):
            lo, hi = ranges[comm.rank]
            return s.sync(comm, x, op="sum")[lo:hi].clone()

    t0 = time.perf_counter()
    outs = world.run(fn, inputs)
    st = world.stats
    return dict(sent=max(x.bytes_sent for x in st), recv=max(x.bytes_recv for x in st),
                mean=sum(x.bytes_sent + x.bytes_recv for x in st) / (2 * n),
                msgs=max(x.msgs_sent for x in st), choice=choice.get("scheme", ""), why=choice.get("why", ""),
                outs=outs, wall_s=time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/comm/results/reduce_scatter.md"))
    p.add_argument("--cache-dir", default="/tmp/zen_bench_rs", help="where the trained tokenizer is cached")
    a = p.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    lines = [
        "# Sparse reduce-scatter: bytes per rank against the dense reduce-scatter (SimWorld)",
        "",
        "Regenerate: `.venv/bin/python benchmarks/comm/bench_reduce_scatter.py`. Busiest rank's bytes per bucket,",
        "counted by the Communicator's logical model (deterministic). `dense RS /` and `AR-keep /`: the",
        "dense reduce-scatter's and the all-reduce-then-keep path's busiest-rank bytes over this row's",
        "(max of sent, received); `(mean)`: the same over the ranks' mean of sent and received (the arithmetic",
        "of docs/deepspeed_zero3.md is a mean; hot ranges make the busiest owner receive more). > 1 means fewer bytes.",
        "Every sparse row's result equals the dense",
        "reduce-scatter's exactly (checked by the script).",
        "",
        "| workload | n | scheme | max sent | max recv | mean (sent+recv)/2 | max msgs sent | dense RS / | "
        "AR-keep / | dense RS / (mean) | AR-keep / (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for n in ranks:
        workloads = {
            "dgc1": dgc_topk(n, numel=1 << 21, density=0.01, seed=1),
            "dgc5": dgc_topk(n, numel=1 << 21, density=0.05, seed=1),
            "text rows": text_rows(n, a.cache_dir),
        }
        for wname, inputs in workloads.items():
            numel = inputs[0].dense_numel
            ranges = even_ranges(numel, n)
            rows = {"dense RS": measure("rs", "dense", inputs, ranges)}
            for name in ("direct", "zen", "auto"):
                rows[f"{name} RS"] = measure("rs", name, inputs, ranges)
            rows["zen all-reduce, keep"] = measure("ar", "zen", inputs, ranges)
            want = rows["dense RS"]["outs"]
            for label, r in rows.items():
                for rank in range(n):
                    if not torch.equal(r["outs"][rank], want[rank]):
                        raise AssertionError(f"{wname} n={n} {label}: rank {rank}'s range differs from the dense RS")
            base = max(rows["dense RS"]["sent"], rows["dense RS"]["recv"])
            keep = max(rows["zen all-reduce, keep"]["sent"], rows["zen all-reduce, keep"]["recv"])
            base_mean, keep_mean = rows["dense RS"]["mean"], rows["zen all-reduce, keep"]["mean"]
            for label, r in rows.items():
                worst = max(r["sent"], r["recv"])
                shown = f"{label} → {r['choice']}" if r["choice"] and label.startswith("auto") else label
                lines.append(f"| {wname} | {n} | {shown} | {r['sent']:,} | {r['recv']:,} | {r['mean']:,.0f} | "
                             f"{r['msgs']} | {base / worst:.1f}× | {keep / worst:.2f}× | {base_mean / r['mean']:.1f}× | "
                             f"{keep_mean / r['mean']:.2f}× |")
            density = sum(x.nnz * x.row_width for x in inputs) / (n * numel)
            notes.append(f"- {wname}, n = {n}: {numel:,} elements, mean density {density:.2%}; auto: "
                         f"{rows['auto RS']['why']}")
            print("\n".join(lines[-len(rows):]), flush=True)
    lines += ["", "Workloads and auto's predictions (busiest rank):", "", *notes, ""]
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
