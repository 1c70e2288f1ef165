"""recipes/finetune_llm_fsdp.py's ``shard`` on the tiny Llamas (configs/models/), 2 gloo ranks: natural-only
ZEN trains bitwise like plain FSDP2 under every policy the recipe offers, on a tied and an untied model.

Each case trains the same steps twice, plain FSDP2 and ZEN with natural rows only (``zen_ext.fsdp.attach``),
with the recipe's loop (HF loss, gradient clipping, AdamW) on float gradients, and compares every loss
and every final weight bitwise: at 2 ranks a sum of two terms is the same in either order, so ZEN's
reduce-scatter and FSDP's dense one agree exactly. Policies: fp32; ``MixedPrecisionPolicy`` bf16 params
with an fp32 reduce and with a bf16 reduce; activation checkpointing; CPU offload. A tied model's
embedding stays in the root unit with its LM head (the tie holds), an untied one is a unit of its own.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.multiproc.launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, VOCAB = 3, 96
CASES = {  # name: (model config, mixed_precision, activation_checkpointing, cpu_offload)
    "untied fp32": ("llama-tiny-untied.json", "fp32", False, False),
    "untied bf16": ("llama-tiny-untied.json", "bf16", False, False),
    "untied bf16-reduce-bf16": ("llama-tiny-untied.json", "bf16-reduce-bf16", False, False),
    "untied checkpointing": ("llama-tiny-untied.json", "fp32", True, False),
    "untied offload": ("llama-tiny-untied.json", "fp32", False, True),
    "tied fp32": ("llama-tiny-tied.json", "fp32", False, False),
    "tied bf16 checkpointing offload": ("llama-tiny-tied.json", "bf16", True, True),
}


def _train(case: str, rank: int, zen: bool) -> dict:
    import torch.distributed as dist

    import zen_ext.fsdp
    from recipes import common
    from recipes.finetune_llm_fsdp import shard

    spec, mixed, checkpointing, offload = CASES[case]
    model = common.build_model(os.path.join(ROOT, "configs", "models", spec), seed=0, vocab_size=VOCAB)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    units, text = shard(model, mixed_precision=mixed, cpu_offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    attachment = zen_ext.fsdp.attach(model, {"scheme": "zen", "natural": {"enabled": True}}) if zen else None
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "units": units, "text": text,
           "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
           "tied": model.get_input_embeddings().weight is model.get_output_embeddings().weight,
           "offload": type(model._get_fsdp_state()._fsdp_param_group.offload_policy).__name__,
           "checkpointing": bool(model.model.gradient_checkpointing)}
    if attachment is not None:
        out["zen_steps"], out["kinds"] = attachment.step, dict(attachment.sync.param_kinds)
        attachment.close()
    dist.barrier()
    return out


def _all_cases(rank, world):
    return {case: (_train(case, rank, zen=False), _train(case, rank, zen=True)) for case in CASES}


@pytest.fixture(scope="module")
def runs():
    return run_workers(_all_cases, 2, timeout_s=900)


@pytest.mark.parametrize("case", list(CASES))
def test_natural_only_zen_equals_plain_fsdp2_bitwise(runs, case):
    spec, mixed, checkpointing, offload = CASES[case]
    for rank, cases in enumerate(runs):
        plain, zen = cases[case]
        assert zen["zen_steps"] == STEPS, (rank, case)
        assert zen["losses"] == plain["losses"], (rank, case)
        for name, ref in plain["params"].items():
            assert torch.equal(zen["params"][name], ref), (rank, case, name, (zen["params"][name] - ref).abs().max())
            assert ref.dtype == torch.float32, (case, name)  # MixedPrecisionPolicy keeps fp32 weights
        assert zen["checkpointing"] is checkpointing and zen["offload"] == ("CPUOffloadPolicy" if offload
                                                                           else "OffloadPolicy"), case
        if "untied" in case:
            assert zen["units"] == 4 and not zen["tied"], case  # 2 blocks, the embedding, the root
            assert zen["kinds"]["model.embed_tokens.weight"] == "natural", case
        else:
            assert zen["units"] == 3 and zen["tied"], case  # the embedding stays with the LM head
            assert "in the root unit (tied parameters): ['model.embed_tokens']" in zen["text"], zen["text"]
        assert "2 blocks from _no_split_modules ['LlamaDecoderLayer']" in zen["text"], zen["text"]


def test_the_policies_change_the_arithmetic_where_they_should(runs):
    """The cases are not one run under several names: bf16 compute changes the losses; recomputation
    and offloading do not (the same arithmetic, elsewhere or later)."""
    cases = runs[0]
    fp32 = cases["untied fp32"][0]["losses"]
    assert cases["untied bf16"][0]["losses"] != fp32
    bf16_reduce, fp32_reduce = cases["untied bf16-reduce-bf16"][0]["params"], cases["untied bf16"][0]["params"]
    assert any(not torch.equal(bf16_reduce[n], fp32_reduce[n]) for n in fp32_reduce)  # the reduce dtype counts
    assert cases["untied checkpointing"][0]["losses"] == fp32 and cases["untied offload"][0]["losses"] == fp32
