"""ShardFormer policies ColossalAI 0.5.0 lacks: Gemma2 tensor parallelism (the paper's third LLM).

ZEN paper §4: "We also extend ColossalAI to support the Gemma2 model from Google with custom policies
for efficient tensor parallelism." ColossalAI 0.5.0 has no Gemma / Gemma2 policy
(``get_autopolicy`` raises NotImplementedError even at tp_size 1), so ``ZenHybridParallelPlugin``
uses ``Gemma2ForCausalLMPolicy`` for a ``Gemma2ForCausalLM`` when no ``custom_policy`` is given.

Megatron-style 1-D tensor parallelism, checked with transformers 4.51.3:

* attention: q/k/v column-parallel (each rank holds ``heads/tp`` query and key-value heads; the HF
  forward reshapes with ``-1`` heads, and soft-capping, sliding windows and GQA act per head), o
  row-parallel;
* MLP (GeGLU): gate/up column-parallel, down row-parallel;
* embedding: vocab-parallel (``VocabParallelEmbedding1D``); the LM head vocab-parallel with its
  output gathered (``gather_output``), so HF's own forward applies the final logit soft-capping and
  the loss to the full, unpadded logits. Gemma2 ties the two, so the shard is shared and its
  gradient dense (ZEN routes it to DGC or dense, never to natural sparsity);
* Gemma2's RMSNorms (``x·(1 + w)``) stay replicated and unchanged.

Not covered: pipeline and sequence parallelism, flash attention replacement, and the KV cache: HF
builds its ``HybridCache`` from the unsharded head counts, so the policy turns ``use_cache`` off
(training and loss evaluation never need it; generate with the unsharded model).
"""

from __future__ import annotations

import logging

from colossalai.shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D, VocabParallelLMHead1D
from colossalai.shardformer.policies.base_policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription

log = logging.getLogger(__name__)

__all__ = ["Gemma2ForCausalLMPolicy", "policy_for"]

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


class Gemma2ForCausalLMPolicy(Policy):
    """Tensor-parallel sharding of ``Gemma2ForCausalLM`` (data parallelism needs no replacement)."""

    def config_sanity_check(self) -> None:
        sc = self.shard_config
        if sc.pipeline_stage_manager is not None or sc.enable_sequence_parallelism:
            raise NotImplementedError("Gemma2ForCausalLMPolicy supports tensor + data parallelism only (pp_size 1, no "
                                      "sequence parallelism)")

    def preprocess(self):
        cfg = self.model.config
        tp = self.shard_config.tensor_parallel_size
        if self.shard_config.enable_tensor_parallelism:
            for key in ("num_attention_heads", "num_key_value_heads"):
                if getattr(cfg, key) % tp:
                    raise ValueError(f"Gemma2 {key} ({getattr(cfg, key)}) must be divisible by tp_size ({tp})")
            if cfg.use_cache:
                # HybridCache is sized from the unsharded head counts; training never uses it.
                cfg.use_cache = False
                log.info("zen: Gemma2 policy set config.use_cache = False (the KV cache is not tensor-parallel)")
        return self.model

    def module_policy(self) -> dict:
        from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model

        self.is_causal = True
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        fp8 = {"fp8_communication": self.shard_config.fp8_communication}
        layers = [SubModuleReplacementDescription(suffix=s, target_module=Linear1D_Col, kwargs=fp8) for s in _COLUMN]
        layers += [SubModuleReplacementDescription(suffix=s, target_module=Linear1D_Row, kwargs=fp8) for s in _ROW]
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by, **fp8}
        # Order matters for the tied weight: the embedding is replaced (and its weight sharded) first.
        return {
            Gemma2Model: ModulePolicyDescription(sub_module_replacement=[
                SubModuleReplacementDescription(suffix="embed_tokens", target_module=VocabParallelEmbedding1D,
                                                kwargs=vocab)]),
            Gemma2DecoderLayer: ModulePolicyDescription(sub_module_replacement=layers),
            Gemma2ForCausalLM: ModulePolicyDescription(sub_module_replacement=[
                SubModuleReplacementDescription(suffix="lm_head", target_module=VocabParallelLMHead1D,
                                                kwargs={**vocab, "gather_output": True})]),
        }

    def postprocess(self):
        return self.model

    def get_held_layers(self):
        return [self.model]

    def get_shared_params(self) -> list:
        return []


def policy_for(model) -> Policy | None:
    """The zen_ext policy for a model ColossalAI 0.5.0 has none for, else None (use ColossalAI's)."""
    return Gemma2ForCausalLMPolicy() if type(model).__name__ == "Gemma2ForCausalLM" else None
