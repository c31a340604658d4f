"""A small byte-level BPE tokenizer trained offline on a built-in corpus, with a ChatML chat template."""

from __future__ import annotations

import functools
import itertools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a model learns to answer questions about numbers and words quickly while training on small "
    "data sets with gradients losses tokens kernels memory speed what is plus minus times equals "
    "answer question user assistant system you are helpful please think step by step"
).split()


def _corpus() -> list[str]:
    """Deterministic text: arithmetic questions and answers plus sentences of a small vocabulary."""
    lines = [
        f"What is {a} {word} {b}? The answer is {result}."
        for a, b in itertools.product(range(0, 40, 3), range(1, 40, 4))
        for word, result in (("plus", a + b), ("minus", a - b), ("times", a * b))
    ]
    lines += [" ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(12)) for i in range(200)]
    return lines


@functools.cache
def _trained_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # A small corpus may run out of merges before vocab_size: reserved tokens fill the rest, so the
    # vocabulary is exactly vocab_size (as models' embedding tables expect).
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tokenizer.to_str()


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A fresh ``PreTrainedTokenizerFast`` (byte-level BPE: any text encodes) with pad/bos/eos tokens
    and a ChatML chat template. ``vocab_size`` must leave room for the 256 byte symbols."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_json(vocab_size)),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
