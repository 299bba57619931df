"""Attention: the plain-jnp reference and the dispatcher over backends.

Backends:
  "reference": plain jnp, materializes the scores (the oracle).
  "xla":       memory-lean XLA paths for CPU serving.
  "pallas":    the Pallas kernels (Triton on GPU); "pallas_interpret" runs them in interpret mode.

Semantics shared by every backend: query t of sequence b sits at position ``q_start[b] + t`` and
sees keys at positions ``s <= q_start[b] + t`` and ``s < lengths[b]``. A query that sees no key
returns zeros. K/V heads are shared by G = N / K query heads and never repeated in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

BACKENDS = ("reference", "xla", "pallas", "pallas_interpret")


def check_backend(backend: str) -> str:
    """Returns backend if known, else raises ValueError listing the known ones."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {BACKENDS}")
    return backend


def default_backend() -> str:
    """"pallas" on GPU, "xla" elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def causal_mask(t: int, s: int, q_start: Array, lengths: Array) -> Array:
    """[B, T, S] bool: key s visible to query t."""
    q_pos = q_start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    k_pos = jnp.arange(s)[None, None, :]
    return (k_pos <= q_pos[:, :, None]) & (k_pos < lengths[:, None, None])


def attention_reference(q: Array, k: Array, v: Array, q_start: Array, lengths: Array) -> Array:
    """q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H]; float32 softmax, scores materialized."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h).astype(jnp.float32)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) / jnp.sqrt(h)
    mask = causal_mask(t, k.shape[1], q_start, lengths)[:, None, None]  # [B,1,1,T,S]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def gather_pages(pages: Array, block_tables: Array) -> Array:
    """pages [K, P, L, H], block_tables [B, M] -> contiguous [B, M*L, K, H]."""
    kh, _, size, h = pages.shape
    b, m = block_tables.shape
    g = pages[:, block_tables]  # [K, B, M, L, H]
    return jnp.moveaxis(g, 0, 3).reshape(b, m * size, kh, h)


def paged_attention_reference(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                              q_start: Array, lengths: Array) -> Array:
    """q [B, T, N, H] over paged K/V [K, P, L, H] through block_tables [B, M] -> [B, T, N, H]."""
    k = gather_pages(k_pages, block_tables)
    v = gather_pages(v_pages, block_tables)
    return attention_reference(q, k, v, q_start, lengths)


def attention(q: Array, k: Array, v: Array, q_start: Array, lengths: Array, *,
              backend: str = "xla") -> Array:
    """Contiguous attention (prefill, reference generate) through the chosen backend."""
    check_backend(backend)
    if backend == "reference":
        return attention_reference(q, k, v, q_start, lengths)
    from llmserve.ops import flash_attention

    if backend == "xla":
        return flash_attention.flash_attention_xla(q, k, v, q_start, lengths)
    return flash_attention.flash_attention(q, k, v, q_start, lengths,
                                           interpret=backend == "pallas_interpret")


def paged_attention(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                    q_start: Array, lengths: Array, *, backend: str = "xla") -> Array:
    """Paged attention with T >= 1 queries per sequence through the chosen backend."""
    check_backend(backend)
    if backend == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, q_start, lengths)
    from llmserve.ops import paged_attention as paged

    if backend == "xla":
        return paged.paged_attention_xla(q, k_pages, v_pages, block_tables, q_start, lengths)
    return paged.paged_attention(q, k_pages, v_pages, block_tables, q_start, lengths,
                                 interpret=backend == "pallas_interpret")
