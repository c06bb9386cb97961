"""An eager prefill's GDN heads as fixed-shape, graph-replayed blocks (InferenceConfig.eager_gdn_graphs).

On CPU the same padded static-buffer path runs without graphs (ShapeGraphs calls the block function directly),
so these tests check the padding (rows that leave the state unchanged), the block bookkeeping and the static
buffers' reuse across calls; the GPU test checks the captured graphs against the path without them.
"""

import pytest
import torch

from headscope.hybrid.inference import plan as plan_mod, prefill
from headscope.hybrid.inference.graphs import ShapeGraphs
from headscope.hybrid.gdn_kernels import fla_available
from headscope.hybrid.inference import DEFAULT

from inference_cfg import use
from test_hybrid_lean import CASES, IDS, _inputs, _layer, _plain, spy_gdn_calls


def graphs_on(layer, **changes):
    """The layer on the lean path with the padded blocks on every device (CPU: without graphs)."""
    return use(layer, eager_gdn_graphs="always", **changes)


@pytest.fixture
def eager_graphs():
    prefill.release_eager_graphs()
    yield
    prefill.release_eager_graphs()


def test_eager_graph_block_rule():
    assert DEFAULT.eager_graph_tokens == 8192 and DEFAULT.eager_graph_min == 256
    assert prefill.eager_graph_block(1, 131072) == 8192 == prefill.eager_graph_block(1, 8192)
    assert prefill.eager_graph_block(1, 8191) == 8192  # the next power of two
    assert prefill.eager_graph_block(1, 3000) == 4096
    assert prefill.eager_graph_block(1, 257) == 512
    assert prefill.eager_graph_block(1, 9) == 256  # at least EAGER_GRAPH_MIN
    assert prefill.eager_graph_block(16, 32768) == 512  # 8192 tokens over 16 sequences
    assert prefill.eager_graph_block(3, 32768) == 2688  # 8192 // 3 = 2730, down to a multiple of 64
    assert prefill.eager_graph_block(3, 1000) == 1024
    assert prefill.eager_graph_block(1000, 5000) == 64  # never below 64 time steps


@pytest.mark.parametrize("fa,qwen,opts", CASES, ids=IDS)
def test_padded_blocks_equal_the_plain_forward_and_keep_the_state(eager_graphs, monkeypatch, fa, qwen, opts):
    """Blocks of 64 time steps, the last one padded: the output equals the plain forward's, the state after the
    prefill equals the path without blocks (eager_gdn_graphs="never"), and so does the next decode step; a second,
    shorter prefill reuses the static buffers (stale rows from the first call in the padding) and is exact too."""
    layer, _, cfg = _layer(fa, qwen, **opts)
    on = graphs_on(layer, eager_graph_tokens=128, eager_graph_min=64)  # B = 2: 64 time steps per block
    calls = spy_gdn_calls(monkeypatch)
    B = 2
    for T in (150, 100):
        x, cos, sin = _inputs(cfg, B, T + 1, seed=T)
        pe, pe1 = (cos[:, :T], sin[:, :T]), (cos[:, T:], sin[:, T:])
        with torch.no_grad():
            ref = _plain(layer, x[:, :T], position_embeddings=pe)
            calls.clear()
            dc = layer.new_decode_cache(B, T + 1)
            out, _ = layer(x[:, :T], position_embeddings=pe, cache=dc)
            assert calls == [64] * (-(-T // 64))  # every block padded to 64 time steps
            step = layer(x[:, T:], position_embeddings=pe1, cache=dc)[0]
            use(layer, eager_gdn_graphs="never")
            calls.clear()
            dc2 = layer.new_decode_cache(B, T + 1)
            out2, _ = layer(x[:, :T], position_embeddings=pe, cache=dc2)
            assert calls == [T]  # one call without the blocks
            step2 = layer(x[:, T:], position_embeddings=pe1, cache=dc2)[0]
            use(layer, **{k: getattr(on, k) for k in ("eager_gdn_graphs", "eager_graph_tokens", "eager_graph_min")})
        assert (out - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
        assert (out - out2).abs().max() < 1e-5
        assert (dc.S - dc2.S).abs().max() < 1e-5 * dc2.S.abs().max()
        assert (step - step2).abs().max() < 1e-5
    assert len(prefill._block_graphs) == 1 and prefill.eager_graph_bytes() > 0  # one configuration, its buffers held
    prefill.release_eager_graphs()
    assert prefill.eager_graph_bytes() == 0


def test_layers_sharing_a_block_graph_each_get_their_own_weights(eager_graphs):
    """Two layers of one shape take turns on the same block graph (as a model's layers do): each call refreshes the
    static copies of the layer's gate weights, and each output equals that layer's plain forward."""
    l1, _, cfg = _layer((1,), seed=0)
    l2, _, _ = _layer((1,), seed=5)
    for lay in (l1, l2):
        graphs_on(lay, eager_graph_tokens=64, eager_graph_min=64)
    x, cos, sin = _inputs(cfg, 1, 150)
    with torch.no_grad():
        for lay in (l1, l2, l1, l2):
            out, _ = lay(x, position_embeddings=(cos, sin))
            ref = _plain(lay, x, position_embeddings=(cos, sin))
            assert (out - ref).abs().max() < 1e-5 * ref.abs().max()
    assert len(prefill._block_graphs) == 1


def test_padded_rows_leave_the_state_unchanged(eager_graphs):
    """One block of 256 for 37 real rows vs the same 37 rows unpadded: output rows and final state agree."""
    layer, _, cfg = _layer((1,))
    graphs_on(layer)
    x, cos, sin = _inputs(cfg, 1, 37)
    p = plan_mod.plan(layer)
    with torch.no_grad():
        zg = torch.nn.functional.linear(x, p.W[p.n_fa_rows:], None if p.b is None else p.b[p.n_fa_rows:])
        S0 = torch.randn(1, p.ng, p.d, p.d)
        y, S = prefill.gdn_block_graphed(layer, zg, cos, sin, S0, 256)
        y, S = y[:, :37].clone(), S.clone()
        ref_y, ref_S = prefill._gdn_block(prefill.gdn_cfg(layer, p, True), zg, cos, sin, S0, None, p.A_neg, p.dtb, p.qn,
                                       p.kn)
    assert y.shape == ref_y.shape == (1, 37, p.ng, p.d)
    assert (y - ref_y).abs().max() < 1e-5 * ref_y.abs().max()
    assert (S - ref_S).abs().max() < 1e-5 * ref_S.abs().max()
    with pytest.raises(ValueError, match="does not fit"):
        prefill.gdn_block_graphed(layer, zg, cos, sin, S0, 32)


def test_blocks_are_not_used_with_autograd_or_without_gdn_heads(eager_graphs, monkeypatch):
    layer, _, cfg = _layer((1,))
    graphs_on(layer)
    x, cos, sin = _inputs(cfg, 1, 100)
    seen = []
    monkeypatch.setattr(prefill, "gdn_block_graphed", lambda *a, **k: seen.append(1))
    layer(x, position_embeddings=(cos, sin))  # grad enabled: the training path
    assert not seen and prefill.eager_graph_bytes() == 0
    use(layer)  # the default: CUDA only
    with torch.no_grad():
        layer(x, position_embeddings=(cos, sin))
    assert not seen


def test_shape_graphs_make_once_fill_every_call_and_drop_the_oldest():
    made, filled = [], []

    def fn(a, b):
        return (a * 2 + b,)

    sg = ShapeGraphs(fn, max_graphs=2)

    def run(key, val):
        def make():
            made.append(key)
            return [torch.zeros(3), torch.ones(3)]

        def fill(ins, memo):
            filled.append((key, memo.get("n", 0)))
            memo["n"] = memo.get("n", 0) + 1
            ins[0].fill_(val)

        return sg.run(key, make, fill)[0]

    assert run("a", 1.0).tolist() == [3.0] * 3
    assert run("a", 2.0).tolist() == [5.0] * 3
    assert run("b", 0.0).tolist() == [1.0] * 3
    assert made == ["a", "b"] and filled == [("a", 0), ("a", 1), ("b", 0)]  # the memo kept per key
    assert len(sg) == 2 and sg.nbytes() == 2 * (3 * 4 * 3)  # two inputs and one output of 3 floats per key
    sg.release()
    assert len(sg) == 0 and sg.nbytes() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla")
@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen3"])
def test_cuda_graph_blocks_equal_the_path_without_them(qwen):
    """On CUDA (bf16, fla): the graph-replayed blocks (captured on first use, 3 shapes over the lengths) give the
    output and the state of the path without them, also on a second call of a shape (replay, stale padding), and a
    prefill recorded into the caller's own graph does not use them."""
    prefill.release_eager_graphs()
    layer, _, cfg = _layer((1,), qwen, gdn_kernel="fla")
    layer = layer.cuda().to(torch.bfloat16)
    B = 1
    try:
        for T in (2500, 700, 2500, 300):
            x, cos, sin = (t.bfloat16() for t in _inputs(cfg, B, T, seed=T, device="cuda"))
            with torch.no_grad():
                use(layer, eager_gdn_graphs="never", eager_graph_tokens=1024)
                dc2 = layer.new_decode_cache(B, T)
                ref, _ = layer(x, position_embeddings=(cos, sin), cache=dc2)
                use(layer, eager_graph_tokens=1024)  # the default: on CUDA
                dc = layer.new_decode_cache(B, T)
                out, _ = layer(x, position_embeddings=(cos, sin), cache=dc)
            torch.cuda.synchronize()
            scale = ref.float().abs().max()
            assert (out.float() - ref.float()).abs().max() < 2e-2 * scale, T
            assert (dc.S - dc2.S).abs().max() < 2e-2 * dc2.S.abs().max(), T
        shapes = [k[3] for k in next(iter(prefill._block_graphs.values()))._entries]
        assert sorted(shapes) == [512, 1024]  # 2500 -> blocks of 1024; 700 -> 1024; 300 -> 512
        from headscope.hybrid.inference.graphs import capture

        n = prefill.eager_graph_bytes()
        pooled = sum(g.pool_bytes() for g in prefill._block_graphs.values())
        assert 0 < pooled < n  # the graphs' pool is found and counted with the static inputs
        with torch.no_grad():
            graph, static = capture(lambda: layer(x, position_embeddings=(cos, sin))[0], warmup=1)
            graph.replay()
        torch.cuda.synchronize()
        assert prefill.eager_graph_bytes() == n  # recorded calls take the graphed-prefill rule, no block graphs
        assert (static.float() - out.float()).abs().max() < 2e-2 * scale
    finally:
        prefill.release_eager_graphs()


def test_blocks_made_under_inference_mode_serve_no_grad_calls_and_back(eager_graphs):
    """The static buffers are ordinary tensors even when made inside torch.inference_mode, so a later call under
    no_grad can copy into them (an inference tensor cannot be written outside inference mode), and the reverse."""
    layer, _, cfg = _layer((1,))
    graphs_on(layer, eager_graph_tokens=64, eager_graph_min=64)
    x, cos, sin = _inputs(cfg, 1, 100)
    with torch.inference_mode():
        a, _ = layer(x, position_embeddings=(cos, sin))
    with torch.no_grad():
        b, _ = layer(x, position_embeddings=(cos, sin))
        ref = _plain(layer, x, position_embeddings=(cos, sin))
    with torch.inference_mode():
        c, _ = layer(x, position_embeddings=(cos, sin))
    assert (a - ref).abs().max() < 1e-5 * ref.abs().max()
    assert torch.equal(a, b) and torch.equal(b, c)


def test_a_failed_capture_warns_once_and_runs_without_graphs(monkeypatch):
    """A capture that raises (e.g. a kernel a GPU cannot capture): one warning naming the error, the call's inputs as
    filled (the failed warm-up's writes undone), its result from the function itself, and no capture tried again."""
    def fn(a):
        out = (a * 3,)
        a.add_(100.0)  # writes its input, as the GDN block writes its state
        return out

    sg = ShapeGraphs(fn)
    tries = []

    def capture(ins, dev):
        tries.append(1)
        fn(*ins)  # the warm-up ran before the failure
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(sg, "_capture", capture)
    monkeypatch.setattr(sg, "_direct", lambda dev: sg.failed is not None)  # as if on CUDA

    def run(val):
        return sg.run("k", lambda: [torch.zeros(2)], lambda ins, memo: ins[0].fill_(val))[0]

    with pytest.warns(UserWarning, match="capture failed.*not permitted"):
        assert run(1.0).tolist() == [3.0, 3.0]  # from the filled 1.0, not from the warm-up's 101.0
    assert run(2.0).tolist() == [6.0, 6.0] and tries == [1]
    assert sg.failed.startswith("RuntimeError")
