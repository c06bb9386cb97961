"""Tiny random decoder-only models of every family the fast engine has an adapter for (fp32, CPU).

Each is small (2-4 layers, d_model 64) and shaped to exercise what its family varies: GQA,
sliding windows shorter than the test prompts, per-layer RoPE bases (Gemma 3), NoPE layers
(SmolLM3), partial rotary and parallel blocks (GPT-NeoX), fused projections (GPT-2, Phi-3, NeoX),
soft-capping (Gemma 2), post-norms (OLMo 2) and multipliers (Granite).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers

D = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=512)


def _build(config_cls: str, model_cls: str, vocab: int, seed: int, **kw: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    # weights 5x the usual init scale: clean and corrupted prompts then differ by a usable gap
    # (with the default 0.02 the tiny models' logit differences are ~1e-3)
    cfg = getattr(transformers, config_cls)(vocab_size=vocab, initializer_range=0.1, **kw)
    return getattr(transformers, model_cls)(cfg).eval()


FAMILIES: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "llama": lambda V, s: _build("LlamaConfig", "LlamaForCausalLM", V, s, **D, num_hidden_layers=2,
                                 num_key_value_heads=2),
    "qwen3": lambda V, s: _build("Qwen3Config", "Qwen3ForCausalLM", V, s, **D, num_hidden_layers=2,
                                 num_key_value_heads=2, head_dim=16),
    "gpt2": lambda V, s: _build("GPT2Config", "GPT2LMHeadModel", V, s, n_embd=64, n_layer=2, n_head=4,
                                n_positions=512, bos_token_id=0, eos_token_id=0),
    "gpt_neox": lambda V, s: _build("GPTNeoXConfig", "GPTNeoXForCausalLM", V, s, **D, num_hidden_layers=2,
                                    rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0, eos_token_id=0),
    "gemma2": lambda V, s: _build("Gemma2Config", "Gemma2ForCausalLM", V, s, **D, num_hidden_layers=2,
                                  num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=8.0, pad_token_id=0),
    "gemma3": lambda V, s: _build("Gemma3TextConfig", "Gemma3ForCausalLM", V, s, **D, num_hidden_layers=3,
                                  num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  pad_token_id=0),
    "phi3": lambda V, s: _build("Phi3Config", "Phi3ForCausalLM", V, s, **D, num_hidden_layers=2,
                                num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0,
                                bos_token_id=0, eos_token_id=0),
    "olmo2": lambda V, s: _build("Olmo2Config", "Olmo2ForCausalLM", V, s, **D, num_hidden_layers=2,
                                 num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "granite": lambda V, s: _build("GraniteConfig", "GraniteForCausalLM", V, s, **D, num_hidden_layers=2,
                                   num_key_value_heads=2, embedding_multiplier=4.0, residual_multiplier=0.5,
                                   attention_multiplier=0.2, logits_scaling=0.5, pad_token_id=0),
    "mistral_sw": lambda V, s: _build("MistralConfig", "MistralForCausalLM", V, s, **D, num_hidden_layers=2,
                                      num_key_value_heads=2, sliding_window=24),
    "smollm3": lambda V, s: _build("SmolLM3Config", "SmolLM3ForCausalLM", V, s, **D, num_hidden_layers=4,
                                   num_key_value_heads=2, pad_token_id=0, use_sliding_window=True,
                                   sliding_window=8, no_rope_layers=[1, 0, 1, 0],
                                   layer_types=["full_attention", "full_attention", "sliding_attention",
                                                "sliding_attention"]),
}


# seeds whose random weights give the test pair (niah_single, 64 tokens, depth 0.4, seed 3) a clean-corrupted
# gap of at least 0.05 logits, so that IE is well conditioned
SEEDS = {"gpt2": 2, "phi3": 2, "gemma2": 1, "gemma3": 2, "granite": 3, "mistral_sw": 1}


def tiny_family(name: str, tokenizer: Any, seed: int | None = None):
    """A :class:`~headscope.models.LoadedModel` of family ``name`` with random weights."""
    from headscope.models import wrap

    s = SEEDS.get(name, 0) if seed is None else seed
    return wrap(FAMILIES[name](len(tokenizer), s), tokenizer, name=f"tiny-{name}")
