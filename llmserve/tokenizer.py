"""Tokenizers: a ``tokenizers.Tokenizer`` from tokenizer.json or rebuilt from GGUF metadata,
the chat template, and streaming detokenization.

A GGUF file carries no tokenizer.json: it stores the vocabulary, the BPE merges, token types
and the pre-tokenizer's name (``tokenizer.ggml.pre``). ``Tokenizer.from_gguf`` rebuilds the
byte-level BPE tokenizer from those, splitting text the way llama.cpp does for that name.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

# GPT-2's split; llama.cpp's "smollm"/"starcoder" first isolate every numeric character
# (SmolLM2's tokenizer.json does the same with a Digits(individual_digits) pre-tokenizer).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")
_SPLIT_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Special tokens that end an assistant turn in common chat formats.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                    "<|end_of_text|>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _token_content(token: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str):
    """A jinja2 template in a sandbox, set up like transformers' chat templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: (
        json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys))
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def check_conversation(messages, where: str = "conversation") -> None:
    """A conversation is a non-empty list of dicts, each with string ``role`` and ``content``."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: a list of messages is needed, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where} is empty: it needs at least one message")
    for m, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise TypeError(f"{where}, message {m}: a message is a dict, got "
                            f"{type(msg).__name__}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                raise ValueError(f"{where}, message {m}: missing or non-string {key!r}")


class Tokenizer:
    """Text <-> token ids, plus the model's chat template and stop tokens.

    Build with ``from_file`` (tokenizer.json), ``from_pretrained_dir`` (an HF model directory) or
    ``from_gguf`` (a GGUF file's metadata).
    """

    def __init__(self, tokenizer, *, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, chat_template: Optional[str] = None,
                 extra_stop_ids: Iterable[int] = ()):
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._extra_stop_ids = tuple(int(i) for i in extra_stop_ids)
        self._template = None

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_file(cls, tokenizer_json_path: str, **kwargs) -> "Tokenizer":
        """Loads a tokenizer.json; ``kwargs`` as in the constructor (bos/eos/chat_template)."""
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(os.fspath(tokenizer_json_path))
        except Exception as e:
            raise ValueError(f"{tokenizer_json_path}: cannot read tokenizer.json ({e})") from e
        return cls(tok, **kwargs)

    @classmethod
    def from_str(cls, tokenizer_json: str, **kwargs) -> "Tokenizer":
        """Builds from tokenizer.json contents."""
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(tokenizer_json), **kwargs)

    @classmethod
    def from_pretrained_dir(cls, directory: str) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (bos/eos, chat template) from a model directory.

        The chat template may also sit in chat_template.jinja / chat_template.json; eos ids
        listed in generation_config.json become extra stop tokens.
        """
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise ValueError(f"{directory}: no tokenizer.json")
        config = _read_json(os.path.join(directory, "tokenizer_config.json")) or {}
        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if template is None:
            template = (_read_json(os.path.join(directory, "chat_template.json")) or {}).get(
                "chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        gen = _read_json(os.path.join(directory, "generation_config.json")) or {}
        stop = gen.get("eos_token_id") or []
        stop = [stop] if isinstance(stop, int) else list(stop)
        return cls.from_file(path, bos_token=_token_content(config.get("bos_token")),
                             eos_token=_token_content(config.get("eos_token")),
                             chat_template=template, extra_stop_ids=stop)

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> "Tokenizer":
        """Rebuilds the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE). Control tokens become
        special added tokens (matched whole, skipped by ``decode``); user-defined tokens become
        plain added tokens.
        """
        from llmserve.checkpoint.gguf import open_gguf

        reader, source = open_gguf(path_or_reader)

        def meta(key, default=None):
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        model = meta("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{source}: unsupported GGUF tokenizer model {model!r} "
                             "(only byte-level BPE, 'gpt2', is supported)")
        tokens = meta("tokenizer.ggml.tokens")
        merges = meta("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{source}: GGUF tokenizer metadata lacks tokens or merges")
        types = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = meta("tokenizer.ggml.pre", "default")

        def token_at(key):
            i = meta(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        tok = _build_byte_level_bpe(tokens, merges, types, pre, source,
                                    bos=token_at("tokenizer.ggml.bos_token_id"),
                                    add_bos=bool(meta("tokenizer.ggml.add_bos_token", False)))
        return cls(tok, bos_token=token_at("tokenizer.ggml.bos_token_id"),
                   eos_token=token_at("tokenizer.ggml.eos_token_id"),
                   chat_template=meta("tokenizer.chat_template"))

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``; special tokens written in the text are matched whole."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False
                     ) -> list[list[int]]:
        """``encode`` over many texts (parallel in the Rust library)."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special_tokens=False``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a token string (in the vocabulary's spelling), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        """Token string (in the vocabulary's spelling) of an id, or None."""
        return self._tok.id_to_token(int(token_id))

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> Optional[int]:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    @property
    def special_token_ids(self) -> list[int]:
        """Ids of the special added tokens (control tokens)."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: eos, generation_config's eos ids, and turn-end tokens."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        ids += self._extra_stop_ids
        special = set(self.special_token_ids)
        for token in _TURN_END_TOKENS:
            i = self._tok.token_to_id(token)
            if i is not None and i in special:
                ids.append(i)
        return list(dict.fromkeys(ids))

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders a conversation with the model's chat template (as transformers does).

        Raises ValueError/TypeError for an empty conversation or a message without a string
        ``role`` and ``content`` (instead of a template error deep inside jinja).
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        check_conversation(messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(kwargs)
        return self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt, **variables)

    # ------------------------------------------------------------------ export
    def to_tokenizer_json(self) -> str:
        """tokenizer.json contents (e.g. for a draft model directory)."""
        return self._tok.to_str()

    def to_tokenizer_config(self) -> dict:
        """A minimal tokenizer_config.json: bos/eos tokens and the chat template."""
        out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.bos_token is not None:
            out["bos_token"] = self.bos_token
        if self.eos_token is not None:
            out["eos_token"] = self.eos_token
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        return out

    def files(self) -> dict[str, str]:
        """File name -> contents for an HF directory (``save_hf_dir(tokenizer_files=...)``)."""
        return {"tokenizer.json": self.to_tokenizer_json(),
                "tokenizer_config.json": json.dumps(self.to_tokenizer_config(), indent=2)}


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON ({e})") from e


def _pre_tokenizer(pre: str, source: str):
    """The pre-tokenizer llama.cpp uses for GGUF ``tokenizer.ggml.pre`` name ``pre``."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = sorted(_GPT2_PRE + _DIGITS_PRE + tuple(_SPLIT_PRE))
    raise ValueError(f"{source}: unsupported GGUF pre-tokenizer {pre!r}; known: {known}")


def _build_byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str,
                          source: str, bos: Optional[str], add_bos: bool):
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocabulary data."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = _bytes_to_unicode()
    printable = set(alphabet.values())

    def spell(token: str) -> str:
        # Tokens are stored in the byte alphabet already; respell any that are not.
        if set(token) <= printable:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(spell(token), i)
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"{source}: malformed BPE merge {m!r}")
        pairs.append((left, right))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre, source)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= printable]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return tok


class IncrementalDetokenizer:
    """Streaming decode: ``add(token_id)`` returns the newly completed text.

    A character split across tokens (multi-byte UTF-8: emoji, CJK) is held back until its last
    byte arrives, so no U+FFFD appears mid-stream. Decoding a short window ``ids[prefix:]``
    and diffing it against ``ids[prefix:read]`` keeps each step O(window) and handles
    decoders that treat the first token specially. ``text + flush()`` equals
    ``tokenizer.decode(added ids)``. ``prompt_ids`` (optional) give the decoder left context,
    e.g. so that a word-initial space after the prompt is rendered as the full decode would.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        # Decode windows start at `prefix`; text of ids[:read] has been emitted.
        self._prefix = max(0, len(self.ids) - 6)
        self._read = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes ("" while a character is partial)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emits whatever is held back (e.g. an incomplete character at the very end)."""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        delta = after[len(before):] if after.startswith(before) else after
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
