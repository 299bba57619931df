r"""Attention kernels: compiled memory on CPU, speed on GPU.

  python -m experiments.kernels --config=configs/kernels.py          # CPU ~20 s; GPU ~3 min
  python -m experiments.kernels --config=configs/kernels.py:smoke    # ~15 s
  python -m experiments.kernels --config=configs/kernels.py --config.heads=32,8,128  # Llama-3-8B

CPU: the compiled temp (scratch) memory of naive attention (``attention_reference``, which
materializes the T x T scores) vs our XLA flash path (``flash_attention_xla``: query/key chunks
with an online softmax) at ``memory_tokens``, and wall times of the XLA serving paths.
On CPU flash attention is measured as MEMORY, not speed: there is no fast on-chip memory to win.
Expected (N=9, K=3, H=64, float32): at 16k tokens ~18 GiB naive vs ~84 MiB ours (~220x).

GPU (bfloat16): prefill (causal, B=1) ours (Pallas/Triton flash) vs jax.nn.dot_product_attention
(xla, cudnn) vs jax's Pallas ``mha`` when that (deprecated) import exists; paged decode (T=1)
ours vs jax's Pallas paged_attention; milliseconds, TFLOP/s and GB/s (decode is bandwidth bound).
"""

import ml_collections


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default) or "smoke" (alias "runlocal": small sizes, few iterations)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "smoke"):
        raise ValueError(f"kernels config arg {arg!r}: use full or smoke")
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.heads = "9,3,64"  # N,K,H (SmolLM2); "32,8,128" for Llama-3-8B
    c.memory_tokens = "1024,4096" if smoke else "1024,4096,16384"
    c.cpu_prefill_tokens = "8,128" if smoke else "1,8,128,512"
    c.cpu_decode = "4x256" if smoke else "8x1024,32x1024"  # batch x context
    # The native kernel on bf16 query blocks, batch x query tokens x context: decode, verify
    # (1 + R = 5 tokens), 8-token prefill blocks, a 128-token block.
    c.cpu_native_blocks = ("1x5x100" if smoke else
                           "1x1x600,1x5x600,2x5x600,16x1x150,64x8x100,1x128x400")
    c.prefill_tokens = "1024,4096" if smoke else "1024,2048,4096,8192,16384"  # GPU
    c.decode_batch = "8,32" if smoke else "8,16,32,64"  # GPU
    c.decode_context = "1024,4096" if smoke else "1024,2048,4096,8192"  # GPU
    c.page_size = 16
    c.iters = 3 if smoke else 20
    # Decode attention vs the copy-bandwidth roof (CPU): batch x context, pages per loop step.
    c.roof_batch = 8 if smoke else 32
    c.roof_context = 128 if smoke else 512
    c.decode_chunks = "4" if smoke else "4,8"
    c.roof_reps = 1 if smoke else 5
    c.profile = False  # print a per-fusion profile of the decode path
    return c
