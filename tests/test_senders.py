"""Sender path patching (SPEC.md §5) against three literal runs written out plainly, one sender at a time."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from headscope.patching import Engine
from headscope.patching.receivers import sequences
from headscope.patching.senders import iterate_senders, sender_ie, sender_patching
from headscope.readout import logit_diff
from headscope.tasks import niah_single

from conftest import fast_first


def _orig(m):
    return getattr(m, "original_component", m)


@torch.no_grad()
def plain_forward(lm, ids, z_fn=None, mlp_fn=None, qkv_in=None):
    """A literal Llama forward, head by head; hooks on every head's z, every MLP output and the
    per-head Q/K/V inputs. Returns (logits [pos, vocab], records of z, mlp out and ln1 out)."""
    g = lm.geometry
    inner = lm.hf_model.model
    rep = g.n_heads // g.n_kv_heads
    dh = g.d_head
    x = inner.embed_tokens(ids[None])
    T = ids.numel()
    cos, sin = inner.rotary_emb(x, torch.arange(T)[None])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    rec = {"z": [], "mlp": [], "ln1": [], "pattern": []}
    for layer, blk in enumerate(inner.layers):
        blk = _orig(blk)
        at = _orig(blk.self_attn)
        a = blk.input_layernorm(x)
        rec["ln1"].append(a[0])
        heads, pats = [], []
        for hd in range(g.n_heads):
            grp = hd // rep
            xq, xk, xv = (a, a, a) if qkv_in is None else qkv_in(layer, hd, a)
            q = (xq @ at.q_proj.weight[hd * dh:(hd + 1) * dh].T)[:, None]
            k = (xk @ at.k_proj.weight[grp * dh:(grp + 1) * dh].T)[:, None]
            v = (xv @ at.v_proj.weight[grp * dh:(grp + 1) * dh].T)[:, None]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            sc = (q @ k.transpose(-1, -2)) * dh**-0.5
            p = torch.softmax(sc.masked_fill(~causal, -math.inf), -1)
            heads.append((p @ v)[:, 0])
            pats.append(p[0, 0])
        rec["pattern"].append(torch.stack(pats))  # [head, query, key]
        z = torch.cat(heads, -1)
        if z_fn is not None:
            z = z_fn(layer, z)
        rec["z"].append(z[0])
        x = x + at.o_proj(z)
        m = blk.mlp(blk.post_attention_layernorm(x))
        if mlp_fn is not None:
            m = mlp_fn(layer, m)
        rec["mlp"].append(m[0])
        x = x + m
    return lm.hf_model.lm_head(inner.norm(x))[0], rec


_STEP1: dict = {}


def brute_sender_metric(lm, pair, receivers, sender, mode="qkv", freeze=True):
    clean_seq, corr_seq, read = sequences(pair)
    key = (id(lm), id(pair))
    if key not in _STEP1:  # step 1: clean and corrupted runs (the same for every sender)
        _STEP1[key] = (plain_forward(lm, clean_seq)[1], plain_forward(lm, corr_seq)[1])
    rc, rx = _STEP1[key]
    ls, hs = sender
    dh = lm.geometry.d_head
    sl = slice(hs * dh, (hs + 1) * dh)

    def z2(layer, z):  # step 2: sender corrupted, every other head frozen to clean
        base = rc["z"][layer][None].clone() if freeze else z.clone()
        if layer == ls:
            base[0, :, sl] = rx["z"][ls][:, sl]
        return base

    def mlp2(layer, m):  # and every MLP output frozen to clean
        return rc["mlp"][layer][None] if freeze else m

    _, r2 = plain_forward(lm, clean_seq, z_fn=z2, mlp_fn=mlp2)

    def qkv3(layer, hd, a):  # step 3: only the receivers' Q/K/V inputs replaced
        if (layer, hd) not in receivers:
            return a, a, a
        new = r2["ln1"][layer][None]
        return (new if "q" in mode else a, new if "k" in mode else a, new if "v" in mode else a)

    logits, _ = plain_forward(lm, clean_seq, qkv_in=qkv3)
    return float(logit_diff(logits[read], pair.answer, pair.counter_answer))


@pytest.fixture(scope="module")
def pairs(smol_tokenizer):
    return niah_single(smol_tokenizer, n_pairs=2, seq_len=64, depth=[0.3, 0.7], seed=1)


@pytest.fixture(scope="module")
def tiny3(smol_tokenizer):
    from conftest import tiny_llama

    from headscope.models import wrap

    return wrap(tiny_llama(smol_tokenizer, seed=3, n_layers=3), smol_tokenizer, name="tiny-llama-3")


def test_plain_forward_is_the_model(tiny, pairs):
    ids = sequences(pairs[0])[0]
    logits, _ = plain_forward(tiny, ids)
    eng = Engine(tiny).run(ids, list(range(ids.numel())))
    assert torch.allclose(logits, eng.logits, atol=1e-5)


@pytest.mark.parametrize("mode", fast_first(["q", "qkv", "kv"]))
def test_sender_ie_matches_brute_force(tiny, pairs, mode):
    receivers = [(1, 0), (1, 3), (0, 2)]
    use = pairs if mode == "qkv" else pairs[:1]
    res = sender_patching(tiny, use, receivers, mode=mode, min_gap=0.0, batch_size=3, progress=False)
    g = tiny.geometry
    for i, p in enumerate(use):
        ref = torch.tensor([[brute_sender_metric(tiny, p, receivers, (l, h), mode) for h in range(g.n_heads)]
                            for l in range(g.n_layers)], dtype=torch.float64)
        assert torch.allclose(res.patched[i], ref, atol=1e-5, rtol=0)
        gap = res.m_clean[i] - res.m_corrupt[i]
        assert torch.allclose(res.ie[i].double(), (res.m_clean[i] - ref) / gap, atol=1e-4)
    # last-layer senders (and any sender at or above every receiver) have no path: IE 0
    assert torch.all(res.ie[:, 1] == 0)
    # layer-0 senders do reach the layer-1 receivers
    assert res.ie[:, 0].abs().max() > 1e-4


@pytest.mark.slow
def test_freezing_three_layers(tiny3, pairs):
    """Through a middle layer only the direct path counts: the engine matches the frozen brute
    force, which differs from the unfrozen one; a sender with no path changes nothing."""
    receivers = [(2, 1), (2, 2)]
    res = sender_patching(tiny3, pairs[:1], receivers, min_gap=0.0, progress=False)
    p = pairs[0]
    frozen = [brute_sender_metric(tiny3, p, receivers, (0, h)) for h in range(4)]
    loose = [brute_sender_metric(tiny3, p, receivers, (0, h), freeze=False) for h in range(4)]
    assert torch.allclose(res.patched[0, 0], torch.tensor(frozen, dtype=torch.float64), atol=1e-5)
    assert max(abs(a - b) for a, b in zip(frozen, loose)) > 1e-4
    # same-layer and later senders: exactly the clean metric
    for s in [(2, 0), (2, 3)]:
        assert brute_sender_metric(tiny3, p, receivers, s) == pytest.approx(res.m_clean[0].item(), abs=1e-5)
        assert res.patched[0, s[0], s[1]].item() == res.m_clean[0].item()
    # a receiver set only in layer 0 cannot be reached by anyone
    ie0 = sender_ie(tiny3, pairs[:1], [(0, 0)], min_gap=0.0, progress=False)
    assert torch.all(ie0 == 0)


def test_bad_receivers_and_mode(tiny, pairs):
    with pytest.raises(ValueError, match="outside the model"):
        sender_ie(tiny, pairs, [(2, 0)])
    with pytest.raises(ValueError, match="outside the model"):
        sender_ie(tiny, pairs, [(0, 4)])
    with pytest.raises(ValueError, match="no receivers"):
        sender_ie(tiny, pairs, [])
    with pytest.raises(ValueError, match="mode"):
        sender_ie(tiny, pairs, [(1, 0)], mode="o")


def test_iteration_records_rounds(tiny3, pairs, tmp_path):
    ie_recv = torch.zeros(3, 4)
    ie_recv[2, 1] = 1.0
    ie_recv[2, 2] = 0.5
    it = iterate_senders(tiny3, pairs, ie_recv, top_k=2, max_rounds=3, min_gap=0.0, progress=False,
                         store_dir=str(tmp_path))
    assert 1 <= len(it.rounds) <= 3
    assert it.rounds[0]["receivers"] == [(2, 1), (2, 2)]
    direct = torch.nanmean(sender_ie(tiny3, pairs, [(2, 1), (2, 2)], min_gap=0.0, progress=False).double(), 0)
    assert torch.allclose(it.rounds[0]["ie_send"].double(), direct, atol=1e-6)
    # ie_send is the per-head max over rounds; the top set of each round is ranked by max(recv, send)
    stacked = torch.stack([r["ie_send"] for r in it.rounds])
    assert torch.allclose(it.ie_send, stacked.max(0).values.clamp(min=0))
    for r in it.rounds[1:]:
        prev = {h for q in it.rounds[: r["round"] - 1] for h in q["receivers"]}
        assert r["receivers"] and not set(r["receivers"]) & prev
    # rerun resumes from the store: same numbers
    again = iterate_senders(tiny3, pairs, ie_recv, top_k=2, max_rounds=3, min_gap=0.0, progress=False,
                            store_dir=str(tmp_path))
    assert torch.equal(again.ie_send, it.ie_send)
