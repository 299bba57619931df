"""Model and engine configuration.

`ModelConfig` describes a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2). It is
built from a Hugging Face ``config.json``, from GGUF metadata, or from a named preset.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any, Mapping, Optional

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
}


_log = logging.getLogger(__name__)

# /proc/cpuinfo flags of CPUs with native bf16 dot products (Zen 4+, Cooper Lake, Sapphire Rapids).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises native bf16 matmul (avx512_bf16 or amx_bf16 in its flags).

    On such CPUs XLA's bf16 matmul with float32 accumulation beats float32 from 8 rows up
    (experiments/matmul.py). Without the flags bf16 is emulated and slower. Non-Linux: False.
    """
    return bool(cpu_flags(cpuinfo) & set(BF16_CPU_FLAGS))


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags /proc/cpuinfo lists (empty where it cannot be read: non-Linux)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return flags


@functools.lru_cache(maxsize=None)
def auto_dtype(platform: Optional[str] = None) -> str:
    """The dtype ``dtype="auto"`` means on ``platform`` (default: jax's default backend).

    "bfloat16" on GPU/TPU and on CPUs with native bf16 matmul, else "float32". Logs the pick
    (once per platform).
    """
    if platform is None:
        import jax

        platform = jax.default_backend()
    platform = platform.lower()
    if platform in ("gpu", "cuda", "rocm", "tpu"):
        name, why = "bfloat16", f"{platform} has native bf16 matmul"
    elif platform == "cpu" and cpu_has_bf16_matmul():
        name, why = "bfloat16", "this CPU has avx512_bf16/amx_bf16"
    elif platform == "cpu":
        name, why = "float32", "this CPU has no native bf16 matmul (bf16 would be emulated)"
    else:
        name, why = "float32", f"unknown platform {platform!r}"
    _log.info("dtype='auto' -> %s (%s)", name, why)
    return name


def resolve_dtype(dtype: Any, platform: Optional[str] = None) -> Any:
    """Maps "float32"/"bfloat16"/"auto"/... or a dtype to a jnp dtype; raises a clear ValueError.

    "auto" resolves through ``auto_dtype(platform)``.
    """
    if isinstance(dtype, str):
        key = dtype.lower().replace("torch.", "")
        if key == "auto":
            key = auto_dtype(platform)
        if key not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of "
                             f"{sorted(_DTYPES) + ['auto']}")
        return _DTYPES[key]
    return jnp.dtype(dtype).type


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style rope scaling ("llama3"), or linear position interpolation ("linear")."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. N = n_heads query heads share K = n_kv_heads kv heads."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # "auto" is resolved to a concrete name at construction
    model_type: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    extra_eos_token_ids: tuple = ()  # config.json may list several EOS ids; these follow the first
    sliding_window: Optional[int] = None  # Mistral-style local attention span (None = global)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads}")
        if isinstance(self.dtype, str) and self.dtype.lower() == "auto":
            object.__setattr__(self, "dtype", auto_dtype())
        resolve_dtype(self.dtype)

    @property
    def eos_token_ids(self) -> tuple:
        """Every EOS id of the model: ``eos_token_id`` first, then the extra ones."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + tuple(t for t in self.extra_eos_token_ids if t != self.eos_token_id)

    @property
    def group_size(self) -> int:
        """G: query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def jnp_dtype(self):
        return resolve_dtype(self.dtype)

    def replace(self, **kwargs) -> "ModelConfig":
        return dataclasses.replace(self, **kwargs)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, h = self.d_model, self.ffn_dim, self.head_dim
        attn = d * h * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.qkv_bias:
            attn += h * (self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * per_layer + d + head

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Builds a config from a Hugging Face config dict (llama, mistral, qwen2)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported architecture model_type={model_type!r}; "
                f"supported: {SUPPORTED_MODEL_TYPES}")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size"):
            if key not in cfg:
                raise ValueError(f"{source}: missing required field {key!r}")
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        # transformers 5 moved rope settings under "rope_parameters".
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope_params
        rope_scaling = _rope_scaling_from_dict(scaling, source)
        eos = cfg.get("eos_token_id")
        eos_list = [int(e) for e in eos] if isinstance(eos, list) else []
        if isinstance(eos, list):
            eos = eos_list[0] if eos_list else None
        window = cfg.get("sliding_window")
        if not cfg.get("use_sliding_window", True) or model_type == "llama":
            window = None  # Qwen2 ships a window it does not use; Llama has none
        torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            vocab_size=cfg["vocab_size"],
            d_model=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            ffn_dim=cfg["intermediate_size"],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            dtype="float32" if torch_dtype not in _DTYPES else torch_dtype,
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            extra_eos_token_ids=tuple(eos_list[1:]),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_hf_config_file(cls, path: str) -> "ModelConfig":
        """Reads a Hugging Face ``config.json`` (a file or a directory holding it)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except FileNotFoundError as e:
            raise ValueError(f"{path}: config.json not found") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON ({e})") from e
        return cls.from_hf_dict(cfg, source=path)

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` for this model (LlamaForCausalLM and friends)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if self.extra_eos_token_ids
                             else self.eos_token_id),
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
        if self.rope_scaling is not None:
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return out


def _rope_scaling_from_dict(d: Optional[Mapping[str, Any]], source: str) -> Optional[RopeScaling]:
    if not d:
        return None
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(d["factor"]),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(d["factor"]))
    raise ValueError(f"{source}: unsupported rope scaling type {rope_type!r}")


# Small named presets: tests and toy experiments. "smollm2-135m" is the real default model.
PRESETS: dict[str, ModelConfig] = {
    "tiny-gqa": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=16, ffn_dim=128, rope_theta=10000.0, norm_eps=1e-5),
    "tiny-mqa": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1,
                            head_dim=16, ffn_dim=128, tie_embeddings=True),
    "tiny-mha": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                            head_dim=16, ffn_dim=128),
    "tiny-9-3": ModelConfig(vocab_size=320, d_model=72, n_layers=2, n_heads=9, n_kv_heads=3,
                            head_dim=8, ffn_dim=96, tie_embeddings=True, rope_theta=100000.0),
    "smollm2-135m": ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, ffn_dim=1536, rope_theta=100000.0,
                                norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=8192,
                                bos_token_id=1, eos_token_id=2),
}


def preset(name: str) -> ModelConfig:
    """A named preset config; raises ValueError listing the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]
