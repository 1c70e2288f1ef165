"""Bytes per rank per step and extra state per parameter: zen_ext's best against PowerSGD, DiLoCo, SparseLoCo
and ZeRO++ qgZ, for the demo's tiny Llama and the 58 M Llama, at 2, 8 and 16 data-parallel ranks.

Each peer's bytes come from its implementation's own message sizes, applied to the model's parameter shapes
(an fp32 model, one rank per host):

* dense DDP: the ring all-reduce, ``2·(n−1)/n·P·4``.
* PowerSGD (torch's hook, after ``start_powerSGD_iter``): torch's ``_should_compress`` per gradient viewed as
  ``shape[0] × rest``; the uncompressed tensors, P (``n_rows × r``) and Q (``m × r``) all-reduced in fp32
  (``peers_ddp.powersgd_step_bytes``).
* DiLoCo (torchft): one fp32 all-reduce of every parameter's pseudo-gradient per outer step, ``/ H`` per
  inner step.
* SparseLoCo: ``sparseloco.message_bytes`` (12-bit indices, 2-bit values, fp32 tables) forwarded
  ``n − 1`` times by the ring all-gather, ``/ H``.
* qgZ (emulation of DeepSpeed 0.19.8, one rank per node, so ``nodes = n`` and the intra-node all-to-all
  is empty): per 2-D tensor with ``numel % 2n == 0``, the inter-node all-to-all of int4 codes
  (``numel / 2``) and fp32 scales (``max(shape[0], shape[1], n)``), ``(n−1)/n`` of each; the fallbacks
  (1-D, odd sizes) in DeepSpeed's fp32 reduce-scatter, ``(n−1)/n·numel·4``. qgZ exists only under ZeRO-3,
  which also all-gathers the parameters twice per step (``(n−1)/n·P·4`` each; 1 byte per element with
  ZeRO++ qwZ): rows with and without them (zen_ext under ZeRO-3 pays the same all-gathers; its DDP hook
  does not).
* zen_ext (DGC, ``scheme: auto``, the DDP hook): the DGC-routed tensors (2-D, at least ``dgc.min_numel``
  elements, not the input embedding) at the ratio the real ``zen`` scheme code sends in SimWorld for ``n``
  ranks with independent uniform indices at the density (``benchmarks/comm/bench_bytes.measure``; real
  gradients' indices overlap, so this is an upper bound), the rest (embedding rows, 1-D) as a dense
  all-reduce (natural sparsity can only send less). For the demo model at 2 ranks the runs' measured
  bytes after the density ramp stand beside it.

Extra state per parameter element (bytes, fp32 model; beyond the model, its gradient and AdamW's two
moments): zen_ext DGC: the residual (4; 0.53 for the 4-bit residual) and CatchUpAdamW's fp32 age (4) on
DGC-routed tensors; PowerSGD: ``error_dict`` (a copy of every bucket, 4) plus P/Q memories
``r·(n_rows + m)·4`` per compressed matrix; DiLoCo (torchft): the backup of the global parameters (4) and the
outer SGD momentum (4), and a transient pseudo-gradient (4) at each sync; SparseLoCo: the global copy (4)
and the error buffer (4); qgZ: nothing persistent (transient int4 buffers).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/peers_bytes.py --out runs/peers_bytes.md``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "comm"))

MODELS = {"demo tiny Llama": "configs/models/llama-tiny-untied.json", "58 M Llama": "configs/models/llama-h768-l8.json"}
RANKS = (2, 8, 16)
DGC_MIN_NUMEL = 1024


def build(spec: str):
    """The model with random weights on the meta device (shapes only), vocabulary 1,024 as the runs'
    trained tokenizer."""
    import torch

    from recipes import common

    with torch.device("meta"):
        return common.build_model(os.path.join(ROOT, spec), vocab_size=1024)


def ring(elements: float, n: int, itemsize: int = 4) -> float:
    return 2 * (n - 1) / n * elements * itemsize


def zen_ratio(n: int, density: float, cache: dict) -> float:
    """SimWorld: bytes the ``zen`` scheme sends per rank over a ring all-reduce of the same elements."""
    key = (n, density)
    if key not in cache:
        import bench_bytes

        numel = 200_000
        cache[key] = bench_bytes.measure("zen", n, numel, density)["mean_sent"] / ring(numel, n)
    return cache[key]


def rows(model, cache: dict) -> list[dict]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    import sparseloco as sl
    from peers_ddp import powersgd_step_bytes

    named = [(name, p) for name, p in model.named_parameters()]
    P = sum(p.numel() for _, p in named)
    dgc = sum(p.numel() for name, p in named if p.dim() == 2 and p.numel() >= DGC_MIN_NUMEL
              and "embed_tokens" not in name)
    layout = sl.layout_of([p for _, p in named], sl.SPARSELOCO_DEFAULTS["chunk"], sl.SPARSELOCO_DEFAULTS["topk"])
    slmsg = sl.message_bytes(layout, sl.SPARSELOCO_DEFAULTS["value_bits"])
    out = []
    for n in RANKS:
        dense = ring(P, n)
        r = {"n": n, "P": P, "dense": dense}
        for d in (0.05, 0.01):
            r[f"zen_dgc{round(d * 100)}"] = zen_ratio(n, d, cache) * ring(dgc, n) + ring(P - dgc, n)
        for rank in (1, 4):
            r[f"powersgd_r{rank}"] = powersgd_step_bytes(model, rank, n)
        for h in (10, 50):
            r[f"diloco_h{h}"] = dense / h
        r["sparseloco_h15"] = (n - 1) * slmsg / sl.SPARSELOCO_DEFAULTS["sync_every"]
        q = 0.0
        for _, p in named:
            if p.dim() == 1 or p.numel() % (2 * n):
                q += (n - 1) / n * p.numel() * 4
            else:
                groups = max(p.shape[0], p.shape[1], n)
                q += (n - 1) / n * (p.numel() / 2 + 4 * groups)
        r["qgz"] = q
        # qgZ only runs under ZeRO-3, which all-gathers the parameters before the forward and again before
        # the backward pass (stage3_param_persistence_threshold 0): fp32, or int8 with ZeRO++ qwZ (its
        # block scales left out).
        r["qgz_zero3"] = q + 2 * (n - 1) / n * P * 4
        r["qgz_qwz"] = q + 2 * (n - 1) / n * P * 1
        out.append(r)
    # Extra state per parameter element.
    mem = {"zen_dgc": (4 + 4) * dgc / P, "zen_dgc_int4": (0.53125 + 4) * dgc / P}
    for rank in (1, 4):
        extra = 0
        for _, p in named:
            if p.dim() > 1:
                nr, m = p.shape[0], p.numel() // p.shape[0]
                rr = min(nr, m, rank)
                if _should_compress(nr, m, rr, 2)[0]:
                    extra += rr * (nr + m) * 4
        mem[f"powersgd_r{rank}"] = 4 + extra / P
    mem["diloco"] = 8.0
    mem["sparseloco"] = 8.0
    mem["qgz"] = 0.0
    out.append({"mem": mem, "dgc_fraction": dgc / P, "sparseloco_msg": slmsg})
    return out


def measured_zen(runs: str) -> dict:
    """The demo model's measured bytes per step at 2 ranks after the 100-step density ramp (steps 121-200 of
    the fine-tuning runs), median over seeds, when the runs are there."""
    got = {}
    for v in ("ddp_zen_dgc5", "ddp_zen_dgc1", "ddp_dense", "powersgd_r1", "powersgd_r4", "sparseloco_h15",
              "diloco_h10", "diloco_h50"):
        per = []
        for seed in range(5):
            path = os.path.join(runs, "finetune", v, f"seed{seed}", "train_log.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    recs = [json.loads(x) for x in f]
                if len(recs) >= 200:
                    per.append((recs[199]["bytes_sent"] - recs[119]["bytes_sent"]) / 80)
        if per:
            got[v] = statistics.median(per)
    return got


def report(runs: str) -> str:
    cache: dict = {}
    lines = []
    methods = [("dense DDP", "dense"), ("zen_ext DGC 5 % (auto)", "zen_dgc5"), ("zen_ext DGC 1 % (auto)", "zen_dgc1"),
               ("PowerSGD rank 1", "powersgd_r1"), ("PowerSGD rank 4", "powersgd_r4"),
               ("DiLoCo H 10", "diloco_h10"), ("DiLoCo H 50", "diloco_h50"), ("SparseLoCo H 15", "sparseloco_h15"),
               ("ZeRO++ qgZ (emulation), gradient sync only", "qgz"),
               ("qgZ + ZeRO-3's fp32 parameter all-gathers (2 per step)", "qgz_zero3"),
               ("qgZ + qwZ's int8 parameter all-gathers (2 per step)", "qgz_qwz")]
    for label, spec in MODELS.items():
        rs = rows(build(spec), cache)
        extra = rs.pop()
        lines += [f"#### {label} (`{spec}`, P = {rs[0]['P']:,} parameters; DGC-routed {extra['dgc_fraction']:.1%}; "
                  f"SparseLoCo message {extra['sparseloco_msg']:,} B)", "",
                  "| method | " + " | ".join(f"{r['n']} ranks: bytes / rank / step (× dense)" for r in rs) + " |",
                  "|---|" + "---|" * len(rs)]
        for name, key in methods:
            cells = [f"{r[key] / 1024:,.1f} KiB ({r[key] / r['dense']:.4f}×)" for r in rs]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        m = extra["mem"]
        lines += ["", "Extra state per parameter element (bytes): "
                  + "; ".join([f"zen_ext DGC {m['zen_dgc']:.2f} (4-bit residual {m['zen_dgc_int4']:.2f})",
                               f"PowerSGD r1 {m['powersgd_r1']:.3f}, r4 {m['powersgd_r4']:.3f}",
                               f"DiLoCo {m['diloco']:.0f} (+4 transient at a sync)",
                               f"SparseLoCo {m['sparseloco']:.0f}", f"qgZ {m['qgz']:.0f}"]) + ".", ""]
        if label.startswith("demo"):
            got = measured_zen(runs)
            if got:
                lines += ["Measured in the fine-tuning runs (2 ranks, steps 121-200, median over seeds; each run's "
                          "own count): " + "; ".join(f"{k} {v / 1024:,.1f} KiB" for k, v in got.items()) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "quality"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    text = report(args.runs)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
