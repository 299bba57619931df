"""KV cache writes: what is written reads back exactly (in the storage dtype's precision).

The oracle is the written values themselves cast to the cache dtype; bf16 pages on CPU are stored
as uint16 bit patterns (``page_storage_dtype``) and must read back bit-identical to a bf16 cast.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmserve.config import preset
from llmserve.kv_cache import (
    AttentionMetadata,
    DenseKVCache,
    PagedKVCache,
    page_storage_dtype,
    set_at,
)
from llmserve.ops.paged_attention import as_logical


def test_page_storage_dtype():
    assert page_storage_dtype(jnp.bfloat16, "cpu") == jnp.uint16
    assert page_storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert page_storage_dtype(jnp.float32, "cpu") == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_paged_write_reads_back(dtype):
    cfg = preset("tiny-9-3")  # K=3, H=8
    cache = PagedKVCache.create(cfg, num_pages=6, page_size=4, dtype=dtype)
    assert cache.k[0].dtype == page_storage_dtype(dtype)
    b, t = 2, 3
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((b, t, 3, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, 3, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, 9, 8)), dtype)
    tables = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    positions = jnp.asarray([[2, 3, 4], [0, 1, 2]], jnp.int32)  # row 0 crosses a page
    meta = AttentionMetadata(positions=positions, q_start=positions[:, 0],
                             lengths=positions[:, -1] + 1, token_mask=jnp.ones((b, t), bool),
                             block_tables=tables)
    f = jax.jit(lambda c, q, k, v: c.update_and_attend(1, q, k, v, meta, "xla"))
    _, cache = f(cache, q, k, v)
    pages = np.asarray(as_logical(cache.k[1]).astype(jnp.float32))  # [K, P, L, H]
    vpages = np.asarray(as_logical(cache.v[1]).astype(jnp.float32))
    want_k = np.asarray(k.astype(dtype).astype(jnp.float32))
    want_v = np.asarray(v.astype(dtype).astype(jnp.float32))
    for i in range(b):
        for j in range(t):
            pos = int(positions[i, j])
            page = int(tables[i, pos // 4])
            np.testing.assert_array_equal(pages[:, page, pos % 4], want_k[i, j])
            np.testing.assert_array_equal(vpages[:, page, pos % 4], want_v[i, j])
    # Nothing else was written (layer 0 untouched, unused pages still zero).
    assert not np.asarray(as_logical(cache.k[0]).astype(jnp.float32)).any()
    assert not pages[:, [0, 5]].any()
    # Copy-on-write copies bits exactly.
    copied = cache.copy_pages(jnp.asarray([1]), jnp.asarray([5]))
    np.testing.assert_array_equal(np.asarray(copied.k[1][:, 5]), np.asarray(cache.k[1][:, 1]))


def test_dense_bf16_write_through_uint16_view():
    cfg = preset("tiny-gqa")
    cache = DenseKVCache.create(cfg, batch=2, max_len=5, dtype=jnp.bfloat16)
    vals = jnp.asarray(np.random.default_rng(1).standard_normal((2, 1, 2, 16)), jnp.float32)
    idx = (jnp.arange(2)[:, None], jnp.asarray([[1], [5]]))  # row 1 out of range: dropped
    out = jax.jit(lambda buf, x: set_at(buf, idx, x, mode="drop"))(cache.k[0], vals)
    assert out.dtype == jnp.bfloat16
    want = np.asarray(vals[0, 0].astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out[0, 1]), want)
    assert not np.asarray(out[1].astype(jnp.float32)).any()
