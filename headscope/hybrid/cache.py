"""The caches of a hybrid model: a layer's preallocated :class:`HybridDecodeCache`, the model's transformers ``Cache``
(:class:`HybridCache`, one HybridDecodeCache per layer, shared by the reference forward and every fast backend), and
the attention-mask reading."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin


class HybridDecodeCache:
    """Preallocated cache of one hybrid layer (fixed shapes, written in place: CUDA-graph friendly).

    Attributes (n_keep = kept KV groups, n_gdn = GDN heads, d = head_dim, C = 3 · n_gdn · d):
        k, v: [batch, n_keep, max_len, d] K/V of the kept KV groups (None without FA heads).
        S: [batch, n_gdn, d, d] fp32 GDN state (None without GDN heads).
        conv: [batch, gdn_conv − 1, C] short-convolution tail (None without it).
        length: tokens cached (a Python int; a captured CUDA graph replays the step at the length it
            was captured with, writing K/V into the same slot).
        max_len: capacity in tokens.

    Made by :meth:`HeadwiseHybridAttention.new_decode_cache`; pass it as ``cache=`` to the layer.
    """

    def __init__(self, k: Optional[Tensor], v: Optional[Tensor], S: Optional[Tensor], conv: Optional[Tensor], max_len: int):
        self.k, self.v, self.S, self.conv = k, v, S, conv
        self.max_len = max_len
        self.length = 0

    def nbytes(self, length: Optional[int] = None) -> int:
        """Bytes held for ``length`` cached tokens (default: the current length): K/V up to it, GDN state, conv tail."""
        n = self.length if length is None else length
        kv = sum(t[:, :, :n].numel() * t.element_size() for t in (self.k, self.v) if t is not None)
        return kv + sum(t.numel() * t.element_size() for t in (self.S, self.conv) if t is not None)

    def _write(self, k: Tensor, v: Tensor, past: int) -> tuple[Tensor, Tensor]:
        T = k.shape[2]
        if past + T > self.max_len:
            raise ValueError(f"HybridDecodeCache holds {self.max_len} tokens but {past + T} are needed; "
                             "make it with a larger max_len")
        self.k[:, :, past : past + T].copy_(k)
        self.v[:, :, past : past + T].copy_(v)
        return self.k[:, :, : past + T], self.v[:, :, : past + T]


def valid_tokens(mask: Optional[Tensor], q_len: int) -> Optional[Tensor]:
    """Bool[batch, q_len] — which of the current tokens are real: from a 2-D padding mask [batch, kv_len] (1 = real)
    or a 4-D bool / additive mask [batch, 1, q_len, kv_len] (real iff it may attend to itself)."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask[:, -q_len:].bool()
    if mask.dim() != 4:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} is not understood (want 2-D or 4-D)")
    kv_len = mask.shape[-1]
    i = torch.arange(q_len, device=mask.device)
    if mask.shape[2] != q_len:
        raise ValueError(f"4-D attention mask has {mask.shape[2]} query rows but the input has {q_len} tokens")
    diag = mask[:, 0, i, kv_len - q_len + i]
    if diag.dtype == torch.bool:
        return diag
    return diag > torch.finfo(diag.dtype).min / 2  # additive mask: 0 = keep, very negative = masked


# ---------------------------------------------------------------------------------------------------------------
# transformers' Cache interface: what model(ids, use_cache=True) and model.generate(...) use


def _round_up(n: int, m: int = 256) -> int:
    return -(-n // m) * m


class HybridCacheLayer(CacheLayerMixin):
    """One decoder layer's slot of a :class:`HybridCache`: a :class:`HybridDecodeCache` (``dc``), allocated by the
    layer's attention module on its first call (:meth:`HybridCache.reserve`); None before."""

    is_compileable = False
    is_sliding = False  # K/V of every position are kept; a sliding layer's window comes from the attention mask

    def __init__(self) -> None:
        super().__init__()
        self.dc: Optional[HybridDecodeCache] = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:  # noqa: D102 - allocated by reserve
        raise TypeError("a HybridCache layer is allocated by its HeadwiseHybridAttention (HybridCache.reserve)")

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        raise TypeError("a HybridCache layer is written by its HeadwiseHybridAttention, not by cache.update(); "
                        "hybridize the model (headscope.hybridize) so that every layer is a hybrid layer")

    def get_mask_sizes(self, query_length: Any) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next call's attention mask: cached + new tokens, from slot 0. Takes the
        query length or (older transformers) the cache positions of the new tokens."""
        q = int(query_length.shape[0]) if isinstance(query_length, Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_seq_length(self) -> int:
        return 0 if self.dc is None else self.dc.length

    def get_max_length(self) -> int:
        return -1 if self.dc is None else self.dc.max_len

    def reset(self) -> None:
        if self.dc is not None:
            self.dc.length = 0
            for t in (self.dc.S, self.dc.conv):
                if t is not None:
                    t.zero_()

    def _select(self, fn: Any) -> None:
        dc = self.dc
        if dc is None:
            return
        dc.k, dc.v, dc.S, dc.conv = (None if t is None else fn(t) for t in (dc.k, dc.v, dc.S, dc.conv))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: keep the rows ``beam_idx`` (K/V, GDN state and convolution tail alike), in place."""
        if self.dc is not None:
            for t in (self.dc.k, self.dc.v, self.dc.S, self.dc.conv):
                if t is not None:
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        """Only a no-op crop; raises ValueError for any other (the GDN state of removed tokens cannot be undone)."""
        n = self.get_seq_length()
        keep = n - tokens_to_remove if tokens_to_remove >= 0 else -tokens_to_remove
        if keep != n:
            raise ValueError("a HybridCache cannot be cropped (the GDN state of the removed tokens cannot be undone); "
                             "assisted / speculative decoding is not supported by hybrid models")


class HybridCache(Cache):
    """transformers ``Cache`` of a head-wise hybrid: per layer one :class:`HybridDecodeCache` (the kept KV groups'
    K/V, preallocated, and the GDN state). ``model(ids)`` and ``generate`` make one in place of a ``DynamicCache``
    (``static=False``: grows) or ``StaticCache`` (``cache_implementation="static"``); pass one as ``cache=`` /
    ``past_key_values=`` to keep it across calls.

    Args:
        config: the hybrid model's config (``num_hidden_layers`` layers).
        max_len: capacity in tokens (prompt + new tokens); None: grown as needed — the first call's length plus
            256 tokens (at least ``initial_len``), rounded up to 256, doubled when full (``static`` must be False).
        static: keep the capacity fixed (``max_len`` required): what CUDA-graph replay needs.
        initial_len: without ``max_len``, the first allocation's least capacity (``generate``: prompt + new tokens).

    Raises:
        ValueError: ``static`` without ``max_len``, or max_len < 1.
    """

    def __init__(self, config: Any, max_len: Optional[int] = None, static: bool = False, initial_len: int = 0):
        if static and max_len is None:
            raise ValueError("HybridCache(static=True) needs max_len (prompt + new tokens)")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        n = int(config.get_text_config(decoder=True).num_hidden_layers if hasattr(config, "get_text_config")
                else config.num_hidden_layers)
        super().__init__(layers=[HybridCacheLayer() for _ in range(n)])
        self.max_len, self.static, self.initial_len = max_len, static, int(initial_len)

    @property
    def decode_caches(self) -> list[Optional[HybridDecodeCache]]:
        """Each layer's :class:`HybridDecodeCache` (None where the layer has not run yet)."""
        return [layer.dc for layer in self.layers]

    def reserve(self, attn: Any, batch: int, new_tokens: int) -> HybridDecodeCache:
        """Layer ``attn.layer_idx``'s :class:`HybridDecodeCache` with room for ``new_tokens`` more tokens of
        ``batch`` sequences: allocated by ``attn.new_decode_cache`` on first use, grown (K/V copied, capacity at
        least doubled) when full and not static.

        Raises:
            ValueError: the batch changed mid-sequence, or a static cache is full.
        """
        slot = self.layers[attn.layer_idx]
        dc = slot.dc
        past = 0 if dc is None else dc.length
        need = past + new_tokens
        if dc is not None and past and _batch_of(dc) != batch:
            raise ValueError(f"the HybridCache holds {_batch_of(dc)} sequences but the input has {batch}; "
                             "start a new cache for a new batch")
        if dc is None or _batch_of(dc) != batch:
            cap = self.max_len if self.max_len is not None else _round_up(max(need + 256, self.initial_len))
            if need > cap:
                raise ValueError(f"the HybridCache holds {cap} tokens but {need} are needed; make it with a larger "
                                 "max_len (generate: max_cache_len / max_new_tokens)")
            slot.dc = attn.new_decode_cache(batch, cap)
        elif need > dc.max_len:
            if self.static or self.max_len is not None:
                raise ValueError(f"the HybridCache holds {dc.max_len} tokens but {need} are needed; make it with a "
                                 "larger max_len (generate: max_cache_len / max_new_tokens)")
            new = attn.new_decode_cache(batch, _round_up(max(2 * dc.max_len, need)))
            for a, b in ((new.k, dc.k), (new.v, dc.v)):  # K/V up to the length; the state and conv tail whole
                if a is not None:
                    a[:, :, :past].copy_(b[:, :, :past])
            for a, b in ((new.S, dc.S), (new.conv, dc.conv)):
                if a is not None:
                    a.copy_(b)
            new.length = past
            slot.dc = new
        return slot.dc


def _batch_of(dc: HybridDecodeCache) -> int:
    return next(t.shape[0] for t in (dc.k, dc.S, dc.conv) if t is not None)
