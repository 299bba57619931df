"""KV caches as pytrees of device arrays, and the write into them.

Two layouts share one method, ``update_and_attend(layer, q, k, v, meta, backend)``:

* ``DenseKVCache``: one contiguous [B, S, K, H] buffer per layer. The reference generate loop
  (the correctness oracle) uses it.
* ``PagedKVCache``: fixed-size pages [K, P, L, H] per layer, addressed through block tables.
  Page 0 is reserved as the dummy page: padding tokens write there, never into a live page.
  On CPU, bf16 pages are stored as uint16 bit patterns (``page_storage_dtype``): XLA CPU would
  convert the whole bf16 buffer to f32 and back around every write.

Both are updated with ``.at[].set`` scatters inside the jitted step; callers donate the cache so
XLA updates the buffers in place.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from llmserve.batch import DUMMY_PAGE, PartMetadata, RaggedMetadata  # noqa: F401 (re-exported)
from llmserve.config import ModelConfig
from llmserve.ops import attention as attn_ops
from llmserve.ops.paged_attention import BF16_BITS

Array = jax.Array

# The step's metadata types are host dataclasses (llmserve.batch imports no jax): pytrees here.
for _cls in (PartMetadata, RaggedMetadata):
    jax.tree_util.register_dataclass(_cls)
KV_HEAD_AXIS = 0  # the kv-head axis of a paged layer [K, P, L, H]: what tensor parallelism splits


def page_storage_dtype(dtype, platform: Optional[str] = None):
    """The dtype paged K/V is stored in: bfloat16 pages are stored on CPU as their uint16 bits.

    XLA CPU scatters (and dynamic-update-slices) bf16 by converting the *whole* buffer to f32
    and back: 36 ms to write 32 tokens into a 12 MiB layer, against 13 us as uint16 (f32 and f16:
    6-14 us). That conversion was most of a bf16 decode step. The attention paths read uint16
    pages back as bf16 (``ops.paged_attention.logical_dtype``); on GPU pages stay bf16.
    """
    dtype = jnp.dtype(dtype)
    platform = platform or jax.default_backend()
    if dtype == jnp.bfloat16 and platform == "cpu":
        return jnp.dtype(BF16_BITS)
    return dtype


def set_at(buf: Array, index: tuple, values: Array, mode: Optional[str] = None) -> Array:
    """``buf.at[index].set(values)``, with float values stored as bf16 bits into uint16 pages.

    A bf16 buffer (the dense cache) is written through a uint16 view: two whole-buffer copies
    instead of XLA CPU's f32 round trip (~13x cheaper; the paged cache avoids even those).
    """
    if buf.dtype == BF16_BITS and values.dtype != BF16_BITS:
        values = jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), BF16_BITS)
    values = values.astype(buf.dtype)
    if buf.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(buf, BF16_BITS)
        bits = bits.at[index].set(jax.lax.bitcast_convert_type(values, BF16_BITS), mode=mode)
        return jax.lax.bitcast_convert_type(bits, buf.dtype)
    return buf.at[index].set(values, mode=mode)


@flax.struct.dataclass
class AttentionMetadata:
    """What attention needs besides q/k/v; all arrays, so changing values never recompiles.

    Query t of sequence b sits at position ``q_start[b] + t`` and sees the keys at positions
    ``s <= q_start[b] + t`` with ``s < lengths[b]``.
    """

    positions: Array  # [B, T] int32: absolute positions of the query tokens
    q_start: Array  # [B] int32: position of query 0
    lengths: Array  # [B] int32: valid kv length after this step's tokens are written
    token_mask: Array  # [B, T] bool: real tokens (padding tokens write to no live slot)
    block_tables: Optional[Array] = None  # [B, pages_per_seq] int32 (paged cache only)

    @classmethod
    def for_dense(cls, positions: Array, lengths: Array,
                  token_mask: Optional[Array] = None) -> "AttentionMetadata":
        """Metadata for contiguous positions (query t at positions[:, 0] + t)."""
        if token_mask is None:
            token_mask = jnp.ones(positions.shape, bool)
        return cls(positions=positions, q_start=positions[:, 0], lengths=lengths,
                   token_mask=token_mask)


@flax.struct.dataclass
class DenseKVCache:
    """Contiguous per-layer K/V buffers."""

    k: tuple  # n_layers x [B, S, K, H]
    v: tuple  # n_layers x [B, S, K, H]

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "DenseKVCache":
        dtype = dtype or cfg.jnp_dtype
        shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)))

    def update_and_attend(self, layer: int, q: Array, k: Array, v: Array,
                          meta: AttentionMetadata, backend: str):
        """Writes k/v [B, T, K, H] at meta.positions, then attends q [B, T, N, H]."""
        max_len = self.k[layer].shape[1]
        # Padding tokens scatter out of bounds and are dropped.
        pos = jnp.where(meta.token_mask, meta.positions, max_len)
        b_idx = jnp.arange(q.shape[0])[:, None]
        kc = set_at(self.k[layer], (b_idx, pos), k, mode="drop")
        vc = set_at(self.v[layer], (b_idx, pos), v, mode="drop")
        out = attn_ops.attention(q, kc, vc, meta.q_start, meta.lengths, backend=backend)
        new_k = self.k[:layer] + (kc,) + self.k[layer + 1:]
        new_v = self.v[:layer] + (vc,) + self.v[layer + 1:]
        return out, self.replace(k=new_k, v=new_v)


@flax.struct.dataclass
class PagedKVCache:
    """Paged per-layer K/V: pages [K, P, L, H]; page 0 is the dummy page.

    Pages are stored in ``page_storage_dtype(dtype)``: bf16 as uint16 bits on CPU.
    """

    k: tuple  # n_layers x [K, P, L, H]
    v: tuple  # n_layers x [K, P, L, H]
    # sharding.Shardings (its mesh splits the pages over kv heads), or None for one device:
    # with it, each layer's write + attention runs per shard (sharding.per_kv_shard).
    shardings: Any = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, cfg: ModelConfig, num_pages: int, page_size: int,
               dtype=None) -> "PagedKVCache":
        dtype = page_storage_dtype(dtype or cfg.jnp_dtype)
        shape = (cfg.n_kv_heads, num_pages, page_size, cfg.head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)))

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def slot_indices(self, meta: AttentionMetadata):
        """(page, offset) [B, T] for each query token; padding goes to the dummy page."""
        size = self.page_size
        page_col = jnp.clip(meta.positions // size, 0, meta.block_tables.shape[1] - 1)
        page = jnp.take_along_axis(meta.block_tables, page_col, axis=1)
        page = jnp.where(meta.token_mask, page, DUMMY_PAGE)
        offset = jnp.where(meta.token_mask, meta.positions % size, 0)
        return page, offset

    def update_and_attend(self, layer: int, q: Array, k: Array, v: Array,
                          meta: AttentionMetadata, backend: str):
        """Writes k/v [B, T, K, H] into their pages, then runs paged attention for q."""
        if isinstance(meta, RaggedMetadata):
            return self._update_and_attend_ragged(layer, q, k, v, meta, backend)
        page, offset = self.slot_indices(meta)
        kc = set_at(self.k[layer], (slice(None), page, offset), jnp.moveaxis(k, 2, 0))
        vc = set_at(self.v[layer], (slice(None), page, offset), jnp.moveaxis(v, 2, 0))
        out = attn_ops.paged_attention(q, kc, vc, meta.block_tables, meta.q_start, meta.lengths,
                                       backend=backend)
        new_k = self.k[:layer] + (kc,) + self.k[layer + 1:]
        new_v = self.v[:layer] + (vc,) + self.v[layer + 1:]
        return out, self.replace(k=new_k, v=new_v)

    def _update_and_attend_ragged(self, layer: int, q: Array, k: Array, v: Array,
                                  meta: RaggedMetadata, backend: str):
        """Flat tokens: q [1, N, N_heads, H], k/v [1, N, K, H]. One scatter writes every
        token's K/V; then each part attends as a [B, t] batch through the paged kernel."""
        fn = functools.partial(_ragged_layer, backend=backend)
        if self.shardings is not None:
            from llmserve.sharding import per_kv_shard

            fn = per_kv_shard(fn, self.shardings.mesh)
        out, kc, vc = fn(self.k[layer], self.v[layer], q, k, v, meta)
        new_k = self.k[:layer] + (kc,) + self.k[layer + 1:]
        new_v = self.v[:layer] + (vc,) + self.v[layer + 1:]
        return out, self.replace(k=new_k, v=new_v)

    def copy_pages(self, src: Array, dst: Array) -> "PagedKVCache":
        """Copies pages src [C] -> dst [C] in every layer (copy-on-write)."""
        k = tuple(set_at(x, (slice(None), dst), x[:, src]) for x in self.k)
        v = tuple(set_at(x, (slice(None), dst), x[:, src]) for x in self.v)
        return self.replace(k=k, v=v)


def _ragged_layer(k_pages: Array, v_pages: Array, q: Array, k: Array, v: Array,
                  meta: RaggedMetadata, *, backend: str):
    """One layer over flat tokens: writes k/v [1, N, K, H] into pages [K, P, L, H], then each
    part attends as a [B, t] batch (or, batch-invariant, every token alone) -> (out
    [1, N, heads, H], k_pages, v_pages). Pure, so it runs whole or once per kv-head shard."""
    index = (slice(None), meta.write_page, meta.write_offset)
    kc = set_at(k_pages, index, jnp.moveaxis(k[0], 1, 0))
    vc = set_at(v_pages, index, jnp.moveaxis(v[0], 1, 0))
    if meta.per_token is not None:
        tok = meta.per_token
        n, nq = q.shape[1], tok.block_tables.shape[0]
        qt = jnp.pad(q[0], ((0, nq - n), (0, 0), (0, 0)))[:, None]  # [Nq, 1, heads, H]
        out = attn_ops.paged_attention(qt, kc, vc, tok.block_tables, tok.q_start, tok.lengths,
                                       backend=backend)
        return out[:n, 0][None], kc, vc
    outs, off = [], 0
    for part in meta.parts:
        b, t = part.block_tables.shape[0], part.t
        qp = q[0, off:off + b * t].reshape(b, t, *q.shape[2:])
        out = attn_ops.paged_attention(qp, kc, vc, part.block_tables, part.q_start,
                                       part.lengths, backend=backend)
        outs.append(out.reshape(b * t, *q.shape[2:]))
        off += b * t
    out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
    if off < q.shape[1]:  # padding tokens past the parts (batch-invariant minimum size)
        out = jnp.pad(out, ((0, q.shape[1] - off), (0, 0), (0, 0)))
    return out[None], kc, vc
