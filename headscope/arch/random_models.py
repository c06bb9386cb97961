"""Random decoder-only models of every family the fast engine has an adapter for (tests and benchmarks).

Each is shaped to exercise what its family varies: GQA, sliding windows, per-layer RoPE bases (Gemma 3),
NoPE layers (SmolLM3), partial rotary and parallel blocks (GPT-NeoX), fused projections (GPT-2, Phi-3,
NeoX), soft-capping (Gemma 2), post-norms (OLMo 2) and multipliers (Granite). ``shape`` scales them
(layers, d_model, query heads, KV heads); the defaults are tiny (CPU tests). These are transformers models;
:func:`headscope.models.random_family` wraps one into a :class:`~headscope.models.LoadedModel`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers


def _build(config_cls: str, model_cls: str, vocab: int, seed: int, **kw: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    # weights 5x the usual init scale: clean and corrupted prompts then differ by a usable gap
    # (with the default 0.02 the tiny models' logit differences are ~1e-3)
    cfg = getattr(transformers, config_cls)(vocab_size=vocab, initializer_range=0.1, **kw)
    return getattr(transformers, model_cls)(cfg).eval()


def _families(L: int, d: int, H: int, KV: int) -> dict[str, Callable[[int, int], torch.nn.Module]]:
    dh = d // H
    D = dict(hidden_size=d, intermediate_size=2 * d, num_attention_heads=H, max_position_embeddings=1024)
    G = dict(D, num_key_value_heads=KV)

    def alt(kinds: tuple[str, ...]) -> list[str]:
        return [kinds[i % len(kinds)] for i in range(L)]

    return {
        "llama": lambda V, s: _build("LlamaConfig", "LlamaForCausalLM", V, s, **G, num_hidden_layers=L),
        "qwen3": lambda V, s: _build("Qwen3Config", "Qwen3ForCausalLM", V, s, **G, num_hidden_layers=L, head_dim=dh),
        "gpt2": lambda V, s: _build("GPT2Config", "GPT2LMHeadModel", V, s, n_embd=d, n_layer=L, n_head=H,
                                    n_positions=1024, bos_token_id=0, eos_token_id=0),
        "gpt_neox": lambda V, s: _build("GPTNeoXConfig", "GPTNeoXForCausalLM", V, s, **D, num_hidden_layers=L,
                                        rotary_pct=0.25, use_parallel_residual=True, bos_token_id=0, eos_token_id=0),
        "gemma2": lambda V, s: _build("Gemma2Config", "Gemma2ForCausalLM", V, s, **G, num_hidden_layers=L,
                                      head_dim=dh, sliding_window=8, query_pre_attn_scalar=dh,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=8.0, pad_token_id=0),
        "gemma3": lambda V, s: _build("Gemma3TextConfig", "Gemma3ForCausalLM", V, s, **G, num_hidden_layers=L,
                                      head_dim=dh, sliding_window=8, query_pre_attn_scalar=dh, pad_token_id=0,
                                      layer_types=alt(("sliding_attention", "full_attention", "sliding_attention"))),
        "phi3": lambda V, s: _build("Phi3Config", "Phi3ForCausalLM", V, s, **G, num_hidden_layers=L,
                                    partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=0, eos_token_id=0),
        "olmo2": lambda V, s: _build("Olmo2Config", "Olmo2ForCausalLM", V, s, **G, num_hidden_layers=L,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0),
        "granite": lambda V, s: _build("GraniteConfig", "GraniteForCausalLM", V, s, **G, num_hidden_layers=L,
                                       embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                       logits_scaling=0.5, pad_token_id=0),
        "mistral_sw": lambda V, s: _build("MistralConfig", "MistralForCausalLM", V, s, **G, num_hidden_layers=L,
                                          sliding_window=24),
        "smollm3": lambda V, s: _build("SmolLM3Config", "SmolLM3ForCausalLM", V, s, **G, num_hidden_layers=max(L, 2),
                                       pad_token_id=0, use_sliding_window=True, sliding_window=8,
                                       no_rope_layers=alt((1, 0)),
                                       layer_types=alt(("full_attention", "full_attention", "sliding_attention",
                                                        "sliding_attention"))),
    }


TINY = (2, 64, 4, 2)  # layers, d_model, query heads, KV heads
FAMILIES = _families(*TINY)
# Gemma 3 and SmolLM3 tiny models get 3 and 4 layers (a full layer between sliding ones; NoPE + sliding)
FAMILIES["gemma3"] = _families(3, 64, 4, 2)["gemma3"]
FAMILIES["smollm3"] = _families(4, 64, 4, 2)["smollm3"]



def hybrid_families(shape: tuple[int, int, int, int] = TINY) -> dict[str, Callable[[int, int], torch.nn.Module]]:
    """Builders ``(vocab, seed) -> model`` of the families :func:`headscope.hybridize` converts, tiny by
    default: Llama, Qwen2 (q/k/v biases), Qwen3 (QK-norm), Mistral (sliding window 24), Gemma 3 (sliding
    window 8 between full layers, two RoPE bases, Gemma's QK-norm, scaled embedding, sandwich norms;
    three layers) and GPT-NeoX (fused q/k/v with biases, partial rotary 0.25, parallel residual)."""
    L, d, H, KV = shape
    fam = _families(L, d, H, KV)
    out = {k: fam[k] for k in ("llama", "qwen3", "mistral_sw", "gpt_neox")}
    out["gemma3"] = _families(max(L, 3), d, H, KV)["gemma3"]
    out["qwen2"] = lambda V, s: _build("Qwen2Config", "Qwen2ForCausalLM", V, s, hidden_size=d, intermediate_size=2 * d,
                                       num_attention_heads=H, num_key_value_heads=KV, num_hidden_layers=L,
                                       max_position_embeddings=1024)
    return out


# seeds whose random weights give the test pair (niah_single, 64 tokens, depth 0.4, seed 3) a clean-corrupted
# gap of at least 0.05 logits, so that IE is well conditioned
SEEDS = {"gpt2": 1, "phi3": 2, "gemma2": 1, "gemma3": 2, "granite": 3, "mistral_sw": 1}
