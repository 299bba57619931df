r"""GQA vs MHA vs MQA: KV bytes per token, requests that fit a KV budget, decode speed.

  python -m experiments.gqa --config=configs/gqa.py          # SmolLM2 shape, ~2 min on 2 cores
  python -m experiments.gqa --config=configs/gqa.py:smoke    # tiny shape, ~20 s

Variants of one shape that differ only in the number of K/V heads (``kv_heads``): SmolLM2-135M's
(30 layers, 9 query heads of 64, so MHA = 9, its own GQA = 3, MQA = 1), with RANDOM weights:
speed and memory do not depend on the values. For each variant:
  * KV bytes per token, measured on an allocated paged cache (and checked against
    2 * layers * kv_heads * head_dim * itemsize);
  * requests of ``fit_context`` tokens that the real block manager admits into a KV budget of
    ``kv_budget_mib`` (EngineConfig.kv_cache_memory sizing);
  * decode tokens/s of one jitted engine step with ``batch`` rows at context ``context``
    (interleaved over variants, ``repeats`` times, each the median of ``iters`` steps).
Measured (full, fp32, 2 shared CPU cores, 2026-11-30, ~2 min): 135 / 45 / 15 KiB per token
(MHA / GQA-3 / MQA: 3x and 9x smaller), so 1 GiB holds 3 / 11 / 34 requests of 2048 tokens;
decode at B=8, context 1024: 42 / 64 / 109 tok/s (1.5x and 2.6x MHA: attention reads less K/V).
"""

import ml_collections


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default) or "smoke" (alias "runlocal": a tiny 9-head shape)."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "smoke"):
        raise ValueError(f"gqa config arg {arg!r}: use full or smoke")
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.base = "tiny-9-3" if smoke else "smollm2-135m"  # a llmserve.config preset
    c.kv_heads = "9,3,1"  # MHA, GQA, MQA for 9 query heads
    c.dtype = "float32"
    c.kv_budget_mib = 1 if smoke else 1024
    c.fit_context = 256 if smoke else 2048  # tokens per request for the fit count
    c.context = 64 if smoke else 1024  # decode context length
    c.batch = 4 if smoke else 8
    c.page_size = 16
    c.repeats = 3
    c.iters = 3 if smoke else 5
    c.backend = ""  # "" = the platform's default
    return c
