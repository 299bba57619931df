"""Train a byte-level BPE tokenizer with the `tokenizers` library (for models trained here)."""

from __future__ import annotations

from typing import Iterable, Sequence

from llmserve.tokenizer import Tokenizer

# A minimal ChatML template, so LLM.chat works on models trained from scratch.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int,
                        special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
                        min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts``; the first special token is bos/eos.

    Special tokens get the lowest ids (0, 1, ...); all 256 bytes are in the alphabet, so any
    text encodes. Returns an llmserve ``Tokenizer`` (save with ``.files()``).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eos = special_tokens[0] if special_tokens else None
    template = CHATML_TEMPLATE if {"<|im_start|>", "<|im_end|>"} <= set(special_tokens) else None
    return Tokenizer(tok, bos_token=eos, eos_token=eos, chat_template=template)
