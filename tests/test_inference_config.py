"""InferenceConfig: frozen, validated, chosen per model (two models in one process differ), recorded as data."""

import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headscope.hybrid import InferenceConfig, hybridize, inference_config, use_inference
from headscope.hybrid.inference import DEFAULT
from headscope.masks import HeadMask


def _tiny():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    return hybridize(LlamaForCausalLM(cfg).eval(), HeadMask(2, 2, 1, ((0,), (1,))), gdn_kernel="torch").eval()


def test_defaults_are_the_measured_best_and_the_config_is_frozen():
    assert DEFAULT == InferenceConfig()
    assert (DEFAULT.train, DEFAULT.prefill, DEFAULT.decode, DEFAULT.captured_decode) == ("auto",) * 4
    assert (DEFAULT.eager_gdn_graphs, DEFAULT.flash_qla, DEFAULT.tail_kernel) == ("cuda", True, True)
    assert (DEFAULT.fused_out_max_d, DEFAULT.gdn_graph_block_divisor, DEFAULT.eager_graph_tokens) == (64, 4, 8192)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.prefill = "lean"  # type: ignore[misc]
    cfg = dataclasses.replace(DEFAULT, gdn_block_tokens=4096)
    assert cfg.gdn_block_tokens == 4096 and DEFAULT.gdn_block_tokens is None
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["gdn_block_tokens"] == 4096  # a result file can hold it


@pytest.mark.parametrize("changes,match", [
    ({"prefill": True}, "prefill must be a backend name"), ({"eager_gdn_graphs": None}, "eager_gdn_graphs must be one of"),
    ({"tail_kernel": 1}, "tail_kernel must be True or False"), ({"eager_graph_tokens": 0}, "eager_graph_tokens must be"),
    ({"gdn_block_tokens": 0}, "gdn_block_tokens must be None or"), ({"fused_out_max_d": -1}, "fused_out_max_d must be"),
    ({"tail_mode": 3}, "tail_mode must be None"), ({"tail_backend": ""}, "tail_backend must be")])
def test_bad_values_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(DEFAULT, **changes)


def test_two_models_in_one_process_take_their_own_config():
    """Each model's layers read their own config: one model on the fast path (CPU: opt-in), the other not, in the
    same process; both give the same logits (the fast path computes the reference forward's function)."""
    a, b = _tiny(), _tiny()
    on = use_inference(a, dataclasses.replace(DEFAULT, prefill="lean"))
    use_inference(b)
    assert inference_config(a) is on and all(inference_config(l.self_attn) is on for l in a.model.layers)
    assert inference_config(b) is DEFAULT and all(inference_config(l.self_attn) is DEFAULT for l in b.model.layers)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la, lb = a(ids, use_cache=False).logits, b(ids, use_cache=False).logits  # (a DynamicCache: the reference)
    assert all(l.self_attn.backends.plan is not None for l in a.model.layers)  # a took the lean backend
    assert not any(l.self_attn.backends.plan is not None for l in b.model.layers)  # b the reference (auto on CPU)
    torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    with pytest.raises(TypeError, match="want an InferenceConfig"):
        use_inference(a, {"prefill": "lean"})
