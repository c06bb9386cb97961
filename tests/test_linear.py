"""The engine's CPU fp32 linear maps (oneDNN, prepacked weights) against F.linear, and the blocked
MLP against one unblocked pass."""

import pytest
import torch
import torch.nn.functional as F

from headscope.patching import layer_ops
from headscope.patching.engine import Engine
from headscope.patching.linear import linear, onednn_available, packed_weight
from headscope.patching.receivers import PairState
from headscope.tasks import niah_single


def test_linear_matches_f_linear_on_odd_shapes():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(37, 53, generator=g), torch.randn(37, generator=g)
    x = torch.randn(3, 11, 53, generator=g)
    want = (x.double() @ w.double().T + b.double()).float()
    with torch.no_grad():
        got = linear(x, w, b)
        got_t = linear(x.transpose(0, 1), w)  # non-contiguous input, no bias
    assert got.shape == (3, 11, 37)
    assert torch.allclose(got, want, atol=2e-5, rtol=0)
    assert torch.allclose(got_t, F.linear(x.transpose(0, 1), w), atol=2e-5, rtol=0)


@pytest.mark.skipif(not onednn_available(), reason="oneDNN prepacked linear not available in this build")
def test_packed_weight_is_cached_and_refreshed_after_in_place_change():
    w = torch.randn(8, 16)
    p1 = packed_weight(w)
    assert packed_weight(w) is p1  # cached
    x = torch.randn(4, 16)
    with torch.no_grad():
        w.mul_(2.0)  # the version counter moves: the packed copy is made again
        assert packed_weight(w) is not p1
        assert torch.allclose(linear(x, w), x @ w.T, atol=1e-5, rtol=0)


def test_linear_keeps_autograd():
    """With gradients on, the call goes to F.linear and the gradient is the analytic one."""
    w = torch.randn(5, 6, requires_grad=True)
    x = torch.randn(2, 6, requires_grad=True)
    linear(x, w).sum().backward()
    assert torch.allclose(x.grad, w.detach().sum(0).expand(2, 6))
    assert torch.allclose(w.grad, x.detach().sum(0).expand(5, 6))


@pytest.mark.slow
def test_onednn_switch_gives_same_patched_logits(tiny, smol_tokenizer, monkeypatch):
    """Patched logits with oneDNN, without it (HEADSCOPE_ONEDNN=0) and with the MLP cut into blocks of
    7 tokens agree to float32 rounding."""
    pair = niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=5)[0]

    def run():
        e = Engine(tiny)
        st = PairState(e, pair, 1.0, "denoising")
        z = st.src.z[0, st.start :][None].repeat(3, 1, 1)
        return e.patched_logits(st.base, 0, z, st.start, st.read)

    on = run()
    monkeypatch.setattr(layer_ops, "MLP_BLOCK", 7)
    blocked = run()
    monkeypatch.setenv("HEADSCOPE_ONEDNN", "0")
    off = run()
    assert on.shape == off.shape and on.shape[0] == 3
    assert torch.allclose(on, off, atol=1e-5, rtol=0)
    assert torch.allclose(blocked, off, atol=1e-5, rtol=0)


def test_engine_runs_module_hooks(tiny, smol_tokenizer):
    """A forward pre-hook on o_proj (as a knockout installs) still acts on the engine's passes: the
    fast path only takes weights of hook-free modules."""
    from headscope.arch import unwrap as _orig

    pair = niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=5)[0]
    ids = pair.clean
    plain = Engine(tiny).run(ids, [len(ids) - 1]).logits
    o = _orig(_orig(tiny.hf_model.model.layers[0]).self_attn.o_proj)
    h = o.register_forward_pre_hook(lambda _m, args: (torch.zeros_like(args[0]),))
    try:
        zeroed = Engine(tiny).run(ids, [len(ids) - 1])
    finally:
        h.remove()
    assert not torch.allclose(plain, zeroed.logits, atol=1e-3)
    # the same as a pass whose layer-0 hook_z is zero
    want = Engine(tiny).run(ids, [len(ids) - 1], z_override=lambda layer, z: torch.zeros_like(z) if layer == 0 else z)
    assert torch.allclose(zeroed.logits, want.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("approx", ["tanh", "none"])
def test_linear_gelu_epilogue_matches_unfused(approx):
    """The GELU in the kernel's epilogue (GPT-2's MLP) equals F.gelu(F.linear(...)) to float32 rounding,
    against a float64 reference."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(64, 48, generator=g) * 0.3, torch.randn(64, generator=g)
    x = torch.randn(2, 9, 48, generator=g)
    want = F.gelu(x.double() @ w.double().T + b.double(), approximate=approx).float()
    with torch.no_grad():
        got = linear(x, w, b, act=("gelu", approx))
    assert got.shape == (2, 9, 64)
    assert float((got - want).abs().max()) < 2e-5
    assert float(want.abs().max()) > 1.0  # not a vacuous comparison


def test_gpt2_mlp_blocks_with_fused_gelu_match_the_module():
    from headscope.arch.random_models import _families
    from headscope.patching.mlp import mlp_linears

    hf = _families(1, 64, 4, 4)["gpt2"](50, 0)
    blk = hf.transformer.h[0]
    parts = mlp_linears(blk.mlp)
    assert parts is not None and parts.gate is None
    if onednn_available():
        assert parts.fused == ("gelu", "tanh")
    _assert_blocked_mlp_equals_module(parts, blk.ln_2, blk.mlp, seed=0)


def _assert_blocked_mlp_equals_module(parts, norm, mlp, seed: int) -> None:
    """h + mlp(norm(h)) through the blocked oneDNN MLP (blocks of 7 rows) equals the module's own call."""
    from headscope.patching.mlp import mlp_blocks

    h = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = h + mlp(norm(h))
        got = mlp_blocks(parts, norm, h, block=7)
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_phi3_fused_gate_up_runs_blocked_and_matches_the_module():
    """Phi-3's gate_up_proj ([gate | up] rows) is taken as two row views, gate first: the blocked MLP
    equals the module's own call."""
    from headscope.arch.random_models import _families
    from headscope.patching.mlp import mlp_linears

    hf = _families(1, 64, 4, 2)["phi3"](50, 0)
    blk = hf.model.layers[0]
    parts = mlp_linears(blk.mlp)
    assert parts is not None and parts.gate is not None
    f = blk.mlp.down_proj.in_features
    assert torch.equal(parts.gate.weight, blk.mlp.gate_up_proj.weight[:f])
    assert torch.equal(parts.up.weight, blk.mlp.gate_up_proj.weight[f:])
    _assert_blocked_mlp_equals_module(parts, blk.post_attention_layernorm, blk.mlp, seed=1)


def test_linear_rejects_act_with_residual_or_unknown_act():
    x, w = torch.randn(2, 6), torch.randn(4, 6)
    with pytest.raises(ValueError, match="only"):
        linear(x, w, act=("gelu", "tanh"), residual=torch.randn(2, 4))
    with pytest.raises(ValueError, match="only"):
        linear(x, w, act=("relu", ""))


def test_linear_rejects_wrong_weight_shape():
    with pytest.raises(ValueError, match="expects 6"):
        linear(torch.randn(2, 5), torch.randn(4, 6))


def test_screen_auto_rejects_slack_below_one(tiny, smol_tokenizer):
    from headscope.patching.screen import screen_auto

    pairs = niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=0)
    with pytest.raises(ValueError, match="atp_slack=0.5 must be >= 1"):
        screen_auto(tiny, pairs, top_k=2, atp_slack=0.5, progress=False)
