"""The memory plan of a conversion stage (headscope/train/memory_plan.py): parameter counts exact against the
models transformers builds (meta device) and the hybrid hybridize() builds; parameter, gradient and AdamW state
bytes exact against a trained tiny model's tensors; hand-computed counts and bytes for the Qwen3-1.7B and
Llama-3.1-8B shapes; the whole plan against the peaks measured on an H200; the `headscope plan-memory` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headscope.masks import HeadMask
from headscope.train.memory_plan import (
    GiB,
    KNOWN_SHAPES,
    LayerHeads,
    MemoryOptions,
    activation_bytes_per_token,
    ModelShape,
    hybrid_attention_params,
    layer_heads,
    plan_memory,
)

ROOT = Path(__file__).resolve().parents[1]


def _qwen3_cfg(**kw):
    from transformers import Qwen3Config

    base = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    return Qwen3Config(**{**base, **kw})


def _llama_cfg(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    return LlamaConfig(**{**base, **kw})


def test_teacher_counts_equal_the_models_transformers_builds():
    """Qwen3-1.7B and Llama-3.1-8B built on the meta device (no memory, nothing downloaded): the shape's parameter
    count is theirs exactly, and from_config gives the known shapes."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    for cfg, cls, key, n in ((_qwen3_cfg(), Qwen3ForCausalLM, "qwen3-1.7b", 1_720_574_976),
                             (_llama_cfg(), LlamaForCausalLM, "llama-3.1-8b", 8_030_261_248)):
        with torch.device("meta"):
            model = cls(cfg)
        built = sum(p.numel() for p in model.parameters())
        shape = ModelShape.from_config(cfg, key)
        assert shape == KNOWN_SHAPES[key]
        assert shape.teacher_params() == built == n
        attn = sum(p.numel() for layer in model.model.layers for p in layer.self_attn.parameters())
        assert shape.layers * shape.attention_params() == attn


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hybrid_counts_equal_hybridize(smol_tokenizer, family):
    """Tiny teachers hybridized with several masks and options: the plan's per-layer counts are the hybrid's exactly,
    and its 'new' parameters are the ones named a_proj / b_proj / A_log / dt_bias / gamma / g_proj / gdn_conv."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from headscope.hybrid import hybridize

    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
    cfg = Qwen3Config(head_dim=16, **kw) if family == "qwen3" else LlamaConfig(**kw)
    torch.manual_seed(0)
    teacher = (Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM)(cfg)
    shape = ModelShape.from_config(cfg)
    assert shape.teacher_params() == sum(p.numel() for p in teacher.parameters())
    mask = HeadMask(3, 4, 2, ((1,), (0, 3), (0, 1, 2)))
    new_names = ("a_proj", "b_proj", "A_log", "dt_bias", "gamma", "g_proj", "gdn_conv")
    for opts in ({}, {"fa_gate": True}, {"fa_gate": True, "gdn_conv": 4}, {"fusion": "none"}):
        student = hybridize(teacher, mask, **opts)
        heads = layer_heads(shape, mask)
        assert [(h.n_fa, h.n_fa_kv) for h in heads] == [(1, 1), (2, 2), (3, 2)]
        for i, lh in enumerate(heads):
            want = hybrid_attention_params(shape, lh, fa_gate=opts.get("fa_gate", False), gdn_conv=opts.get("gdn_conv", 0),
                                           fusion=opts.get("fusion", "rmsnorm"))
            named = dict(student.model.layers[i].self_attn.named_parameters())
            new = sum(p.numel() for n, p in named.items() if n.split(".")[0] in new_names)
            assert (want["copied"] + want["new"], want["new"]) == (sum(p.numel() for p in named.values()), new), (opts, i)
        plan = plan_memory(shape, 2, 1, 8, fa=mask, options=MemoryOptions(**{"fa_gate": False, **opts}))
        assert plan.counts["student"] == sum(p.numel() for p in student.parameters())


def test_state_bytes_equal_a_trained_tiny_model(smol_tokenizer, tmp_path):
    """One trainer step of stages 1 and 2 on a tiny hybrid (one process, fp32, AdamW): the plan's parameter,
    gradient and optimizer-state bytes are the sums over the student's parameters, their .grad and the optimizer's
    exp_avg / exp_avg_sq tensors (each AdamW state also holds a 4-byte step count, not in the plan)."""
    from headscope.hybrid import hybridize
    from headscope.train import TokenRows, TrainConfig, Trainer

    from conftest import tiny_llama

    teacher = tiny_llama(smol_tokenizer, seed=3)
    shape = ModelShape.from_config(teacher.config)
    mask = HeadMask(2, 4, 2, ((1,), (0, 3)))
    ids = torch.randint(0, 400, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))
    for stage in (1, 2):
        torch.manual_seed(7)
        student = hybridize(teacher, mask, fa_gate=True)
        cfg = TrainConfig(stage=stage, tokens=4 * 16, batch_size=4, progress=False, ckpt_on_exit=False)
        tr = Trainer(student, teacher, rows, cfg, tmp_path / str(stage))
        tr.train_step()
        plan = plan_memory(shape, stage, 4, 16, fa=mask, options=MemoryOptions(teacher_dtype="fp32"))
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        assert plan.params == size(student.parameters())
        assert plan.grads == size(p.grad for p in student.parameters() if p.grad is not None)
        moments = [t for st in tr.opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
        assert plan.optimizer == size(moments)
        assert plan.teacher == size(teacher.parameters())
        if stage == 1:
            assert plan.grads < plan.params  # only the attention modules trained


def test_qwen3_and_llama_plans_by_hand():
    """Hand-computed counts (7:1: 2 FA heads of 16 per Qwen3 layer, 4 of 32 per Llama layer, each in its own KV
    group; FA gate on, RMSNorm fusion, no convolution).

    Qwen3-1.7B, one hybrid attention module: copied = q, o 2·16·128·2048 = 8,388,608 + FA k, v 2·2·128·2048 = 1,048,576
    + GDN k, v 2·14·128·2048 = 7,340,032 + q/k norms 256 = 16,777,472; new = a, β 2·14·2048 + β bias 14 + decay, dt 28
    = 57,386, γ 16·128 = 2,048, gate 2·128·2048 + 256 = 524,544: 583,978. The teacher's module: 8,388,608 +
    2·8·128·2048 + 256 = 12,583,168. Student: 1,720,574,976 + 28 · (17,361,450 − 12,583,168) = 1,854,366,872.

    Llama-3.1-8B: copied = 2·32·128·4096 + 2·4·128·4096 + 2·28·128·4096 = 67,108,864; new = 2·28·4096 + 28 + 56 +
    32·128 + 4·128·4096 + 512 = 2,331,220; teacher module 2·32·128·4096 + 2·8·128·4096 = 41,943,040. Student:
    8,030,261,248 + 32 · 27,497,044 = 8,910,166,656."""
    q, ll = KNOWN_SHAPES["qwen3-1.7b"], KNOWN_SHAPES["llama-3.1-8b"]
    assert hybrid_attention_params(q, LayerHeads(2, 2)) == {"copied": 16_777_472, "new": 583_978}
    assert hybrid_attention_params(ll, LayerHeads(4, 4)) == {"copied": 67_108_864, "new": 2_331_220}
    pq = plan_memory(q, 2, 64, 512)
    assert pq.counts["student"] == 1_854_366_872
    # stage 2, one device, fp32 master + fp32 AdamW: 4 + 4 + 8 bytes per student parameter, a bf16 teacher
    assert (pq.params, pq.grads, pq.optimizer, pq.teacher) == (4 * 1_854_366_872, 4 * 1_854_366_872,
                                                               8 * 1_854_366_872, 2 * 1_720_574_976)
    # the loss chunk: 4,096 rows x 151,936 x fp32, student + teacher logits + gradient
    assert pq.loss_chunk == 4096 * 151936 * 4 * 3
    # FSDP2 runs the plain step: the logits of every row at once (16 x 512 rows per device here)
    assert plan_memory(q, 3, 16, 512, options=MemoryOptions(devices=4)).loss_chunk == 16 * 512 * 151936 * 4 * 2
    p8 = plan_memory(ll, 1, 64, 512)
    assert p8.counts["student"] == 8_910_166_656 and p8.counts["trained"] == 32 * (67_108_864 + 2_331_220)
    new_only = plan_memory(ll, 1, 64, 512, options=MemoryOptions(new_params_only=True, optimizer="8bit"))
    assert new_only.grads == 4 * 32 * 2_331_220
    assert new_only.optimizer == pytest.approx(32 * 2_331_220 * (2 + 8 / 2048), abs=1)
    # FSDP2 over 8: stages 2-3 shard everything; stage 1 only the attention modules
    f2 = plan_memory(ll, 2, 8, 512, options=MemoryOptions(devices=8))
    assert f2.params == 4 * 8_910_166_656 // 8 and f2.optimizer == 8 * 8_910_166_656 // 8
    f1 = plan_memory(ll, 1, 8, 512, options=MemoryOptions(devices=8))
    attn = 32 * (67_108_864 + 2_331_220)
    assert f1.params == 4 * (8_910_166_656 - attn) + 4 * attn // 8
    off = plan_memory(ll, 2, 8, 512, options=MemoryOptions(devices=8, cpu_offload=True))
    assert off.params == off.grads == off.optimizer == 0 and off.host == f2.params + f2.grads + f2.optimizer
    # activations per token and layer (Qwen3-1.7B, 2 FA heads in 2 KV groups, 14 GDN heads): attention half
    # 8·2048 + 4 + 2·2048 (two fp32 residual/normalized copies, rstd, the bf16 projection input) + 2·128·(2 + 2·2) + 4·2
    # (FA q, k, v; lse) + 14·(2·3·128 + 8 + 4·64) (GDN q, k, v; gate, β; fla's block row) + 2·16·128 (o_proj input)
    # = 40,572; the MLP half 8·2048 + 4 + 2·2048 + 8·6144 = 69,636
    assert activation_bytes_per_token(q, LayerHeads(2, 2), mlp=False) == 40_572
    assert activation_bytes_per_token(q, LayerHeads(2, 2)) == 40_572 + 69_636
    a1, a2 = plan_memory(q, 3, 1, 2048), plan_memory(q, 3, 2, 2048)
    assert a1.activations == 2048 * (28 * 110_208 + 4 * 2048) and a2.activations == 2 * a1.activations
    # stage 1 keeps every teacher layer's attention input (the teacher's dtype) and output (bf16); stage 2 the
    # teacher's final hidden states (its dtype): an fp32 teacher adds 2 bytes per token and channel to each
    b1, f1 = (plan_memory(q, 1, 1, 512, options=MemoryOptions(teacher_dtype=d)) for d in ("bf16", "fp32"))
    assert b1.activations == 512 * (28 * 40_572 + 28 * (2 + 2) * 2048 + 4 * 2048)
    assert f1.activations - b1.activations == 512 * 28 * 2 * 2048
    b2, f2 = (plan_memory(q, 2, 1, 512, options=MemoryOptions(teacher_dtype=d)) for d in ("bf16", "fp32"))
    assert f2.activations - b2.activations == 512 * 2 * 2048
    # checkpointing keeps each layer's fp32 input and one layer's activations during its recomputation
    ck = plan_memory(q, 3, 1, 8192, options=MemoryOptions(activation_checkpointing=True))
    assert ck.activations == 8192 * (28 * 4 * 2048 + 110_208 + 4 * 2048)


def test_plan_against_h200_peaks():
    """At the SmolLM2-135M shape (34 FA heads of 270, fast step, bf16 teacher, fp32 master, fused AdamW) the plan's
    total is within 0.8-1.05x of the peak max_memory_allocated measured on an H200 (benchmarks/bench_train.py,
    benchmarks/results/h200_train.json; measured 0.83x stage 1, 0.98x stage 2, 0.92x stage 3)."""
    res = json.loads((ROOT / "benchmarks" / "results" / "h200_train.json").read_text())["results"]
    shape = KNOWN_SHAPES["smollm2-135m"]
    for key, stage, rows, seq in (("stage1_64x512", 1, 64, 512), ("stage2_64x512", 2, 64, 512),
                                  ("stage2_16x2048", 2, 16, 2048), ("stage3_64x512", 3, 64, 512)):
        measured = res[key]["hybrid_fast"]["peak_gib"]
        planned = plan_memory(shape, stage, rows, seq, fa=34 / 270).total / GiB
        assert 0.8 <= planned / measured <= 1.05, (key, planned, measured)


def test_bad_settings_are_refused():
    from headscope.errors import HeadscopeInputError

    with pytest.raises(HeadscopeInputError, match="optimizer"):
        MemoryOptions(optimizer="4bit")
    with pytest.raises(HeadscopeInputError, match="cpu_offload"):
        MemoryOptions(cpu_offload=True)
    with pytest.raises(HeadscopeInputError, match="stage 4"):
        plan_memory(KNOWN_SHAPES["qwen3-1.7b"], 4, 1, 8)
    with pytest.raises(HeadscopeInputError, match="share"):
        plan_memory(KNOWN_SHAPES["qwen3-1.7b"], 1, 1, 8, fa=1.5)
    with pytest.raises(HeadscopeInputError, match="mask is for"):
        plan_memory(KNOWN_SHAPES["qwen3-1.7b"], 1, 1, 8, fa=HeadMask(2, 4, 2, ((1,), (0,))))


def test_plan_memory_command(tmp_path):
    from typer.testing import CliRunner

    from headscope.cli import app

    r = CliRunner().invoke(app, ["plan-memory", "--model", "llama-3.1-8b", "--devices", "8", "--stage", "2", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)["plans"][0]
    # the command's --teacher-dtype default is `headscope convert`'s: fp32
    assert plan["rows"] == 8 and plan["total"] == plan_memory(KNOWN_SHAPES["llama-3.1-8b"], 2, 8, 512,
                                                             options=MemoryOptions(devices=8, teacher_dtype="fp32")).total
    assert plan["options"]["teacher_dtype"] == "fp32"
    r = CliRunner().invoke(app, ["plan-memory"])
    assert r.exit_code == 0 and "total per device" in r.output and "stage 3 (16 x 2048)" in r.output
    _llama_cfg(num_hidden_layers=2).save_pretrained(tmp_path)
    r = CliRunner().invoke(app, ["plan-memory", "--model", str(tmp_path), "--stage", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["plans"][0]["counts"]["teacher"] == 2 * KNOWN_SHAPES["llama-3.1-8b"].layer_params() + \
        KNOWN_SHAPES["llama-3.1-8b"].root_params()
    r = CliRunner().invoke(app, ["plan-memory", "--optimizer", "4bit"])
    assert r.exit_code == 2 and "error:" in r.output
    # --grad-accum 4: every stage planned for a micro-batch of a quarter of the rows;
    # --teacher-dtype fp32 (what convert holds) doubles the teacher's bytes
    r = CliRunner().invoke(app, ["plan-memory", "--grad-accum", "4", "--teacher-dtype", "fp32", "--json"])
    assert r.exit_code == 0, r.output
    p1, p2, p3 = json.loads(r.output)["plans"]
    q = KNOWN_SHAPES["qwen3-1.7b"]
    o = MemoryOptions(teacher_dtype="fp32")
    assert (p1["rows"], p2["rows"], p3["rows"]) == (16, 16, 4)
    assert p2["total"] == plan_memory(q, 2, 16, 512, options=o).total and p1["total"] == plan_memory(q, 1, 16, 512, options=o).total
    assert p2["teacher"] == 2 * plan_memory(q, 2, 16, 512).teacher
    r = CliRunner().invoke(app, ["plan-memory", "--grad-accum", "0"])
    assert r.exit_code == 2 and "--grad-accum" in r.output
