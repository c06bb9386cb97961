"""An explicit warm-up: compile and capture a hybrid's fast backends ahead of the first ``generate`` (issue 61 item 5).
What it builds is kept per process; across processes torch reuses its compile caches from ``TORCHINDUCTOR_CACHE_DIR``
and ``TRITON_CACHE_DIR`` (docs/hybrid.md, "First call").
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch


def warm_up(model: Any, batch: int, max_len: int, prompt_lens: Optional[Sequence[int]] = None, new_tokens: int = 3,
            static: Sequence[bool] = (False,), seed: int = 0) -> dict[str, Any]:
    """Run ``model.generate`` on random tokens once per prompt length and cache mode, so that the first real call of
    those shapes does not compile or capture.

    Args:
        model: a hybrid causal LM with its backends attached (``hybridize`` / ``headscope.hybrid.load``).
        batch, max_len: sequences and prompt + new tokens of the calls to come; prompt_lens: prompt lengths to warm
            (default ``max_len - new_tokens``); new_tokens: decode steps per call (≥ 2: capture, then replay);
            static: cache modes (False: ``generate``'s default; True: ``cache_implementation="static"``); seed.

    Returns ``{"calls": [{"prompt_len", "static", "seconds"}...], "seconds": total}`` (wall clock, synchronized).
    Raises ValueError: batch < 1, new_tokens < 2, a prompt length without room in ``max_len``.
    """
    if batch < 1 or new_tokens < 2:
        raise ValueError(f"batch must be >= 1 and new_tokens >= 2; got {batch}, {new_tokens}")
    lens = list(prompt_lens) if prompt_lens else [max_len - new_tokens]
    if any(n < 1 or n + new_tokens > max_len for n in lens):
        raise ValueError(f"prompt lengths {lens} + {new_tokens} new tokens must fit max_len={max_len}")
    p = next(model.parameters())
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(seed)
    calls, t_all = [], time.perf_counter()
    for n in lens:
        ids = torch.randint(0, vocab, (batch, n), generator=g).to(p.device)
        for st in static:
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                               **({"cache_implementation": "static"} if st else {}))
            if p.is_cuda:
                torch.cuda.synchronize(p.device)
            calls.append({"prompt_len": n, "static": bool(st), "seconds": time.perf_counter() - t0})
    return {"calls": calls, "seconds": time.perf_counter() - t_all}
