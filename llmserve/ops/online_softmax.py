"""Shared pieces of every tiled attention: the online softmax, the GQA row layout, Pallas helpers.

Imports nothing of llmserve, so every kernel file (``flash_attention.py``, ``paged_attention.py``)
can use it without a cycle.

The GQA row trick: q [B, T, N, H] is viewed as [B, T, K, G, H] (N = K*G) and laid out per kv
head as query *rows* [B, K, T*G, H], row r = t*G + g holding query token t = r // G of head g of
the group, so one program reads each K/V block of a kv head once for all G heads sharing it.

The online softmax keeps per row a running max m, a running sum l and an output accumulator acc,
all float32; after the last block ``finish(acc, l)`` divides, and a row that saw no key (l = 0)
returns zeros.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Array = jax.Array

# Finite "minus infinity" for the running max: exp(m_prev - m_new) stays well defined even when
# every key seen so far is masked.
M_INIT = -1e30


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def causal_mask(t: int, s: int, q_start: Array, lengths: Array) -> Array:
    """[B, T, S] bool: key s visible to query t (``s <= q_start + t`` and ``s < lengths``)."""
    q_pos = q_start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    k_pos = jnp.arange(s)[None, None, :]
    return (k_pos <= q_pos[:, :, None]) & (k_pos < lengths[:, None, None])


@contextlib.contextmanager
def _quiet():
    """Silences JAX's deprecation warnings about the Pallas Triton backend (jax >= 0.11)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*pallas_call.*", category=DeprecationWarning)
        yield


def triton_compiler_params(num_warps: int, num_stages: int):
    """Triton CompilerParams, passed explicitly so jax >= 0.10 does not pick Mosaic GPU.

    jax 0.10/0.11: ``pallas.triton.CompilerParams``; older: ``pallas.gpu.TritonCompilerParams``.
    """
    with _quiet():
        try:
            from jax.experimental.pallas import triton as pltriton

            return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
        except (ImportError, AttributeError):  # pragma: no cover - old jax
            from jax.experimental.pallas import gpu as plgpu

            return plgpu.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def quiet_pallas_call(*args, **kwargs):
    """pl.pallas_call with JAX's Triton-backend deprecation warning silenced here only."""
    with _quiet():
        return pl.pallas_call(*args, **kwargs)


def to_rows(q: Array, k_heads: int, rows: int) -> Array:
    """q [B, T, N, H] -> [B, K, rows, H] with row r = t*G + g, zero-padded to ``rows``."""
    b, t, n, h = q.shape
    g = n // k_heads
    x = q.reshape(b, t, k_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, k_heads, t * g, h)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))


def from_rows(o: Array, t: int, n: int) -> Array:
    """[B, K, rows, H] -> [B, T, N, H] (drops the padding rows)."""
    b, k_heads, _, h = o.shape
    g = n // k_heads
    o = o[:, :, : t * g].reshape(b, k_heads, t, g, h).transpose(0, 2, 1, 3, 4)
    return o.reshape(b, t, n, h)


def online_softmax_step(q, k, v, mask, carry, scale):
    """One KV block of the online softmax. q [R, H], k/v [C, H], mask [R, C] -> new carry.

    carry = (acc [R, H] f32, m [R] f32, l [R] f32). Plain lax ops so Triton can lower it; both
    dots accumulate in float32 whatever the storage dtype.
    """
    acc, m_prev, l_prev = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(mask, s * scale, -jnp.inf)  # [R, C]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new[:, None])  # masked -> exp(-inf) = 0
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l_new


def finish(acc, l):
    """acc [R, H] / l [R], with rows that saw no key (l = 0) returning zeros."""
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]


__all__ = ["M_INIT", "next_pow2", "causal_mask", "triton_compiler_params", "quiet_pallas_call",
           "to_rows", "from_rows", "online_softmax_step", "finish"]
