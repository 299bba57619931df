"""Attention: the dispatcher over backends (the kernels and their references live in the kernel
files; this module only chooses).

Backends:
  "reference": plain jnp, materializes the scores (the oracle).
  "xla":       memory-lean XLA paths (gather + batched matmuls), any platform.
  "cpu":       CPU serving: paged attention (decode, verify, prefill chunks, batch-invariant
               per-token queries) runs the native C++ kernel (``cpu_kernels``: pages read in
               place, near the memory roof for decode); contiguous attention and pages of more
               than 64 tokens take the "xla" paths.
  "pallas":    the Pallas kernels (Triton on GPU); "pallas_interpret" runs them in interpret mode.

Semantics shared by every backend: query t of sequence b sits at position ``q_start[b] + t`` and
sees keys at positions ``s <= q_start[b] + t`` and ``s < lengths[b]``. A query that sees no key
returns zeros. K/V heads are shared by G = N / K query heads and never repeated in memory.
"""

from __future__ import annotations

import functools
import logging

import jax

from llmserve.ops import cpu_kernels as cpu_paged
from llmserve.ops import flash_attention
from llmserve.ops import paged_attention as paged
from llmserve.ops.flash_attention import attention_reference
from llmserve.ops.online_softmax import causal_mask
from llmserve.ops.paged_attention import gather_pages, paged_attention_reference

Array = jax.Array
logger = logging.getLogger("llmserve")

BACKENDS = ("reference", "xla", "cpu", "pallas", "pallas_interpret")

# The "cpu" backend sends every paged call with pages of at most 64 tokens to the native kernel,
# whatever its query rows. Until 2026-12-08 calls with more than 32 rows per kv head (T * G:
# prefill chunks of 11+ tokens at SmolLM2's G = 3) took the XLA path, measured 1.4-2x faster
# there by an early version of the kernel. Since its AVX-512 row groups, pages outer (AMD Zen 4,
# SmolLM2 heads, 30 chained calls, `/tmp` script, XLA / native): bf16 1.9x at 1 x 16 tokens,
# 2.4-2.7x at 1 x 64-128, 2.1x at 4 x 128, 1.6x at 1 x 128 after 384 cached tokens; float32
# 1.5-2.5x. One kernel for every part also keeps a token's bits independent of how its prompt
# was chunked.


def check_backend(backend: str) -> str:
    """Returns backend if known, else raises ValueError listing the known ones."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {BACKENDS}")
    return backend


def default_backend() -> str:
    """"pallas" on GPU; on CPU "cpu" when its native kernel builds here, else "xla" (logged)."""
    platform = jax.default_backend()
    if platform == "gpu":
        return "pallas"
    if platform == "cpu":
        reason = cpu_paged.unavailable_reason()
        if reason is None:
            return "cpu"
        _log_fallback(reason)
    return "xla"


@functools.lru_cache(maxsize=None)
def _log_fallback(reason: str) -> None:
    logger.warning("native CPU paged attention unavailable (%s): using the XLA path, several "
                   "times slower at decode", reason)


def attention(q: Array, k: Array, v: Array, q_start: Array, lengths: Array, *,
              backend: str = "xla") -> Array:
    """Contiguous attention (prefill, reference generate) through the chosen backend."""
    check_backend(backend)
    if backend == "reference":
        return attention_reference(q, k, v, q_start, lengths)
    if backend in ("xla", "cpu"):
        return flash_attention.flash_attention_xla(q, k, v, q_start, lengths)
    return flash_attention.flash_attention(q, k, v, q_start, lengths,
                                           interpret=backend == "pallas_interpret")


def paged_attention(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                    q_start: Array, lengths: Array, *, backend: str = "xla") -> Array:
    """Paged attention with T >= 1 queries per sequence through the chosen backend.

    k_pages/v_pages [K, P, L, H] hold q's dtype, or uint16 bit patterns of bfloat16 (how the CPU
    cache stores bf16 pages; see ``llmserve.kv_cache.page_storage_dtype``).
    """
    check_backend(backend)
    if backend == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, q_start, lengths)
    if backend == "cpu" and k_pages.shape[2] <= cpu_paged.MAX_PAGE_SIZE:
        return cpu_paged.paged_attention_cpu(q, k_pages, v_pages, block_tables, q_start, lengths)
    if backend in ("xla", "cpu"):
        return paged.paged_attention_xla(q, k_pages, v_pages, block_tables, q_start, lengths)
    # The kernel reads typed pages: uint16-stored bf16 pages (CPU caches) are reinterpreted.
    k_pages, v_pages = paged.as_logical(k_pages), paged.as_logical(v_pages)
    return paged.paged_attention(q, k_pages, v_pages, block_tables, q_start, lengths,
                                 interpret=backend == "pallas_interpret")


# Re-exported for callers that import the oracles through the dispatcher.
__all__ = ["BACKENDS", "check_backend", "default_backend", "attention",
           "paged_attention", "attention_reference", "paged_attention_reference", "gather_pages",
           "causal_mask"]
