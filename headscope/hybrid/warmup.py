"""An explicit warm-up: compile and capture a hybrid's fast backends ahead of the first ``generate`` (issue 61 item 5).

The first ``generate`` of a new shape pays for ``torch.compile`` of the glue and layer tails, Triton's compile and
autotuning of the decode kernels, and the capture of the eager prefill's GDN block graphs; :func:`warm_up` pays them
before serving by running ``generate`` on random tokens of the shapes to come. What it builds is kept per process and
reused by later calls: the compiled glue and tails (Dynamo's cache), the Triton kernels, the GDN block graphs
(``inference.prefill``, per block shape). Each ``generate`` still captures its own whole-model decode graph (its
cache is new; the capture reuses the compiled pieces). Across processes, set ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` to a kept directory: inductor's FX-graph and autotuning caches and Triton's kernel cache are
read from there (docs/hybrid.md, "First call").
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
        model: a hybrid causal LM (its backends attached: ``hybridize`` / ``headscope.hybrid.load``).
        batch: sequences per call to come.
        max_len: prompt + new tokens of the calls to come (tokens); the default prompt is ``max_len - new_tokens``.
        prompt_lens: prompt lengths to warm (tokens; the eager prefill's GDN block graphs are per power-of-two block
            up to ``InferenceConfig.eager_graph_tokens / batch``).
        new_tokens: decode steps per warm-up call (≥ 2: the first step captures, the next replays).
        static: cache modes to warm: False — ``generate``'s default cache; True — ``cache_implementation="static"``
            (compiled layer tails, a first-use compile).
        seed: of the random tokens.

    Returns:
        ``{"calls": [{"prompt_len", "static", "seconds"}...], "seconds": total}`` (wall-clock, synchronized).

    Raises:
        ValueError: batch < 1, new_tokens < 2, or a prompt length that leaves no room in ``max_len``.
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
