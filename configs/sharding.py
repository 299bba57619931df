r"""Tensor / data parallelism: the collectives in the compiled step and the bytes they move.

  python -m experiments.sharding --config=configs/sharding.py          # ~5 min on 2 cores
  python -m experiments.sharding --config=configs/sharding.py:smoke    # tiny shapes, ~40 s

For each configuration ``model:tp:dp`` the experiment builds the engine's Runner on a
``[dp, tp]`` mesh of fake CPU devices (``--xla_force_host_platform_device_count=8``), compiles a
decode step (``rows`` rows) and a prefill step (one chunk of ``chunk`` tokens) and reads the
partitioned HLO: every collective, its buffer bytes, and the bytes a ring sends per device
(all-reduce 2(n-1)/n x buffer, all-gather (n-1)/n x output). It also gives the weight bytes
held per device. Each tp > 1 runs with the embedding / LM head split over the vocabulary and
replicated (``embed_modes``), the choice the HLO justifies. No step times: fake CPU devices
share two cores (times need real multi-GPU hardware).
Expected: decode at TP > 1 holds 2 all-reduces of [rows, D] per layer (o_proj, down_proj),
plus with a vocab split 1 all-reduce (embedding) and 1 all-gather of [rows, V] (logits); never
a gather of the KV cache or of a weight matrix. DP adds no collective.
Measured (full, 2026-11-30, ~10 min on 2 shared cores): SmolLM2-135M TP3: 61 all-reduces of
f32[8, 576] + 1 all-gather of f32[8, 49152], 2.4 MiB sent per device per decode step, weights
85.6 MiB / device (121.6 with the vocabulary replicated). Llama-shaped 32/8 heads (4 layers,
D 2048, V 32768, bf16): TP 2 / 4 / 8 send 1.06 / 1.59 / 1.86 MiB per decode step and hold 360 /
180 / 90 MiB of weights per device (488 / 372 / 314 replicated). The all-reduces are f32 on
CPU even for bf16 weights (the CPU backend computes bf16 dots in f32).
"""

import ml_collections

# Model shapes: a llmserve preset plus overrides (random weights: only shapes matter here).
MODELS = {
    "tiny-gqa": ("tiny-gqa", {}),  # 4 q / 2 kv heads
    "tiny-9-3": ("tiny-9-3", {}),  # SmolLM2-shaped heads: 9 q / 3 kv
    "tiny-8-8": ("tiny-mha", {"n_heads": 8, "n_kv_heads": 8, "head_dim": 16, "d_model": 128}),
    "smollm2-135m": ("smollm2-135m", {"dtype": "bfloat16"}),
    # Llama-3.2-1B's head layout (32 q / 8 kv heads of 64) on a shorter, narrower stack.
    "llama-32-8": ("smollm2-135m", {"dtype": "bfloat16", "n_layers": 4, "d_model": 2048,
                                    "n_heads": 32, "n_kv_heads": 8, "head_dim": 64,
                                    "ffn_dim": 8192, "vocab_size": 32768,
                                    "tie_embeddings": False}),
}


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default) or "smoke" (alias "runlocal": tiny shapes)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "smoke"):
        raise ValueError(f"sharding config arg {arg!r}: use full or smoke")
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    # model:tp:dp, the head counts of each model allowing its tp (N % tp == 0, and tp divides
    # or is a multiple of K).
    c.configs = ("tiny-gqa:1:1,tiny-gqa:2:1,tiny-9-3:3:1,tiny-8-8:8:1,tiny-gqa:2:2" if smoke
                 else
                 "smollm2-135m:1:1,smollm2-135m:3:1,llama-32-8:1:1,llama-32-8:2:1,"
                 "llama-32-8:4:1,llama-32-8:8:1,llama-32-8:2:2")
    c.embed_modes = "vocab" if smoke else "vocab,replicated"  # tp > 1 runs each
    c.rows = 8  # decode rows
    c.chunk = 32 if smoke else 128  # prefill chunk tokens
    c.page_size = 16
    c.max_model_len = 256 if smoke else 2048
    c.num_pages = 64 if smoke else 256
    c.devices = 8  # fake CPU devices
    return c
