"""The hybrid's Triton decode kernels, each beside its PyTorch reference (the same function, the tests' oracle).

- :mod:`.splitk` — split-K (flash-decoding) attention of the FA heads over the kept KV groups
  (``decode_attention`` / ``decode_attention_torch``);
- :mod:`.fa_prep` — the FA heads' q/k glue and K/V cache write (``fa_decode_prep`` / ``fa_decode_prep_torch``);
- :mod:`.gdn_step` — one token of every GDN head, eq. 7–8 (``gdn_decode_step`` / ``gdn_decode_step_torch``);
- :mod:`.one_launch` — the three above in one launch (``hybrid_decode_step``; references: the three);
- :mod:`.layer_tail` — a decode layer's combination, o_proj, residual, norm, gated MLP and next input projection in
  one persistent launch (``layer_tail`` / ``layer_tail_torch``).
"""
