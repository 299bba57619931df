"""Checkpoints: sharded HF loading, Orbax round trip, and clear errors for malformed inputs."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from llmserve.checkpoint import load_checkpoint, restore_params, save_hf_dir, save_params
from llmserve.config import preset
from llmserve.model import init_params


@pytest.fixture()
def hf_dir(hf_dir_factory, tmp_path):
    d, _ = hf_dir_factory("llama", 4, 2)
    out = tmp_path / "model"
    shutil.copytree(d, out)
    return str(out)


def test_orbax_round_trip_is_bit_exact(tmp_path):
    cfg = preset("tiny-9-3")
    params = init_params(cfg, seed=4)
    save_params(str(tmp_path / "ckpt"), params)
    back = restore_params(str(tmp_path / "ckpt"))
    flat_a = jax.tree_util.tree_leaves_with_path(params)
    flat_b = dict(jax.tree_util.tree_leaves_with_path(back))
    assert len(flat_a) == len(flat_b)
    for path, leaf in flat_a:
        got = np.asarray(flat_b[path])
        assert got.dtype == np.asarray(leaf).dtype
        assert np.array_equal(got, np.asarray(leaf))  # bit-exact


def test_sharded_hf_checkpoint_loads(hf_dir_factory, tmp_path):
    _, model = hf_dir_factory("llama", 4, 2)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    cfg, params = load_checkpoint(str(tmp_path / "sharded"))
    _, ref = load_checkpoint(hf_dir_factory("llama", 4, 2)[0])
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref)):
        assert np.array_equal(a, b)


def test_save_hf_dir_round_trip(tmp_path):
    cfg = preset("tiny-gqa").replace(eos_token_id=1, bos_token_id=0)
    params = init_params(cfg, seed=8)
    save_hf_dir(str(tmp_path / "out"), cfg, params)
    cfg2, back = load_checkpoint(str(tmp_path / "out"))
    assert cfg2.n_kv_heads == cfg.n_kv_heads and cfg2.vocab_size == cfg.vocab_size
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        assert np.array_equal(np.asarray(a), b)


def test_missing_tensor_is_named(hf_dir):
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(hf_dir)


def test_shape_mismatch_is_named(hf_dir):
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*shape \(3, 64\)"):
        load_checkpoint(hf_dir)


def test_truncated_safetensors_is_named(hf_dir):
    path = os.path.join(hf_dir, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(hf_dir)


def test_unsupported_architecture_and_bad_config(hf_dir):
    cfg_path = os.path.join(hf_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["model_type"] = "gpt_neox"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt_neox'"):
        load_checkpoint(hf_dir)
    with open(cfg_path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        load_checkpoint(hf_dir)


def test_missing_paths(tmp_path):
    with pytest.raises(ValueError, match="no such checkpoint"):
        load_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json not found"):
        load_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no Orbax checkpoint"):
        restore_params(str(tmp_path / "nothing"))
