"""The fast training step on CUDA (tiny models): compiled + CUDA-graphed steps against the plain step.
Skipped without a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from headscope.hybrid import hybridize
from headscope.masks import HeadMask
from headscope.train import TokenRows, TrainConfig, Trainer, stage_loss, trainable_parameters
from headscope.train.fast import FastStep

from conftest import Vocab, counting_backend, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # the configuration the trainer uses on CUDA: fla's GDN kernels (without fla it takes the plain step)
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla (pip install 'headscope[gdn]')"),
]


def _models(dtype=torch.float32):
    teacher = tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64).cuda()
    student = hybridize(teacher, HeadMask(2, 4, 2, ((0,), (1, 3))))
    return teacher.to(dtype), student


def _rel(a, b):
    return (torch.linalg.vector_norm((a - b).float()) / torch.linalg.vector_norm(b.float()).clamp_min(1e-12)).item()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 64), generator=g).cuda()
    return ids, torch.ones_like(ids, dtype=torch.bool)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_graphed_compiled_step_equals_plain_step_fp32(stage):
    """fp32 (no autocast): the compiled, graph-replayed step computes stage_loss and its gradients."""
    teacher, st = _models()
    params = [p for _, p in trainable_parameters(st, stage)]
    ids, mask = _batch()
    st.zero_grad()
    loss, _ = stage_loss(stage, st, teacher, ids, mask)
    loss.backward()
    g_ref = [p.grad.clone() for p in params]
    fs = FastStep(stage, st, teacher, params, bf16=False, compile=True, cuda_graph=True, warmup=2)
    for _ in range(4):  # 2 eager warm-up steps, the capture, one replay (no optimizer: same weights)
        logged = fs(ids, mask)
    assert fs.graph is not None, fs.graph_error
    assert abs(logged[0].item() - loss.item()) <= 1e-3 * abs(loss.item()) + 1e-6
    for p, gr in zip(params, g_ref):
        assert _rel(p.grad, gr) < 1e-2
    fs.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("family", ["mistral_sw", "gemma3"])
def test_graphed_compiled_step_with_sliding_windows_fp32(family, stage):
    """fp32: the compiled, graph-replayed step of a Mistral (window 24) / Gemma 3 (window 8 between full layers)
    hybrid on 64-token rows computes stage_loss and its gradients (dense teacher layers given the window masks, the
    hybrid layers' fused backend applying their own)."""
    from families import FAMILIES

    teacher = FAMILIES[family](256, 0).float().cuda().eval()
    L = teacher.config.num_hidden_layers
    st = hybridize(teacher, HeadMask(L, 4, 2, ((0,), (1, 3), (2,))[:L]))
    params = [p for _, p in trainable_parameters(st, stage)]
    ids, mask = _batch()
    st.zero_grad()
    loss, _ = stage_loss(stage, st, teacher, ids, mask)
    loss.backward()
    g_ref = [p.grad.clone() for p in params]
    fs = FastStep(stage, st, teacher, params, bf16=False, compile=True, cuda_graph=True, warmup=2)
    for _ in range(4):
        logged = fs(ids, mask)
    assert fs.graph is not None, fs.graph_error
    assert abs(logged[0].item() - loss.item()) <= 1e-3 * abs(loss.item()) + 1e-6
    for p, gr in zip(params, g_ref):
        assert _rel(p.grad, gr) < 1e-2
    fs.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_graphed_step_with_grad_accum_equals_the_whole_batch_fp32(stage, checkpointing):
    """fp32: the compiled step captured with two micro-batches (and with activation checkpointing inside the graph)
    gives stage_loss's whole-batch loss and gradients on a batch with padded rows."""
    teacher, st = _models()
    params = [p for _, p in trainable_parameters(st, stage)]
    ids, mask = _batch()
    mask[1, 40:] = False
    mask[3, 9:] = False
    st.zero_grad()
    loss, _ = stage_loss(stage, st, teacher, ids, mask)
    loss.backward()
    g_ref = [p.grad.clone() for p in params]
    fs = FastStep(stage, st, teacher, params, bf16=False, compile=True, cuda_graph=True, warmup=2, grad_accum=2,
                  activation_checkpointing=checkpointing)
    for _ in range(4):
        logged = fs(ids, mask)
    assert fs.graph is not None, fs.graph_error
    assert abs(logged[0].item() - loss.item()) <= 1e-3 * abs(loss.item()) + 1e-6
    for p, gr in zip(params, g_ref):
        assert _rel(p.grad, gr) < 1e-2
    fs.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_graph_replay_equals_the_compiled_eager_step_bf16(stage):
    """bf16 autocast: replaying the captured step gives the eager compiled step's loss and gradients."""
    res = []
    for graph in (False, True):
        torch.manual_seed(0)
        teacher, st = _models(torch.bfloat16)
        params = [p for _, p in trainable_parameters(st, stage)]
        ids, mask = _batch()
        fs = FastStep(stage, st, teacher, params, bf16=True, compile=True, cuda_graph=graph, warmup=2)
        for _ in range(4):
            logged = fs(ids, mask)
        assert (fs.graph is not None) == graph, fs.graph_error
        res.append((logged.clone(), [p.grad.clone() for p in params]))
        fs.close()
    (l0, g0), (l1, g1) = res
    assert _rel(l1, l0) < 1e-5
    for a, b in zip(g1, g0):
        assert _rel(a, b) < 1e-3


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_graphed_step_with_checkpointing_equals_the_step_without(stage, bf16):
    """Issue 63 (at Qwen3-1.7B shape the checkpointed step hit Dynamo's recompile limit at train_forward's FA call and
    its recomputation differed from the forward): the Inductor-compiled, CUDA-graphed step with fla's GDN kernels (one
    operator in the graph) and activation checkpointing gives the loss and gradients of the same step without it
    (relative error < 1e-5 for the loss; per parameter < 1e-4 in fp32, < 1e-2 under bf16 autocast), captures its
    graph, and compiles no graph after the first step, at most 4 (teacher layer, the student's 2 head-count
    configurations, the loss), with checkpointing as without."""
    from torch._inductor.compile_fx import compile_fx

    res = {}
    for on in (False, True):
        torch._dynamo.reset()
        backend, n = counting_backend(compile_fx)

        torch.manual_seed(0)
        teacher, st = _models(torch.bfloat16 if bf16 else torch.float32)
        params = [p for _, p in trainable_parameters(st, stage)]
        ids, mask = _batch()
        fs = FastStep(stage, st, teacher, params, bf16=bf16, compile=True, backend=backend, cuda_graph=True, warmup=2,
                      activation_checkpointing=on)
        graphs = []
        for _ in range(5):  # 2 eager warm-up steps, the capture, 2 replays (no optimizer: same weights)
            logged = fs(ids, mask)
            graphs.append(n[0])
        assert fs.graph is not None, fs.graph_error
        assert graphs == [graphs[0]] * 5 and graphs[0] <= 4, (on, graphs)
        res[on] = (logged.clone(), [p.grad.clone() for p in params])
        fs.close()
    (l0, g0), (l1, g1) = res[False], res[True]
    assert _rel(l1, l0) < 1e-5
    for a, b in zip(g1, g0):
        assert _rel(a, b) < (1e-2 if bf16 else 1e-4)


def test_trainer_uses_the_graphed_step_and_matches_the_plain_trainer(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (16, 64), generator=g)
    rows = TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))
    losses = {}
    for fast in (False, True):
        torch.manual_seed(0)
        teacher, st = _models()
        cfg = TrainConfig(stage=2, tokens=4 * 4 * 64, batch_size=4, progress=False, ckpt_on_exit=False,
                          save_student=False, fast=fast, bf16=False)
        tr = Trainer(st, teacher, rows, cfg, tmp_path / str(fast))
        rows_out = [tr.train_step() for _ in range(4)]
        if fast:
            assert tr.step_fn.graph is not None, tr.step_fn.graph_error
            assert all(grp.get("fused") for grp in tr.opt.param_groups)
        losses[fast] = [r["loss"] for r in rows_out]
    for a, b in zip(losses[False], losses[True]):
        assert b == pytest.approx(a, rel=1e-3, abs=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_step_on_the_second_gpu_is_captured():
    """A step on cuda:1 while the current device is cuda:0 (a queue started with --device cuda:1) is
    captured on cuda:1's stream: before the fix its capture failed and the step ran ungraphed."""
    assert torch.cuda.current_device() == 0
    teacher = tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64).to("cuda:1", torch.bfloat16)
    st = hybridize(teacher, HeadMask(2, 4, 2, ((0,), (1, 3)))).to("cuda:1")
    params = [p for _, p in trainable_parameters(st, 2)]
    ids, mask = (t.to("cuda:1") for t in _batch())
    fs = FastStep(2, st, teacher, params, bf16=True, compile=True, cuda_graph=True, warmup=2)
    for _ in range(4):
        logged = fs(ids, mask)
    assert fs.graph is not None, fs.graph_error
    assert logged.device == torch.device("cuda:1") and torch.isfinite(logged).all()
    fs.close()
