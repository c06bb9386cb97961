"""A small-vocabulary tokenizer for tests of tiny random models, built in-process (no download, no file read but
headscope's own sources).

A tiny model built for SmolLM2's tokenizer has a 49,152-row embedding and LM head: with ``d_model`` 64 the head is
~97 % of its multiply-adds per token, and every step of a training test takes a softmax over 49,152 logits. The
tokenizer here is a byte-level BPE (every text encodes, nothing maps to an unknown token) of
:data:`VOCAB_SIZE` tokens trained on the text of ``headscope/tasks/`` (the filler sentences and every task's
wording), with SmolLM2's conventions where the tasks meet them: each digit its own token, ``<|im_start|>`` /
``<|im_end|>`` as BOS / EOS (EOS pads), SmolLM2's chat template. Use it where the test is about the model's
mechanics, not about SmolLM2's vocabulary; the training is deterministic, so the ids are the same in every run.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

VOCAB_SIZE = 2048
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TASKS = Path(__file__).resolve().parents[1] / "headscope" / "tasks"


def _corpus() -> list[str]:
    """The training text: the lines of headscope/tasks/*.py (filler sentences, task wordings), sorted files."""
    return [line for f in sorted(TASKS.glob("*.py")) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]


@lru_cache(maxsize=None)
def small_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A transformers fast tokenizer of ``vocab_size`` tokens (byte-level BPE, see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2], pad_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    return fast
