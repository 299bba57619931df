"""Paged attention for 1..K+1 new queries per sequence: a Pallas (Triton) kernel and an XLA path.

Layout
------
K/V live in pages ``k_pages/v_pages [K, P, L, H]`` (kv head, page, slot in page, head dim);
``block_tables [B, M]`` lists each sequence's pages in order, so key position s of sequence b is
slot ``s % L`` of page ``block_tables[b, s // L]``.

The kernel's grid is (sequence b, kv head k). The T new queries of the G query heads that share
kv head k form T*G query *rows* (row r = t*G + g, position ``q_start[b] + r // G``), padded to a
power of two >= 16 so Triton's dot has a full tile. This is the GQA row trick: one program reads
each page of head k once and scores all G heads and all T tokens against it, so decode (T = 1),
speculative verify (T = K+1) and chunked prefill share one kernel, and K/V are never repeated.

The pages go in with ``memory_space=pl.ANY``: the kernel gets a reference to the whole pool and
loads only the pages it needs through the block table (interpret mode then does not copy the
pool per grid step). The loop runs over pages ``0 .. cdiv(min(lengths, q_start + T), L)``; keys
are masked causally (``s <= q_start + t``) and by ``s < lengths``.

``paged_attention_xla`` is the CPU serving path: it walks the block table 4 pages at a time
(the loop stops at the longest live sequence), gathers each chunk's pages of every kv head as
whole rows of the pool viewed as [K*P, L*H] (16-bit pages packed two to a uint32: XLA CPU's
gather costs per element), and runs two batched matmuls (storage dtype in, f32 accumulation)
with an online softmax. With static shapes it gathers whole chunks (unused table entries point
at the dummy page) and masks; the kernel instead stops at the last live page.

Pages may also be uint16 bit patterns of bfloat16 (how the CPU cache stores bf16, see
``llmserve.kv_cache.page_storage_dtype``); ``logical_dtype`` / ``as_logical`` read them back.

Measured (experiments/kernels.py, 2-core shared CPU, B=32, context 512, SmolLM2 heads, L=16):
about 7-9x the copy-bandwidth roof in f32 and bf16, against 9-28x before; the gather of K and V
alone costs 2.3-5x the roof, so a gather-based XLA path cannot reach ~1.5x.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from llmserve.ops.flash_attention import attention_reference
from llmserve.ops.online_softmax import (
    M_INIT,
    finish,
    from_rows,
    next_pow2,
    online_softmax_step,
    quiet_pallas_call,
    to_rows,
    triton_compiler_params,
)

Array = jax.Array


def _paged_kernel(q_start_ref, lengths_ref, block_table_ref, q_ref, k_pages_ref, v_pages_ref,
                  o_ref, *, groups: int, num_tokens: int, scale: float):
    # q_start_ref:     [1] int32        (position of this sequence's first new query)
    # lengths_ref:     [1] int32        (valid kv length after this step's tokens)
    # block_table_ref: [M] int32        (this sequence's pages, in order)
    # q_ref:           [R, H]           (rows r = t*G + g of kv head k; R >= 16, power of two)
    # k_pages_ref:     [K, P, L, H]     (whole pool, memory_space=ANY)
    # v_pages_ref:     [K, P, L, H]
    # o_ref:           [R, H]
    rows, h = q_ref.shape
    page_size = k_pages_ref.shape[2]
    kv_head = pl.program_id(1)
    q_start = q_start_ref[0]
    length = lengths_ref[0]
    q_pos = q_start + lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(groups))  # [R]
    kv_end = jnp.minimum(q_start + num_tokens, length)
    num_pages = lax.div(kv_end + page_size - 1, page_size)
    q = q_ref[...]

    def body(j, carry):
        page = block_table_ref[j]
        k = k_pages_ref[kv_head, page, :, :]  # [L, H]
        v = v_pages_ref[kv_head, page, :, :]
        k_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [L]
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < length)
        return online_softmax_step(q, k, v, mask, carry, scale)

    carry = (jnp.zeros((rows, h), jnp.float32),
             jnp.full((rows,), M_INIT, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, _, l = lax.fori_loop(0, num_pages, body, carry)
    o_ref[...] = finish(acc, l).astype(o_ref.dtype)


def check_paged_shapes(q, k_pages, v_pages, block_tables, q_start, lengths):
    """Raises ValueError naming the shapes unless q [B,T,N,H], pages [K,P,L,H] (N divisible by K),
    block_tables [B,M], q_start [B] and lengths [B] agree (every paged backend checks this)."""
    if q.ndim != 4 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"want q [B,T,N,H], pages [K,P,L,H]; got q {q.shape}, "
                         f"k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    b, _, n, h = q.shape
    kh, _, _, hk = k_pages.shape
    if hk != h or n % kh:
        raise ValueError(f"q {q.shape} does not match pages {k_pages.shape}: need equal H and "
                         f"N divisible by K")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables {block_tables.shape} must be [B={b}, M]")
    if q_start.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"q_start {q_start.shape} and lengths {lengths.shape} must be [B={b}]")


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "num_stages"))
def paged_attention(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                    q_start: Array, lengths: Array, *, interpret: bool = False,
                    num_warps: int = 4, num_stages: int = 2) -> Array:
    """Paged GQA attention: q [B, T, N, H] over pages [K, P, L, H] -> [B, T, N, H].

    T is small (1 for decode, K+1 for verify, a chunk for chunked prefill); the T*G rows of a kv
    head are scored in one program. L and H must be powers of two >= 16 (Triton tiles).
    """
    check_paged_shapes(q, k_pages, v_pages, block_tables, q_start, lengths)
    b, t, n, h = q.shape
    kh, _, page_size, _ = k_pages.shape
    for name, val in (("page size L", page_size), ("head dim H", h)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name}={val} must be a power of two >= 16; pages {k_pages.shape}")
    g = n // kh
    rows = max(16, next_pow2(t * g))
    m = block_tables.shape[1]
    qr = to_rows(q, kh, rows)  # [B, K, R, H]
    lengths = jnp.minimum(lengths.astype(jnp.int32), m * page_size)
    kernel = functools.partial(_paged_kernel, groups=g, num_tokens=t, scale=1.0 / math.sqrt(h))
    out = quiet_pallas_call(
        kernel,
        grid=(b, kh),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, ki: (bi,)),  # q_start
            pl.BlockSpec((1,), lambda bi, ki: (bi,)),  # lengths
            pl.BlockSpec((None, m), lambda bi, ki: (bi, 0)),  # block table row
            pl.BlockSpec((None, None, rows, h), lambda bi, ki: (bi, ki, 0, 0)),  # q rows
            pl.BlockSpec(memory_space=pl.ANY),  # k_pages
            pl.BlockSpec(memory_space=pl.ANY),  # v_pages
        ],
        out_specs=pl.BlockSpec((None, None, rows, h), lambda bi, ki: (bi, ki, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="llmserve_paged_attention",
    )(q_start.astype(jnp.int32), lengths, block_tables.astype(jnp.int32), qr, k_pages, v_pages)
    return from_rows(out, t, n)


# Page arrays of this dtype hold bfloat16 bit patterns (the CPU cache stores bf16 pages as uint16:
# see ``llmserve.kv_cache.page_storage_dtype``). Every path here reads them back as bfloat16.
BF16_BITS = jnp.uint16


def logical_dtype(pages: Array):
    """The dtype the values of ``pages`` have: bfloat16 for uint16 bit patterns, else its own."""
    return jnp.bfloat16 if pages.dtype == BF16_BITS else pages.dtype


def as_logical(pages: Array) -> Array:
    """``pages`` with uint16 bit patterns reinterpreted as bfloat16 (a full copy on CPU: only for
    the reference and Pallas paths; the XLA path reinterprets each gathered chunk instead)."""
    if pages.dtype == BF16_BITS:
        return jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    return pages


def page_rows(block_tables: Array, k_heads: int, num_pages: int) -> Array:
    """block_tables [B, M] -> row ids [K, B, M] into pages viewed as [K*P, L*H].

    Row k*P + page is page ``page`` of kv head k. Gathering whole rows of that 2-D view yields
    [K, B, M, L*H] already in the (kv head, sequence) order the batched matmuls want, so the
    gather is a plain row copy with no transposing copy after it.
    """
    heads = num_pages * jnp.arange(k_heads, dtype=jnp.int32)
    return block_tables.astype(jnp.int32)[None] + heads[:, None, None]


def _packed_rows(pages: Array, pack: bool) -> Array:
    """pages [K, P, L, H] -> rows [K*P, L*H] or, for 16-bit dtypes when ``pack``, the same bytes
    as uint32 [K*P, L*H/2]: XLA CPU's gather costs per element, so half the elements gathers
    twice as fast."""
    kh, num_pages, size, h = pages.shape
    rows = pages.reshape(kh * num_pages, size * h)
    if pack and pages.dtype.itemsize == 2:
        rows = jax.lax.bitcast_convert_type(rows.reshape(kh * num_pages, size * h // 2, 2),
                                            jnp.uint32)
    return rows


def _unpack(rows: Array, dtype, shape) -> Array:
    """Gathered rows (packed uint32 [..., W] or uint16 bits or typed) -> ``shape`` in ``dtype``."""
    if rows.dtype != dtype:
        rows = jax.lax.bitcast_convert_type(rows, dtype)  # uint32 -> [..., W, 2]; uint16 -> same
    return rows.reshape(shape)


def _scores(qr: Array, k: Array) -> Array:
    """qr [K, B, R, H], k [K, B, S, H] -> scores [K, B, R, S] float32.

    XLA CPU is fastest with ``q @ K^T`` in bf16 but with ``K @ q^T`` (then a transpose of the
    small result) in f32: several times faster there (experiments/kernels.py, decode roof).
    """
    if k.dtype == jnp.float32:
        return jnp.swapaxes(jnp.einsum("KBSH,KBRH->KBSR", k, qr), 2, 3)
    return jnp.einsum("KBRH,KBSH->KBRS", qr, k, preferred_element_type=jnp.float32)


def paged_attention_xla(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                        q_start: Array, lengths: Array, *, pages_per_chunk: int = 4,
                        pack: bool = True) -> Array:
    """Gather + online softmax over chunks of pages, for CPU serving. Same semantics as the kernel.

    The block table is walked ``pages_per_chunk`` pages at a time by a loop whose trip count is
    ``cdiv(max(lengths), pages_per_chunk * L)``: the work follows the longest live sequence, not
    the table's width (max_model_len), and changing lengths never recompiles. A chunk's pages of
    every kv head are gathered as whole rows of the pool viewed as [K*P, L*H] (``page_rows``)
    into [K, B, C*L, H] (a row copy: no per-element index math, no transposing copy); the T*G
    query rows of each kv head attend with two batched matmuls whose batch dims (K, B) lead both
    operands. Both read K/V in the storage dtype and accumulate in float32; scores are
    [K, B, R, S] so the softmax runs along the contiguous key axis.
    """
    check_paged_shapes(q, k_pages, v_pages, block_tables, q_start, lengths)
    b, t, n, h = q.shape
    kh, num_pages, page_size, _ = k_pages.shape
    g = n // kh
    m = block_tables.shape[1]
    c = max(1, min(pages_per_chunk, m))
    n_chunks = -(-m // c)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, n_chunks * c - m)))
    # Clipped once here (a few KB of ids) so the gathers can promise in-bounds indices.
    rows = jnp.clip(page_rows(tables, kh, num_pages), 0, kh * num_pages - 1)  # [K, B, M']
    lengths = lengths.astype(jnp.int32)
    q_pos = q_start.astype(jnp.int32)[:, None] + jnp.arange(t)[None, :]  # [B, T]
    q_pos = jnp.repeat(q_pos, g, axis=1)  # [B, T*G], row t*G + g
    limit = jnp.minimum(q_pos, lengths[:, None] - 1)  # last visible key per row
    qr = q.reshape(b, t, kh, g, h).transpose(2, 0, 1, 3, 4).reshape(kh, b, t * g, h)
    dtype = logical_dtype(k_pages)  # bf16 for uint16-stored pages
    qr = (qr.astype(jnp.float32) * (1.0 / math.sqrt(h))).astype(dtype)  # [K, B, R, H]
    k_flat, v_flat = (_packed_rows(x, pack) for x in (k_pages, v_pages))  # [K*P, L*H/w]
    span = c * page_size

    def chunk(j, carry):
        mx, den, acc = carry  # [K, B, R, 1], [K, B, R, 1], [K, B, R, H]
        ids = jax.lax.dynamic_slice_in_dim(rows, j * c, c, axis=2)  # [K, B, C]
        k = _unpack(k_flat.at[ids].get(mode="promise_in_bounds"), dtype, (kh, b, span, h))
        v = _unpack(v_flat.at[ids].get(mode="promise_in_bounds"), dtype, (kh, b, span, h))
        k_pos = j * span + jnp.arange(span)
        mask = k_pos[None, None, :] <= limit[:, :, None]  # [B, R, S]
        sc = jnp.where(mask[None], _scores(qr, k), -jnp.inf)  # [K, B, R, S]
        m_new = jnp.maximum(mx, jnp.max(sc, axis=3, keepdims=True))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(sc - safe)  # masked -> 0
        scale = jnp.exp(jnp.where(jnp.isfinite(mx), mx - safe, -jnp.inf))
        o = jnp.einsum("KBRS,KBSH->KBRH", p.astype(v.dtype), v,
                       preferred_element_type=jnp.float32)
        return m_new, den * scale + jnp.sum(p, 3, keepdims=True), acc * scale + o

    init = (jnp.full((kh, b, t * g, 1), -jnp.inf, jnp.float32),
            jnp.zeros((kh, b, t * g, 1), jnp.float32), jnp.zeros((kh, b, t * g, h), jnp.float32))
    trips = jnp.minimum(-(-jnp.max(lengths) // span), n_chunks)
    _, den, acc = jax.lax.fori_loop(0, trips, chunk, init)
    out = acc / jnp.where(den == 0.0, 1.0, den)  # [K, B, R, H]; rows seeing nothing -> 0
    out = out.reshape(kh, b, t, g, h).transpose(1, 2, 0, 3, 4)
    return out.reshape(b, t, n, h).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Reference (the oracle)


def gather_pages(pages: Array, block_tables: Array) -> Array:
    """pages [K, P, L, H], block_tables [B, M] -> contiguous [B, M*L, K, H]."""
    kh, _, size, h = pages.shape
    b, m = block_tables.shape
    g = pages[:, block_tables]  # [K, B, M, L, H]
    return jnp.moveaxis(g, 0, 3).reshape(b, m * size, kh, h)


def paged_attention_reference(q: Array, k_pages: Array, v_pages: Array, block_tables: Array,
                              q_start: Array, lengths: Array) -> Array:
    """q [B, T, N, H] over paged K/V [K, P, L, H] through block_tables [B, M] -> [B, T, N, H]."""
    k = as_logical(gather_pages(k_pages, block_tables))
    v = as_logical(gather_pages(v_pages, block_tables))
    return attention_reference(q, k, v, q_start, lengths)


__all__ = ["paged_attention", "paged_attention_xla", "check_paged_shapes",
           "paged_attention_reference", "gather_pages", "page_rows", "logical_dtype", "as_logical",
           "BF16_BITS"]
