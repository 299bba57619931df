"""Flash attention for prefill: a Pallas (Triton) kernel and a memory-lean XLA path.

Layout and the GQA row trick
----------------------------
q [B, T, N, H] is viewed as [B, T, K, G, H] (N = K*G) and laid out per kv head as query *rows*
[B, K, T*G, H], row r = t*G + g holding query token t = r // G of head g of the group. One
program of the kernel owns one (sequence b, kv head k, block of ``block_q`` rows): it reads each
K/V block of head k once and multiplies it against all G query heads that share it, so K/V are
never repeated in memory and GQA costs no extra K/V traffic. Because rows run over (t, g) pairs,
G need not be a power of two (SmolLM2: G = 3) while the row block, as Triton requires, is.

Masking: row r sits at position ``q_start[b] + r // G`` and sees keys ``s <= pos`` with
``s < lengths[b]``. KV blocks past ``min(q_start + last row's token + 1, lengths)`` are fully masked
and not visited at all (the loop bound is computed per program). The softmax is online
(running max m, sum l, output acc in float32); a row that sees no key ends with l = 0 and
returns zeros.

T and S are padded to block multiples inside the wrapper, so any T and S work.

``flash_attention_xla`` is the same algorithm in plain XLA for CPU serving: small score matrices
go through one einsum; large ones are chunked over queries (``lax.map``) and keys (a while loop
that stops at the causal bound), so temp memory stays O(chunk^2) instead of O(T*S).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from llmserve.ops.online_softmax import (
    M_INIT,
    causal_mask,
    finish,
    from_rows,
    next_pow2,
    online_softmax_step,
    quiet_pallas_call,
    to_rows,
    triton_compiler_params,
)

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Pallas kernel


def _flash_kernel(q_start_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, *,
                  groups: int, block_k: int, scale: float):
    # q_start_ref: [1] int32          (this sequence's first query position)
    # lengths_ref: [1] int32          (this sequence's valid kv length, clamped to S)
    # q_ref:       [block_q, H]       (query rows r = t*G + g of kv head k)
    # k_ref/v_ref: [S_pad, H]         (all keys/values of kv head k of sequence b)
    # o_ref:       [block_q, H]
    block_q, h = q_ref.shape
    i = pl.program_id(2)
    q_start = q_start_ref[0]
    length = lengths_ref[0]
    rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)  # [block_q]
    q_pos = q_start + lax.div(rows, jnp.int32(groups))  # [block_q]
    # Last key any row of this block may see: keys past it are in fully masked blocks.
    last_pos = q_start + lax.div(i * block_q + block_q - 1, groups)
    kv_end = jnp.minimum(last_pos + 1, length)
    num_kv_blocks = lax.div(kv_end + block_k - 1, block_k)

    q = q_ref[...]

    def body(j, carry):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < length)
        return online_softmax_step(q, k, v, mask, carry, scale)

    carry = (jnp.zeros((block_q, h), jnp.float32),
             jnp.full((block_q,), M_INIT, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, _, l = lax.fori_loop(0, num_kv_blocks, body, carry)
    o_ref[...] = finish(acc, l).astype(o_ref.dtype)


def _check_shapes(q: Array, k: Array, v: Array, q_start: Array, lengths: Array):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"want q [B,T,N,H], k/v [B,S,K,H]; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    b, _, n, h = q.shape
    if k.shape[0] != b or k.shape[3] != h or n % k.shape[2]:
        raise ValueError(f"q {q.shape} does not match k/v {k.shape}: need equal B and H and "
                         f"N divisible by K")
    if q_start.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"q_start {q_start.shape} and lengths {lengths.shape} must be [B={b}]")


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "interpret", "num_warps",
                                             "num_stages"))
def flash_attention(q: Array, k: Array, v: Array, q_start: Array, lengths: Array, *,
                    block_q: int = 64, block_k: int = 64, interpret: bool = False,
                    num_warps: int = 4, num_stages: int = 2) -> Array:
    """Causal GQA flash attention, q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H].

    block_q: query rows per program, counted over (token, head-in-group) pairs (a power of
    two >= 16; it covers block_q / G tokens). block_k: keys per inner step (power of two >= 16).
    q_start/lengths [B] int32 as in ``llmserve.ops.attention``.
    """
    _check_shapes(q, k, v, q_start, lengths)
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name}={blk} must be a power of two >= 16 (Triton dot)")
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    rows = pl.cdiv(t * g, block_q) * block_q
    s_pad = pl.cdiv(s, block_k) * block_k
    qr = to_rows(q, kh, rows)  # [B, K, rows, H]
    k = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    lengths = jnp.minimum(lengths.astype(jnp.int32), s)
    kernel = functools.partial(_flash_kernel, groups=g, block_k=block_k, scale=1.0 / math.sqrt(h))
    out = quiet_pallas_call(
        kernel,
        grid=(b, kh, rows // block_q),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, ki, i: (bi,)),  # q_start
            pl.BlockSpec((1,), lambda bi, ki, i: (bi,)),  # lengths
            pl.BlockSpec((None, None, block_q, h), lambda bi, ki, i: (bi, ki, i, 0)),  # q rows
            pl.BlockSpec((None, s_pad, None, h), lambda bi, ki, i: (bi, 0, ki, 0)),  # k
            pl.BlockSpec((None, s_pad, None, h), lambda bi, ki, i: (bi, 0, ki, 0)),  # v
        ],
        out_specs=pl.BlockSpec((None, None, block_q, h), lambda bi, ki, i: (bi, ki, i, 0)),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="llmserve_flash_attention",
    )(q_start.astype(jnp.int32), lengths, qr, k, v)
    return from_rows(out, t, n)


# ----------------------------------------------------------------------------------------------
# Memory-lean XLA path (CPU serving)

# Score matrices up to this size go through one einsum (fast for decode and short prefill).
DIRECT_SCORE_BYTES = 64 << 20


def _direct(q: Array, k: Array, v: Array, q_start: Array, lengths: Array) -> Array:
    """Einsum attention without repeating K/V; scores [B, K, G, T, S] in float32."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    q_pos = q_start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    k_pos = jnp.arange(s)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos < lengths[:, None, None])
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    scores = jnp.where(mask, scores * (1.0 / math.sqrt(h)), -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))  # masked -> 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def _chunked(q: Array, k: Array, v: Array, q_start: Array, lengths: Array, *,
             chunk_q: int, chunk_k: int) -> Array:
    """Online-softmax attention over [chunk_q x chunk_k] tiles; causal tiles past the bound are
    skipped by a while loop. Temp memory ~ B*N*chunk_q*chunk_k floats plus padded copies."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    t_pad = pl.cdiv(t, chunk_q) * chunk_q
    s_pad = pl.cdiv(s, chunk_k) * chunk_k
    scale = 1.0 / math.sqrt(h)
    qg = jnp.pad(q.reshape(b, t, kh, g, h), ((0, 0), (0, t_pad - t), (0, 0), (0, 0), (0, 0)))
    qg = qg.reshape(b, t_pad // chunk_q, chunk_q, kh, g, h).transpose(1, 0, 3, 4, 2, 5)
    kp = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))

    def one_q_chunk(args):
        qc, i = args  # qc [B, K, G, cq, H]
        q_pos = q_start[:, None] + i * chunk_q + jnp.arange(chunk_q)[None, :]  # [B, cq]
        kv_end = jnp.max(jnp.minimum(q_pos[:, -1] + 1, lengths))
        n_blocks = (kv_end + chunk_k - 1) // chunk_k

        def body(j, carry):
            acc, m_prev, l_prev = carry
            kc = lax.dynamic_slice_in_dim(kp, j * chunk_k, chunk_k, axis=1)  # [B, ck, K, H]
            vc = lax.dynamic_slice_in_dim(vp, j * chunk_k, chunk_k, axis=1)
            sc = jnp.einsum("BKGTH,BSKH->BKGTS", qc, kc, preferred_element_type=jnp.float32)
            k_pos = j * chunk_k + jnp.arange(chunk_k)
            mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
                k_pos[None, None, :] < lengths[:, None, None])
            sc = jnp.where(mask[:, None, None], sc * scale, -jnp.inf)
            m_new = jnp.maximum(m_prev, jnp.max(sc, axis=-1))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(sc - m_new[..., None])
            l_new = alpha * l_prev + jnp.sum(p, axis=-1)
            pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(vc.dtype), vc,
                            preferred_element_type=jnp.float32)
            return acc * alpha[..., None] + pv, m_new, l_new

        shape = (b, kh, g, chunk_q)
        carry = (jnp.zeros(shape + (h,), jnp.float32), jnp.full(shape, M_INIT, jnp.float32),
                 jnp.zeros(shape, jnp.float32))
        acc, _, l = lax.fori_loop(0, n_blocks, body, carry)
        return (acc / jnp.where(l == 0.0, 1.0, l)[..., None]).astype(q.dtype)

    out = lax.map(one_q_chunk, (qg, jnp.arange(t_pad // chunk_q)))  # [nq, B, K, G, cq, H]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, t_pad, n, h)
    return out[:, :t]


def flash_attention_xla(q: Array, k: Array, v: Array, q_start: Array, lengths: Array, *,
                        chunk_q: int = 512, chunk_k: int = 512,
                        direct_score_bytes: int = DIRECT_SCORE_BYTES) -> Array:
    """Causal GQA attention in plain XLA for CPU serving; same semantics as the kernel.

    Uses one einsum when the float32 score matrix B*N*T*S fits in ``direct_score_bytes``
    (decode, short prefill), else query/key chunks with an online softmax.
    """
    _check_shapes(q, k, v, q_start, lengths)
    b, t, n, _ = q.shape
    s = k.shape[1]
    q_start = q_start.astype(jnp.int32)
    lengths = jnp.minimum(lengths.astype(jnp.int32), s)
    if 4 * b * n * t * s <= direct_score_bytes:
        return _direct(q, k, v, q_start, lengths)
    return _chunked(q, k, v, q_start, lengths, chunk_q=min(chunk_q, next_pow2(t)),
                    chunk_k=min(chunk_k, next_pow2(s)))


# ----------------------------------------------------------------------------------------------
# Reference (the oracle)


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


# The name the kernel tests use for this file's oracle.
flash_attention_reference = attention_reference

__all__ = ["flash_attention", "flash_attention_xla", "attention_reference",
           "flash_attention_reference"]
