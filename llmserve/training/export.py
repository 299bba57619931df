"""Save a trained model as an Orbax param tree and a Hugging Face directory LLM() loads."""

from __future__ import annotations

import os
import shutil
from typing import Optional

import jax
import numpy as np

from llmserve.checkpoint import save_hf_dir, save_params
from llmserve.config import ModelConfig


def save_model(out_dir: str, cfg: ModelConfig, params, tokenizer=None,
               orbax_dir: Optional[str] = None) -> dict:
    """Writes ``out_dir`` (config.json, model.safetensors, tokenizer files if a tokenizer is
    given) and the Orbax params at ``orbax_dir`` (default ``out_dir + "_orbax"``); both are
    replaced if they exist. Returns {"hf_dir", "orbax_dir"}."""
    params = jax.tree_util.tree_map(np.asarray, jax.device_get(params))
    orbax_dir = orbax_dir or out_dir.rstrip("/") + "_orbax"
    for d in (out_dir, orbax_dir):
        if os.path.isdir(d):
            shutil.rmtree(d)
    files = tokenizer.files() if tokenizer is not None else None
    save_hf_dir(out_dir, cfg, params, tokenizer_files=files)
    save_params(orbax_dir, params)
    return {"hf_dir": os.path.abspath(out_dir), "orbax_dir": os.path.abspath(orbax_dir)}
