"""Record real gradient traces of the fine-tuning pipeline: DGC 1 %, DGC 5 % and natural embedding sparsity.

Usage::

    .venv/bin/python benchmarks/cluster/record_traces.py --out /tmp/zen_cluster/traces [--kinds dgc1,dgc5,natural]

Data-parallel training of the recipes' model/data pipeline (``recipes/common.py``: a Llama from a
model-config JSON, a BPE tokenizer trained on the built-in ``pydoc`` text, packed blocks, a disjoint
batch per rank) on ``--ranks`` SimWorld ranks in one process, each rank a model replica with its own
optimizer, reducing its flat gradient with the real ``Synchronizer`` (DGC with residuals, natural
rows, dense rest) and the ``zen`` scheme wrapped in ``TracingScheme``. What the scheme receives —
every rank's sparse gradient of each step — is written with ``zen_ext.analysis.traces`` (one file per
step; only the last ``--keep-last`` steps are kept, the earlier ones are DGC's warm-up). All
replicas apply the same reduced gradient, so they stay equal, as in a real run.

Kinds: ``dgc1`` / ``dgc5``: DGC (``density`` 0.01 / 0.05) on every parameter of at least
``dgc.min_numel`` elements, the embedding included; ``natural``: only the untied input embedding's
non-zero rows are sparse (everything else goes to the dense all-reduce and is not traced).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from recipes.common import build_model, build_tokenizer, load_texts, pack_tokens, split_blocks, train_batches  # noqa: E402

from zen_ext import SimWorld, build_scheme  # noqa: E402
from zen_ext.analysis.traces import TraceRecorder, TracingScheme, step_path  # noqa: E402
from zen_ext.compress import classify_parameters  # noqa: E402
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer  # noqa: E402

KINDS = {
    "dgc1": dict(dgc={"enabled": True, "density": 0.01}, natural=None),
    "dgc5": dict(dgc={"enabled": True, "density": 0.05}, natural=None),
    "natural": dict(dgc=None, natural={"enabled": True}),
}
DEFAULT_MODEL = os.path.join(ROOT, "benchmarks", "cluster", "configs", "llama-bench.json")
# The defaults match bench_e2e.py's runs of the recipe (same model, tokenizer, batch and seed).


def record(kind: str, a) -> list[float]:
    """Train ``a.steps`` steps with sparsity ``kind``; returns the mean loss per step."""
    sections = KINDS[kind]
    out_dir = os.path.join(a.out, kind)
    os.makedirs(out_dir, exist_ok=True)
    texts = load_texts("pydoc")
    tok = build_tokenizer("train", texts, cache_dir=a.out, vocab_size=a.tokenizer_vocab)
    blocks, _ = split_blocks(pack_tokens(texts, tok, a.seq_len), eval_fraction=0.05, seed=a.seed)  # as the recipe
    losses: list[float] = []

    def rank_main(comm):
        torch.manual_seed(a.seed)
        # As recipes/finetune_llm.py: a model-config JSON gets the trained tokenizer's vocabulary.
        model = build_model(a.model, seed=a.seed, vocab_size=len(tok) if a.model.endswith(".json") else None)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        slices, at = [], 0
        for name, p in params:
            slices.append(GradSlice(name, at, p.numel(), tuple(p.shape)))
            at += p.numel()
        kinds = classify_parameters(model, natural=sections["natural"], dgc=sections["dgc"], log=False)
        recorder = TraceRecorder(out_dir, comm)
        sync = Synchronizer(dp_comm=comm, scheme=TracingScheme(build_scheme("zen"), recorder), param_kinds=kinds,
                            dgc=sections["dgc"], natural=sections["natural"])
        batches = train_batches(blocks, a.micro_batch, comm.rank, comm.size, seed=a.seed)
        for step in range(a.steps):
            ids = next(batches)
            model.zero_grad(set_to_none=False)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for _, p in params])
            red = sync.sync_flat(flat, slices, op="mean")
            for s, (_, p) in zip(slices, params):
                p.grad.copy_(red[s.offset: s.offset + s.numel].view_as(p))
            opt.step()
            sync.end_step()
            written = recorder.end_step()
            if written and step < a.steps - a.keep_last:
                os.remove(written)  # DGC warm-up steps: not kept
            got = comm.all_gather_object(loss.item())
            if comm.rank == 0:
                losses.append(sum(got) / len(got))
                print(f"{kind} step {step}: loss {losses[-1]:.4f}", flush=True)
        return None

    SimWorld(a.ranks, max_active=a.max_active).run(rank_main)
    with open(os.path.join(out_dir, "losses.json"), "w") as f:
        json.dump(dict(kind=kind, model=a.model, losses=losses, **{k: getattr(a, k) for k in
                  ("ranks", "steps", "micro_batch", "seq_len", "lr", "seed", "tokenizer_vocab")}), f, indent=1)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="trace root; one sub-directory per kind")
    p.add_argument("--kinds", default="dgc1,dgc5,natural")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model-config JSON (or HF name / checkpoint)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--keep-last", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--tokenizer-vocab", type=int, default=8192)
    p.add_argument("--max-active", type=int, default=2, help="ranks computing at once (memory, cores)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for kind in a.kinds.split(","):
        if kind not in KINDS:
            raise SystemExit(f"--kinds ({kind!r}) must be from {sorted(KINDS)}")
        t0 = time.time()
        record(kind, a)
        print(f"{kind}: {time.time() - t0:.0f} s -> {step_path(os.path.join(a.out, kind), a.steps - 1)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
