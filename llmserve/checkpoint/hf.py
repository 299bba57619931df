"""Hugging Face checkpoints: ``config.json`` + safetensors (single file or sharded) <-> params.

HF ``nn.Linear`` weights are [out, in]; Flax ``Dense`` kernels are [in, out], so projections are
transposed on the way in and out. Tensor names follow ``LlamaForCausalLM`` (also Mistral, Qwen2).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import jax
import numpy as np

from llmserve.config import ModelConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """HF tensor name -> shape ([out, in] for projections) for this config."""
    d, f, h = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    n, k = cfg.n_heads, cfg.n_kv_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    proj = {"q_proj": (n * h, d), "k_proj": (k * h, d), "v_proj": (k * h, d),
            "o_proj": (d, n * h)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        for name, shape in proj.items():
            shapes[p + f"self_attn.{name}.weight"] = shape
            if cfg.qkv_bias and name != "o_proj":
                shapes[p + f"self_attn.{name}.bias"] = (shape[0],)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
    return shapes


def params_from_hf_state_dict(cfg: ModelConfig, get: Callable[[str], np.ndarray] | Mapping,
                              source: str = "checkpoint") -> dict:
    """Builds the Flax param tree from HF-named tensors.

    ``get`` maps a tensor name to a numpy array (a dict works). A missing tensor or a shape
    mismatch raises ValueError naming ``source`` and the tensor.
    """
    lookup = get.__getitem__ if isinstance(get, Mapping) else get
    dtype = np.dtype(cfg.jnp_dtype)
    shapes = expected_shapes(cfg)

    def fetch(name: str) -> np.ndarray:
        try:
            arr = lookup(name)
        except KeyError as e:
            raise ValueError(f"{source}: missing tensor {name!r}") from e
        arr = np.asarray(arr)
        if tuple(arr.shape) != shapes[name]:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, "
                             f"expected {shapes[name]} for this config")
        return arr.astype(np.float32).astype(dtype)

    params: dict = {
        "embed": {"embedding": fetch("model.embed_tokens.weight")},
        "final_norm": {"scale": fetch("model.norm.weight")},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": fetch("lm_head.weight").T}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        attn = {}
        for name in _ATTN:
            attn[name] = {"kernel": fetch(p + f"self_attn.{name}.weight").T}
            if cfg.qkv_bias and name != "o_proj":
                attn[name]["bias"] = fetch(p + f"self_attn.{name}.bias")
        mlp = {name: {"kernel": fetch(p + f"mlp.{name}.weight").T} for name in _MLP}
        params[f"layers_{i}"] = {
            "attn_norm": {"scale": fetch(p + "input_layernorm.weight")},
            "mlp_norm": {"scale": fetch(p + "post_attention_layernorm.weight")},
            "attn": attn,
            "mlp": mlp,
        }
    return jax.tree_util.tree_map(np.ascontiguousarray, params)


def hf_state_dict_from_params(cfg: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """The inverse of ``params_from_hf_state_dict``: HF-named float32 numpy arrays."""
    def arr(x):
        return np.ascontiguousarray(np.asarray(x, dtype=np.float32))

    out = {"model.embed_tokens.weight": arr(params["embed"]["embedding"]),
           "model.norm.weight": arr(params["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = arr(np.asarray(params["lm_head"]["kernel"]).T)
    for i in range(cfg.n_layers):
        layer, p = params[f"layers_{i}"], f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = arr(layer["attn_norm"]["scale"])
        out[p + "post_attention_layernorm.weight"] = arr(layer["mlp_norm"]["scale"])
        for name in _ATTN:
            out[p + f"self_attn.{name}.weight"] = arr(np.asarray(layer["attn"][name]["kernel"]).T)
            if "bias" in layer["attn"][name]:
                out[p + f"self_attn.{name}.bias"] = arr(layer["attn"][name]["bias"])
        for name in _MLP:
            out[p + f"mlp.{name}.weight"] = arr(np.asarray(layer["mlp"][name]["kernel"]).T)
    return out


def _safetensors_getter(directory: str):
    """A name -> array function over model.safetensors or a sharded index."""
    from safetensors import SafetensorError, safe_open

    index_path = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index_path}: malformed safetensors index ({e})") from e
    elif os.path.exists(single):
        weight_map = None
    else:
        raise ValueError(f"{directory}: no model.safetensors or model.safetensors.index.json")

    handles: dict[str, object] = {}

    def open_file(fname: str):
        if fname not in handles:
            path = os.path.join(directory, fname)
            try:
                handles[fname] = safe_open(path, framework="np")
            except (SafetensorError, OSError, Exception) as e:  # truncated or not safetensors
                raise ValueError(f"{path}: cannot read safetensors file ({e})") from e
        return handles[fname]

    def get(name: str) -> np.ndarray:
        fname = "model.safetensors" if weight_map is None else weight_map.get(name)
        if fname is None:
            raise KeyError(name)
        handle = open_file(fname)
        if name not in handle.keys():
            raise KeyError(name)
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{os.path.join(directory, fname)}: cannot read tensor {name!r} "
                             f"({e})") from e

    return get


def load_hf_dir(directory: str, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Loads (config, params) from a Hugging Face model directory."""
    cfg = ModelConfig.from_hf_config_file(directory)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    params = params_from_hf_state_dict(cfg, _safetensors_getter(directory), source=directory)
    return cfg, params


def save_hf_dir(directory: str, cfg: ModelConfig, params: Mapping,
                tokenizer_files: Mapping[str, str] | None = None) -> None:
    """Writes config.json + model.safetensors that transformers and ``LLM(model=...)`` load.

    ``tokenizer_files`` maps file names (tokenizer.json, tokenizer_config.json) to contents.
    """
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    save_file(hf_state_dict_from_params(cfg, params), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    for name, content in (tokenizer_files or {}).items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(content)
