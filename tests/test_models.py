import pytest

from headscope.model_specs import ModelSpecError
from headscope.models import load_model


def test_unknown_specs_name_the_fix(tmp_path):
    with pytest.raises(ModelSpecError, match="unknown model spec 'gpt-17'.*smollm2-135m"):
        load_model("gpt-17")
    with pytest.raises(ModelSpecError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelSpecError, match="without config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelSpecError, match="not in the local Hugging Face cache"):
        load_model("someone/not-a-cached-model")


def test_local_directory_round_trip(tiny_dir, tmp_path):
    m = load_model(str(tiny_dir), device="cpu")
    g = m.geometry
    assert (g.n_layers, g.n_heads, g.n_kv_heads, g.d_head) == (2, 4, 2, 16)
    assert g.kv_group == (0, 0, 1, 1)
