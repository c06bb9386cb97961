"""The six families of issue 61's per-family table: the benchmark models that ``bench_generate.py``,
``bench_train.py``, ``bench_first_call.py`` and ``gpu_greedy_real.py`` share (one table, imported, never copied).

Each family is random weights of a real small model's config (bf16 on the GPU, sdpa attention) with a 7:1 mask:

- ``smollm2``: SmolLM2-135M (Llama; 30 layers x 9 heads, 3 KV, head_dim 64), the ranked mask that headscope chose for
  SmolLM2-135M-Instruct (``--mask hydrahead``, 34 FA heads) or ``--mask random``;
- ``qwen2``: Qwen2.5-0.5B's config (24 layers x 14 heads, 2 KV, head_dim 64, q/k/v biases, vocabulary 151,936);
- ``qwen3``: Qwen3-0.6B's config (28 layers x 16 heads, 8 KV, head_dim 128, QK-norm, vocabulary 151,936);
- ``mistral``: Mistral-7B's layer shape (32 heads, 8 KV, head_dim 128, MLP 14,336, sliding window 4096) at
  ``layers`` depth (default 8);
- ``gemma3``: Gemma 3 270M's config (18 layers, 5 sliding (window 512) : 1 full, 4 heads, 1 KV, head_dim 256,
  vocabulary 262,144);
- ``gpt-neox``: Pythia-160M's config (12 layers x 12 heads, head_dim 64, rotary on a quarter of each head, parallel
  residual, biases).

Every family but SmolLM2 gets the equal-budget random 7:1 mask of :func:`bench_hybrid_model.mask_7to1`
(``max(layers, round(layers * heads / 8))`` FA heads, at least one per layer; seed 0). :func:`smoke_config` gives the
CPU twin of each (the tests' tiny model of the family, :func:`headscope.arch.random_models.hybrid_families`).
"""

from __future__ import annotations

from typing import Any

from transformers import (Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from bench_hybrid_model import hybrid_mask, mask_7to1, smollm2_config

from headscope.arch.random_models import hybrid_families
from headscope.masks import HeadMask

FAMILIES = ("smollm2", "qwen2", "qwen3", "mistral", "gemma3", "gpt-neox")
LONG = 1 << 17  # max_position_embeddings: room for 32K prompts and the tokens generated after them

# Stage-2 training shape (rows x tokens) per family on one 80 GB GPU: 64 x 512 unless the teacher's compiled dense step
# (full teacher and student logits: ~26 B per logit element at SmolLM2, 43.9 GiB at 64 x 512 x 49,152 on the H200,
# benchmarks/results/h200_train.json) or the model states (fp32 master + gradient + AdamW: 16 B per parameter) would not
# fit: vocabulary 151,936 (Qwen) ~32 GiB of logits at 16 rows, 262,144 (Gemma 3) ~55 GiB at 16 rows, Mistral's 8 layers
# 2.0B parameters (32 GiB of states) + ~9 GiB of activations at 16 rows; GPT-NeoX (vocabulary 50,304, SmolLM2's 49,152)
# at SmolLM2's 64 x 512 now that its hybrid takes the fast step (32 x 512 while it trained on the plain step, whose full
# logits and per-parameter AdamW peaked at 83 GiB at SmolLM2's 64 x 512).
TRAIN_SHAPE = {"smollm2": "64x512", "qwen2": "16x512", "qwen3": "16x512", "mistral": "16x512", "gemma3": "16x512",
               "gpt-neox": "64x512"}
_TINY = {"smollm2": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral_sw", "gemma3": "gemma3",
         "gpt-neox": "gpt_neox"}


def geometry(cfg: Any) -> tuple[int, int, int]:
    """(layers, query heads, KV heads) of a config (GPT-NeoX has no ``num_key_value_heads``: one KV head per head)."""
    H = cfg.num_attention_heads
    return cfg.num_hidden_layers, H, getattr(cfg, "num_key_value_heads", None) or H


def _config(family: str, layers: int) -> tuple[Any, str]:
    if family == "smollm2":
        return smollm2_config(), "SmolLM2-135M (30 x 9 heads, 3 KV, d 64)"
    if family == "qwen2":
        return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, max_position_embeddings=LONG), \
            "Qwen2.5-0.5B config (24 x 14 heads, 2 KV, d 64, q/k/v biases)"
    if family == "qwen3":
        return Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, max_position_embeddings=LONG), \
            "Qwen3-0.6B config (28 x 16 heads, 8 KV, d 128, QK-norm)"
    if family == "mistral":
        return MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, vocab_size=32000, sliding_window=4096,
                             max_position_embeddings=LONG, rope_theta=10000.0), \
            f"Mistral-7B layer shape x {layers} layers (32 heads, 8 KV, d 128, sliding window 4096)"
    if family == "gpt-neox":
        return GPTNeoXConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                             vocab_size=50304, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                             max_position_embeddings=LONG, bos_token_id=0, eos_token_id=0), \
            "Pythia-160M config (12 layers, 12 heads, d 64, rotary 0.25, parallel residual)"
    if family == "gemma3":
        return Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                                query_pre_attn_scalar=256, rope_theta=1e6, max_position_embeddings=LONG,
                                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                             for i in range(18)]), \
            "Gemma 3 270M config (18 layers, 5 sliding (512) : 1 full, 4 heads, 1 KV, d 256)"
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def family_config(family: str, layers: int = 8, mask: str = "hydrahead") -> tuple[Any, HeadMask, str]:
    """(config, 7:1 mask, description) of a family's GPU benchmark model (random weights; sdpa attention).

    ``layers``: Mistral's depth (the other families have their real depth). ``mask``: SmolLM2's mask
    (:func:`bench_hybrid_model.hybrid_mask`: ``"hydrahead"``, ``"random"`` or a HeadMask JSON path); the other
    families always take :func:`bench_hybrid_model.mask_7to1`.

    Raises:
        ValueError: an unknown family (or SmolLM2 mask name).
    """
    cfg, what = _config(family, layers)
    cfg._attn_implementation = "sdpa"
    L, H, KV = geometry(cfg)
    return cfg, (hybrid_mask(mask) if family == "smollm2" else mask_7to1(L, H, KV)), what


def smoke_config(family: str) -> tuple[Any, HeadMask, str]:
    """(config, mask, description) of a family's tiny CPU model: SmolLM2's 4-layer Llama with a hand-set mask (as the
    benchmarks' ``--smoke`` had), else the tests' tiny model of the family (vocabulary 128; Mistral: window 24;
    Gemma 3: window 8, 3 layers) with :func:`~bench_hybrid_model.mask_7to1`."""
    if family == "smollm2":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096)
        cfg._attn_implementation = "sdpa"
        return cfg, HeadMask(4, 4, 2, ((0,), (1,), (2, 3), (0,))), "tiny (smoke)"
    if family not in _TINY:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    cfg = hybrid_families()[_TINY[family]](128, 0).config
    return cfg, mask_7to1(*geometry(cfg)), f"tiny {family} (smoke)"


def chosen_backends(model: Any) -> dict[str, list[str]]:
    """The backend each role resolved to for the model's current device and dtype, over its hybrid layers
    (``{"train": [...], "prefill": [...], "decode": [...], "captured_decode": [...]}``, sorted distinct names; a role
    that does not apply is ``"refused: ..."``): what a result file records beside the InferenceConfig, so a family
    that fell back to the reference says so."""
    w = next(model.parameters())
    out: dict[str, set] = {}
    for m in model.modules():
        b = getattr(m, "backends", None)
        if b is None or not hasattr(m, "new_decode_cache"):
            continue
        for role in ("train", "prefill", "decode"):
            try:
                out.setdefault(role, set()).add(b.backend(m, role, m.q_proj.weight).name)
            except Exception as e:  # noqa: BLE001 - recorded, not raised: the run itself says what failed
                out.setdefault(role, set()).add(f"refused: {e}")
    mb = getattr(model, "backends", None)
    if mb is not None and hasattr(mb, "backend") and not hasattr(model, "new_decode_cache"):
        try:
            out["captured_decode"] = {mb.backend(w).name}
        except Exception as e:  # noqa: BLE001
            out["captured_decode"] = {f"refused: {e}"}
    return {k: sorted(v) for k, v in out.items()}
