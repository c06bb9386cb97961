"""The two learned-gate selectors share one training loop (:mod:`headscope.selectors.gate_training`) and train the
gates they trained before it: after N steps on the tiny model (tests/conftest.py: 2 layers, 4 heads, 2 KV heads,
d_model 64, the SmolLM2 tokenizer) the gates and the loss curve equal those of each selector's own loop at
commit e91faf4 (recorded below with the same calls; printed to 7 decimals).
"""

from __future__ import annotations

import numpy as np
import pytest

from headscope.selectors import select

#: at e91faf4, per (layer, head) in order
AT_E91FAF4 = {
    # select(tiny, "duo_gates", steps=4, n_prompts=2, seq_lens=72, window=8)
    "duo_alpha": [0.9212691, 0.9217551, 0.9240748, 0.924672, 0.9239476, 0.9240459, 0.9203582, 0.9205698],
    "duo_loss": [0.05, 0.0490937, 0.0483505, 0.0478549],
    # select(tiny, "duo_gates", steps=3, n_prompts=1, seq_lens=72, granularity="kv_group", seed=1)
    "duo_kv_alpha": [0.9401273, 0.9401273, 0.9407102, 0.9407102, 0.9402654, 0.9402654, 0.9400493, 0.9400493],
    # select(tiny, "flashmorph_gates", steps=4, n_prompts=2, seq_lens=72)
    "fm_gate": [0.9309786, 0.9309786, 0.9309786, 0.9309786, 0.9307985, 0.9307985, 0.9307985, 0.9307985],
    "fm_loss": [11.4396448, 11.1895046, 11.4350634, 11.183629],
    # select(tiny, "flashmorph_gates", steps=3, n_prompts=1, seq_lens=72, granularity="head", seed=1)
    "fm_head_gate": [0.936998, 0.936998, 0.936998, 0.9369982, 0.9369975, 0.9369982, 0.9369978, 0.9369984],
}


def _col(r, col):
    return r.scores.sort_values(["layer", "head"])[col].to_numpy()


def _close(got, key):
    np.testing.assert_allclose(np.asarray(got, dtype=float), AT_E91FAF4[key], rtol=0, atol=2e-7)


@pytest.mark.parametrize("granularity", ["head", "kv_group"])
def test_duo_gates_as_before(tiny, granularity):
    if granularity == "head":
        r = select(tiny, "duo_gates", steps=4, n_prompts=2, seq_lens=72, window=8)
        _close(_col(r, "alpha"), "duo_alpha")
        _close(r.extras["loss"], "duo_loss")
    else:
        r = select(tiny, "duo_gates", steps=3, n_prompts=1, seq_lens=72, granularity="kv_group", seed=1)
        _close(_col(r, "alpha"), "duo_kv_alpha")


@pytest.mark.parametrize("granularity", ["layer", "head"])
def test_flashmorph_gates_as_before(tiny, granularity):
    if granularity == "layer":
        r = select(tiny, "flashmorph_gates", steps=4, n_prompts=2, seq_lens=72)
        _close(_col(r, "gate"), "fm_gate")
        _close(r.extras["loss"], "fm_loss")
    else:
        r = select(tiny, "flashmorph_gates", steps=3, n_prompts=1, seq_lens=72, granularity="head", seed=1)
        _close(_col(r, "gate"), "fm_head_gate")
