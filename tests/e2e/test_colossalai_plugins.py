"""ColossalAI plugins with ZEN on real gloo processes (CPU): the lossless path equals the stock plugin,
DGC trains, the tensor-parallel ranks agree on DGC thresholds, and zen_ext's Gemma2 ShardFormer policy
trains like the unsharded model.

One launch per world shape runs every variant (launches dominate the time on 2 cores); the tests
below assert on its results. The tiny Llama is the one of configs/models/llama-tiny-untied.json.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.launch import run_workers

pytest.importorskip("colossalai")

VOCAB = 1000
NATURAL_ONLY = {"scheme": "zen", "natural": {"enabled": True}, "dgc": {"enabled": False}}
DGC = {"scheme": "zen", "dgc": {"enabled": True, "density": 0.05, "min_numel": 1024}}


def _llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    """Adversarial token batches for one data-parallel replica (its TP ranks get the same)."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    if step == 1 and dp_rank == 1:
        ids %= 500  # no token in the upper half of the vocab: an empty rank for TP shard 1's rows
    if step == 2:
        ids[0, :2] = torch.tensor([0, VOCAB - 1])  # first and last vocab rows
        ids[1, :6] = 7  # duplicates within the rank
    return ids


def _train(plugin, steps: int, dp_rank: int, *, tied=False, fixed_batch=False, adam=False):
    from colossalai.booster import Booster

    booster = Booster(plugin=plugin)
    model = _llama(tied)
    opt = (torch.optim.AdamW(model.parameters(), lr=3e-3) if adam else torch.optim.SGD(model.parameters(), lr=0.5))
    model, opt, *_ = booster.boost(model, opt)
    losses, grads = [], []
    for step in range(steps):
        ids = _batch(0 if fixed_batch else step, dp_rank)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        grads.append({n: p.grad.detach().float().clone() for n, p in model.unwrap().named_parameters()
                      if p.grad is not None})
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, grads


def _sparsifier_state(plugin) -> dict:
    return plugin.zen.sync.state_dict()["sparsifiers"]["params"]


# --- tensor 2 x data 2 (HybridParallelPlugin) ---------------------------------------------------------------
def _hybrid_worker(rank, world):
    import torch.distributed as dist
    from colossalai.booster.plugin import HybridParallelPlugin

    from zen_ext.colossalai import ZenHybridParallelPlugin, apply_cpu_patches

    assert apply_cpu_patches()  # the stock plugin needs them too (ShardFormer's RNG on CPU)
    out = {}
    for precision in ("fp32", "bf16"):
        plain = HybridParallelPlugin(tp_size=2, pp_size=1, precision=precision, ddp_bucket_cap_mb=128)
        dp_rank = dist.get_rank(plain.dp_group)
        out[f"plain_{precision}"] = _train(plain, 3, dp_rank)
        zen = ZenHybridParallelPlugin(tp_size=2, pp_size=1, precision=precision, zen=NATURAL_ONLY)
        out[f"zen_{precision}"] = _train(zen, 3, dp_rank)
        out[f"kinds_{precision}"] = dict(zen.zen.sync.param_kinds)
        out[f"calls_{precision}"] = zen.zen.hook_calls
    dgc = ZenHybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zen=DGC)
    out["dgc"] = _train(dgc, 10, dist.get_rank(dgc.dp_group), fixed_batch=True, adam=True)[0]
    state = _sparsifier_state(dgc)
    out["dgc_thresholds"] = {n: e["threshold"] for n, e in state.items() if "threshold" in e}
    out["dgc_kinds"] = dict(dgc.zen.sync.param_kinds)
    out["tp_rank"], out["dp_rank"] = dist.get_rank(dgc.tp_group), dist.get_rank(dgc.dp_group)
    out["stats"] = dgc.zen.stats.totals
    out["gemma2"] = _gemma2_run()
    return out


@pytest.fixture(scope="module")
def hybrid():
    return run_workers(_hybrid_worker, 4, timeout_s=600)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hybrid_natural_only_equals_plain_plugin(hybrid, precision):
    for r, res in enumerate(hybrid):
        kinds = res[f"kinds_{precision}"]
        assert kinds["model.embed_tokens.weight"] == "natural"  # the vocab-parallel shard
        assert set(kinds.values()) == {"natural", "dense"}
        assert res[f"calls_{precision}"] >= 3
        ref_losses, ref_grads = res[f"plain_{precision}"]
        losses, grads = res[f"zen_{precision}"]
        # Two DP ranks: (a + b) / 2 is exact, so ZEN's sum equals DDP's bitwise, in fp32 and bf16.
        assert losses == ref_losses, r
        for step, (ref, got) in enumerate(zip(ref_grads, grads)):
            assert ref.keys() == got.keys()
            for name in ref:
                assert torch.equal(got[name], ref[name]), (r, step, name)


def test_hybrid_dgc_trains_with_common_tp_thresholds(hybrid):
    for res in hybrid:
        losses = res["dgc"]
        assert losses[-1] < losses[0] - 0.5, losses
        assert res["dgc_kinds"]["model.layers.0.mlp.up_proj.weight"] == "dgc"
        assert res["stats"]["bytes_sent"] < res["stats"]["dense_bytes"]
    # The TP ranks of one replica hold different shards of a layer but agree on one threshold.
    by_pos = {(res["dp_rank"], res["tp_rank"]): res["dgc_thresholds"] for res in hybrid}
    for dp in (0, 1):
        a, b = by_pos[(dp, 0)], by_pos[(dp, 1)]
        assert a.keys() == b.keys() and len(a) > 0
        for name in a:
            assert torch.equal(a[name], b[name]), name


# --- data parallel (TorchDDPPlugin), 2 processes --------------------------------------------------------
def _ddp_worker(rank, world, jsonl_path):
    from colossalai.booster.plugin import TorchDDPPlugin

    from zen_ext.colossalai import ZenTorchDDPPlugin

    out = {"plain": _train(TorchDDPPlugin(bucket_cap_mb=128), 3, rank)}
    zen = ZenTorchDDPPlugin(zen=NATURAL_ONLY)
    out["zen"] = _train(zen, 3, rank)
    out["bucket_cap_mb"] = zen.ddp_kwargs["bucket_cap_mb"]
    dgc = ZenTorchDDPPlugin(zen={**DGC, "stats": {"jsonl_path": jsonl_path}})
    out["dgc"] = _train(dgc, 10, rank, tied=True, fixed_batch=True, adam=True)[0]
    out["dgc_kinds"] = dict(dgc.zen.sync.param_kinds)
    dgc.zen.close()
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zen") / "zen_stats.jsonl")
    return run_workers(_ddp_worker, 2, path), path


def test_torch_ddp_natural_only_equals_plain_plugin(ddp):
    results, _ = ddp
    for r, res in enumerate(results):
        assert res["bucket_cap_mb"] == 128  # the paper's bucket, from zen.bucket_cap_mb
        (ref_losses, ref_grads), (losses, grads) = res["plain"], res["zen"]
        assert losses == ref_losses
        for ref, got in zip(ref_grads, grads):
            for name in ref:
                assert torch.equal(got[name], ref[name]), (r, name)


def test_torch_ddp_dgc_trains_tied_model_and_writes_stats(ddp):
    import json

    results, path = ddp
    for res in results:
        assert res["dgc"][-1] < res["dgc"][0] - 0.5, res["dgc"]
        # A tied embedding's gradient is dense (the LM head touches every row): DGC, not natural.
        assert res["dgc_kinds"]["model.embed_tokens.weight"] == "dgc"
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert all(0 < r["bytes_sent"] < r["dense_bytes"] for r in records)


# --- Gemma2 (no ShardFormer policy in ColossalAI 0.5.0: zen_ext's) -------------------------------------
def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=VOCAB,
                       sliding_window=8, attn_implementation="eager")
    return Gemma2ForCausalLM(cfg)


def _gemma2_run() -> tuple:
    import torch.distributed as dist
    from colossalai.booster import Booster

    from zen_ext.colossalai import ZenHybridParallelPlugin

    steps, lr = 3, 0.5
    plugin = ZenHybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zen={})
    dp_rank = dist.get_rank(plugin.dp_group)
    # Reference: the unsharded model, stepped with the mean gradient of both replicas' batches.
    ref, ref_losses = _gemma2(), []
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        losses = [ref(input_ids=_batch(step, d), labels=_batch(step, d)).loss for d in (0, 1)]
        ref_losses.append(losses[dp_rank].item())
        (sum(losses) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    booster = Booster(plugin=plugin)
    model = _gemma2()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for step in range(steps):
        ids = _batch(step, dp_rank)
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    shapes = {n: tuple(p.shape) for n, p in model.unwrap().named_parameters()}
    return ref_losses, losses, shapes, dict(plugin.zen.sync.param_kinds), plugin.zen.hook_calls


def test_gemma2_tensor_parallel_policy_matches_unsharded_model(hybrid):
    for res in hybrid:
        ref_losses, losses, shapes, kinds, calls = res["gemma2"]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-5)
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 4 heads x 16 / tp 2
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 2 kv heads / tp 2
        assert shapes["model.embed_tokens.weight"] == (512, 64)  # vocab 1000 padded to 1024, / tp 2
        assert "lm_head.weight" not in shapes  # tied: one shard shared with the embedding
        assert kinds["model.embed_tokens.weight"] == "dense"  # tied -> dense gradient, not natural
        assert calls >= 3
