"""The native matmuls (``ops.cpu_kernels.matmul_bf16_cpu``, AVX512_BF16, and
``matmul_f32_cpu``, AVX-512F; both AVX2 + FMA on CPUs without AVX-512) against XLA's dot with
float32 accumulation (``matmul_bf16_reference``), and the model's routing to them.

Tolerance: both sides accumulate in float32 in different orders (bf16 products are exact), so
results agree to float32 rounding: max abs error <= 1e-5 x (sum over k of |x w|) per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmserve.config import preset
from llmserve.kv_cache import AttentionMetadata, DenseKVCache
from llmserve.model import Transformer, init_params
from llmserve.ops import cpu_kernels as cpa

needs_matmul = pytest.mark.skipif(not cpa.has_bf16_matmul(),
                                  reason="no native bf16 matmul on this CPU")
needs_f32 = pytest.mark.skipif(not cpa.has_f32_matmul(), reason="no native float32 matmul")
# float32 shapes: K % 16, N % 16 ([K, N]; 16/32/48-column tails) or N % 4 ([N, K]).
F32_SHAPES = [(1, 576, 576, False), (7, 48, 80, False), (13, 1536, 576, False),
              (10, 576, 192, False), (12, 32, 112, False), (20, 64, 48, False),
              (32, 64, 112, False), (5, 576, 1028, True), (9, 16, 8, True),
              (100, 576, 192, False), (256, 1536, 576, False), (100, 576, 192, True)]

# (M, K, N, transpose_w): row counts around the kernel's 6-row (4-row transposed) tiles, the
# 7-24-row calls of a verify step or small batch, the transposed kernel's balanced 5-6-row
# tiles (up to 12 rows), 32-column tails, SmolLM2's shapes, and a vocabulary not a multiple of 64.
SHAPES = [
    (1, 576, 576, False), (6, 576, 192, False), (7, 576, 1536, False), (32, 1536, 576, False),
    (13, 64, 96, False), (130, 96, 160, False), (10, 576, 192, False), (12, 64, 96, False),
    (1, 576, 4100, True), (4, 64, 256, True), (9, 576, 1028, True), (33, 128, 68, True),
    (5, 576, 4100, True), (11, 64, 256, True), (12, 576, 1028, True),
    # 3 and 9 column blocks on 2 threads: each block is cut into row chunks (SplitMatmul)
    (100, 576, 192, False), (256, 576, 576, False), (100, 576, 192, True),
]


def _inputs(m, k, n, transpose_w, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k) if transpose_w else (k, n)) * 0.05, dtype)
    return x, w


def _bound(x, w, transpose_w):
    wf = np.abs(np.asarray(w, np.float32))
    return 1e-5 * (np.abs(np.asarray(x, np.float32)) @ (wf.T if transpose_w else wf)) + 1e-6


@needs_matmul
@pytest.mark.parametrize("m,k,n,transpose_w", SHAPES)
def test_matches_xla_dot(m, k, n, transpose_w):
    x, w = _inputs(m, k, n, transpose_w)
    out = jax.jit(cpa.matmul_bf16_cpu, static_argnums=2)(x, w, transpose_w)
    want = cpa.matmul_bf16_reference(x, w, transpose_w)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    err = np.abs(np.asarray(out) - np.asarray(want))
    assert np.all(err <= _bound(x, w, transpose_w)), float(err.max())


@needs_f32
@pytest.mark.parametrize("m,k,n,transpose_w", F32_SHAPES)
def test_f32_matches_xla_dot(m, k, n, transpose_w):
    x, w = _inputs(m, k, n, transpose_w, dtype=jnp.float32)
    out = jax.jit(cpa.matmul_f32_cpu, static_argnums=2)(x, w, transpose_w)
    want = cpa.matmul_bf16_reference(x, w, transpose_w)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    err = np.abs(np.asarray(out) - np.asarray(want))
    assert np.all(err <= _bound(x, w, transpose_w)), float(err.max())


@needs_matmul
@needs_f32
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [320, 576])
def test_each_row_is_bitwise_the_same_alone_and_in_a_batch(transpose_w, dtype, n):
    # One or two rows take other code paths than 37 (AVX2: 96-column row blocks when n allows).
    x, w = _inputs(37, 576, n, transpose_w, seed=1, dtype=dtype)
    f = jax.jit(cpa.matmul_bf16_cpu if dtype == jnp.bfloat16 else cpa.matmul_f32_cpu,
                static_argnums=2)
    batch = np.asarray(f(x, w, transpose_w))
    for i in (0, 5, 6, 23, 35):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w, transpose_w))[0], batch[i])
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 2], w, transpose_w)), batch[i:i + 2])
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 4], w, transpose_w)), batch[i:i + 4])
    for i, m in ((0, 7), (5, 9), (23, 10), (24, 12), (0, 16), (17, 20), (13, 24),  # 7-24 rows
                 (3, 5), (2, 11)):  # and the transposed kernel's balanced tiles
        np.testing.assert_array_equal(np.asarray(f(x[i:i + m], w, transpose_w)), batch[i:i + m])


@needs_matmul
@needs_f32
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [192, 576])
def test_row_chunks_of_a_split_call_are_bitwise_the_rows_alone(transpose_w, dtype, n):
    """3 or 9 column blocks do not divide over 2 threads, so a call of >= 48 rows cuts each
    block into row chunks (100 rows: 54 + 46): every row, either side of the cut, is bitwise
    the row computed alone, and padding past ``live_rows`` is still zeros."""
    x, w = _inputs(100, 576, n, transpose_w, seed=7, dtype=dtype)
    fn = cpa.matmul_bf16_cpu if dtype == jnp.bfloat16 else cpa.matmul_f32_cpu
    f = jax.jit(fn, static_argnums=2)
    batch = np.asarray(f(x, w, transpose_w))
    for i in (0, 47, 53, 54, 55, 99):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w, transpose_w))[0], batch[i])
    live = np.asarray(jax.jit(lambda a, b: fn(a, b, transpose_w, jnp.int32(90)))(x, w))
    np.testing.assert_array_equal(live[:90], batch[:90])
    assert not live[90:].any()


@needs_matmul
@needs_f32
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_live_rows_are_computed_and_padding_rows_are_zeros(transpose_w, dtype):
    """``live_rows`` (a traced scalar: one program for every value): the first rows are exactly
    the full call's rows, the rest zeros; out-of-range values clamp to [0, M]."""
    m = 37
    x, w = _inputs(m, 576, 320, transpose_w, seed=4, dtype=dtype)
    fn = cpa.matmul_bf16_cpu if dtype == jnp.bfloat16 else cpa.matmul_f32_cpu
    f = jax.jit(lambda a, b, live: fn(a, b, transpose_w, live))
    full = np.asarray(jax.jit(fn, static_argnums=2)(x, w, transpose_w))
    for live in (37, 36, 19, 6, 5, 1, 0, 40, -3):
        out = np.asarray(f(x, w, jnp.int32(live)))
        keep = min(max(live, 0), m)
        np.testing.assert_array_equal(out[:keep], full[:keep])
        assert not out[keep:].any(), live
    assert f._cache_size() == 1  # the live count is an operand, never a new shape


@needs_matmul
def test_gradient_is_the_plain_dot_gradient():
    x, w = _inputs(5, 64, 96, False, seed=2)
    loss = lambda f: lambda a, b: jnp.sum(f(a, b, False) ** 2)  # noqa: E731
    gx, gw = jax.grad(loss(cpa.matmul_bf16_cpu), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(loss(cpa.matmul_bf16_reference), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(rx, np.float32), rtol=2e-2,
                               atol=1e-3)
    np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(rw, np.float32), rtol=2e-2,
                               atol=1e-3)


def test_bad_shapes_and_dtypes_are_named():
    x, w = _inputs(3, 64, 96, False)
    with pytest.raises(ValueError, match=r"\(3, 64\).*\(64, 96\)|K % 32"):
        cpa.matmul_bf16_cpu(x[:, :48], w[:48], False)
    with pytest.raises(ValueError, match="bf16"):
        cpa.matmul_bf16_cpu(x.astype(jnp.float32), w, False)


@needs_matmul
@needs_f32
@pytest.mark.parametrize("name,dtype", [("tiny-gqa", "bfloat16"), ("tiny-mqa", "bfloat16"),
                                        ("tiny-gqa", "float32")])
def test_model_logits_on_the_cpu_backend_match_xla_dots(name, dtype, monkeypatch):
    """A model on backend "cpu" (native matmuls where the shapes suit: tiny-mqa's 16-wide k/v
    projections stay on XLA in bf16) vs "xla": same logits to bf16-activation rounding (fp32:
    to 1e-4), same argmax. The native kernels are forced (``LLMSERVE_NATIVE_MATMUL=1``): on an
    AMX CPU the measured rule would give these 33 rows to XLA."""
    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    cfg = preset(name).replace(dtype=dtype)
    params = init_params(cfg)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (3, 11)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (3, 11))
    meta = AttentionMetadata.for_dense(positions, jnp.full((3,), 11, jnp.int32))

    cache = DenseKVCache.create(cfg, batch=3, max_len=11)

    def program(backend):
        return jax.jit(lambda p, t, m, c: Transformer(cfg).apply({"params": p}, t, m, c,
                                                                 backend=backend)[0])

    native = np.asarray(program("cpu")(params, tokens, meta, cache))
    xla = np.asarray(program("xla")(params, tokens, meta, cache))
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(native, xla, atol=tol, rtol=tol)
    assert np.array_equal(native.argmax(-1), xla.argmax(-1))
    target = "llmserve_matmul_bf16_cpu" if dtype == "bfloat16" else "llmserve_matmul_f32_cpu"
    text = program("cpu").lower(params, tokens, meta, cache).as_text()
    assert target in text  # the native matmul is really in the program
    assert target not in program("xla").lower(params, tokens, meta, cache).as_text()


def _routes_native(dtype, rows, native=True, transpose_w=False):
    """Whether model.matmul_f32 puts a native custom call in the program for this case."""
    from llmserve.model import matmul_f32

    x, w = _inputs(rows, 64, 96, transpose_w, dtype=dtype)
    text = jax.jit(lambda a, b: matmul_f32(a, b, transpose_w, native=native)).lower(
        x, w).as_text()
    return "llmserve_matmul_" in text


@needs_matmul
@needs_f32
def test_the_model_routes_each_row_count_to_the_matmul_measured_faster(monkeypatch):
    """On an AMX CPU whose native kernels have no tiles (``amx_matmul`` false) XLA's dot wins
    bf16 from AMX_XLA_MIN_ROWS rows up (fp32 stays native); with the tiles, or without AMX, the
    native kernels win at every row count; "always" (batch-invariant mode) and the environment
    override take the native kernel at every row count; "0" never."""
    monkeypatch.delenv("LLMSERVE_NATIVE_MATMUL", raising=False)
    bf16, f32, edge = jnp.bfloat16, jnp.float32, cpa.AMX_XLA_MIN_ROWS
    monkeypatch.setattr(cpa, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(cpa, "amx_matmul", lambda enabled=None: True)
    assert all(_routes_native(bf16, rows) for rows in (1, edge, 64, 512))
    monkeypatch.setattr(cpa, "amx_matmul", lambda enabled=None: False)
    assert _routes_native(bf16, 1) and _routes_native(bf16, edge - 1)
    assert _routes_native(bf16, 1, transpose_w=True)
    assert not _routes_native(bf16, edge) and not _routes_native(bf16, 64)
    assert _routes_native(f32, 1) and _routes_native(f32, 64)
    assert _routes_native(bf16, 64, native="always") and _routes_native(f32, 64, "always")
    assert not _routes_native(bf16, 1, native=False)
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: False)
    assert _routes_native(bf16, 64) and _routes_native(f32, 64) and _routes_native(bf16, 1)
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: True)
    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    assert _routes_native(bf16, 64) and _routes_native(f32, 64)
    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "0")
    assert not _routes_native(bf16, 1) and not _routes_native(bf16, 64, native="always")


@needs_matmul
@needs_f32
def test_an_avx2_cpu_takes_native_bf16_always_and_native_fp32_at_small_row_counts(monkeypatch):
    """Without AVX-512 (the AVX2 + FMA kernels): bf16 always native, float32 native in
    AVX2_F32_ROWS and XLA's dot elsewhere; "always" and "1" still force it."""
    monkeypatch.delenv("LLMSERVE_NATIVE_MATMUL", raising=False)
    monkeypatch.setattr(cpa, "cpu_has_avx512", lambda: False)
    bf16, f32 = jnp.bfloat16, jnp.float32
    lo, hi = cpa.AVX2_F32_ROWS
    assert all(_routes_native(bf16, rows) for rows in (1, 8, 64, 512))
    assert _routes_native(bf16, 1, transpose_w=True)
    assert not _routes_native(f32, lo - 1) and _routes_native(f32, lo)
    assert _routes_native(f32, hi - 1) and not _routes_native(f32, hi)
    assert _routes_native(f32, 1, "always")
    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    assert _routes_native(f32, 1) and _routes_native(f32, 512)


@pytest.mark.parametrize("reader,flags", [
    ("cpu_has_avx512", ("fpu avx2 fma avx512f avx512bw", "fpu avx2 fma")),
    ("cpu_has_amx", ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", "fpu avx512f avx512_bf16")),
])
def test_cpu_feature_readers_read_the_flags(tmp_path, reader, flags):
    """AVX-512F and AMX are read from /proc/cpuinfo's flags line (a missing file: no)."""
    read = getattr(cpa, reader).__wrapped__
    info = tmp_path / "cpuinfo"
    info.write_text(f"model name : x\nflags : {flags[0]}\n")
    assert read(str(info))
    info.write_text(f"flags : {flags[1]}\n")
    assert not read(str(info))
    assert not read(str(tmp_path / "missing"))


@needs_matmul
def test_a_step_skips_its_padding_rows_in_the_native_matmuls(monkeypatch):
    """A decode step of 3 sequences in an 8-row bucket: the real rows' logits are bitwise those
    of the same step with every row counted live, and the padding rows' logits are zeros (the
    layers and the vocabulary projection skipped them) where the full step computed them."""
    from llmserve.batch import BatchBuilder, ScheduledRow
    from llmserve.kv_cache import PagedKVCache
    from llmserve.step import forward

    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    cfg = preset("tiny-gqa").replace(dtype="bfloat16")
    params = init_params(cfg)
    builder = BatchBuilder(vocab_size=cfg.vocab_size, page_size=4, pages_per_seq=4, max_slots=8,
                           decode_buckets=[8], prefill_buckets=[(1, 8)])
    rows = [ScheduledRow(tokens=[5 + i], start=3, block_table=[1 + i], slot=i, emit=True,
                         sampling={}) for i in range(3)]
    batch = jax.tree_util.tree_map(jnp.asarray, builder.prepare(rows))
    cache = PagedKVCache.create(cfg, 8, 4)
    run = jax.jit(lambda p, c, b: forward(p, c, b, cfg=cfg, backend="cpu")[0])
    live = np.asarray(run(params, cache, batch))
    full = np.asarray(run(params, cache, batch.replace(live=jnp.asarray([8, 8], jnp.int32))))
    assert live.shape == (8, cfg.vocab_size)
    np.testing.assert_array_equal(live[:3], full[:3])
    assert not live[3:].any() and full[3:].any()
    # The timing batch (what the ideal schedule and the never-slower policy time) is computed
    # whole: every padding row's logits come out, as the full step's did.
    def padding_logits(full):
        batch = jax.tree_util.tree_map(jnp.asarray, builder.empty_batch((8, None), full=full))
        return np.abs(np.asarray(run(params, cache, batch))).sum(axis=-1)

    assert (padding_logits(True) > 0).all() and not padding_logits(False).any()


def test_a_step_takes_one_matmul_kernel_chosen_by_its_sequences(monkeypatch):
    """runner.native_matmul: a decode or verify step is judged by its sequences (a verify step
    of 4 rows x 3 tokens takes the kernel of a 4-row decode step, so speculation cannot change
    a greedy token by rounding), a step with prefill by its flat tokens; sharded: never; the
    batch-invariant mode and fp32: always native."""
    import types

    from llmserve.batch import BatchBuilder
    from llmserve.step import native_matmul, step_rows

    monkeypatch.delenv("LLMSERVE_NATIVE_MATMUL", raising=False)
    monkeypatch.setattr(cpa, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(cpa, "amx_matmul", lambda enabled=None: False)  # (no tiles of our own)
    builder = BatchBuilder(vocab_size=50, page_size=4, pages_per_seq=8, max_slots=16,
                           decode_buckets=[1, 4, 8, 16], prefill_buckets=[(1, 8), (2, 8)],
                           num_speculative_tokens=2)
    plain, sharded = types.SimpleNamespace(shardings=None), types.SimpleNamespace(shardings=1)

    def pick(shape, dtype="bfloat16", cache=plain, min_rows=1):
        return native_matmul(cache, min_rows, builder.empty_batch(shape), dtype)

    assert step_rows(builder.empty_batch((4, None, 3))) == 4  # 12 tokens, 4 sequences
    assert step_rows(builder.empty_batch((1, (2, 8), 1))) == 1 + 16
    assert pick((4, None, 1)) == "always" and pick((4, None, 3)) == "always"
    assert pick((1, None, 1)) == "always"
    assert pick((8, None, 1)) is False and pick((8, None, 3)) is False
    assert pick((0, (1, 8), 1)) is False and pick((1, (1, 8), 1)) is False
    assert pick((16, None, 1), min_rows=8) == "always"
    assert pick((16, None, 1), dtype="float32") == "always"
    assert pick((1, None, 1), cache=sharded) is False
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: False)
    assert pick((16, None, 1)) == "always" and pick((0, (2, 8), 1)) == "always"
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(cpa, "amx_matmul", lambda enabled=None: True)  # our tiles: every step
    assert pick((8, None, 3)) == "always" and pick((1, (1, 8), 1)) == "always"


# ---- the blocked weight layout ([N / 64, K, 64], cpu_kernels.block_weight) ----

needs_blocked_bf16 = pytest.mark.skipif(not cpa.blocked_matmul_supported(jnp.bfloat16),
                                        reason="no AVX512_BF16 matmul (blocked layout)")
needs_blocked_f32 = pytest.mark.skipif(not cpa.blocked_matmul_supported(jnp.float32),
                                       reason="no AVX-512F matmul (blocked layout)")


def test_block_weight_round_trips_and_places_each_column_block_contiguously(monkeypatch):
    monkeypatch.setattr(cpa, "paired_weights_apply", lambda dtype: False)
    w = np.arange(6 * 128, dtype=np.float32).reshape(6, 128)
    b = cpa.block_weight(w)
    assert b.shape == (2, 6, 64) and b.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(b[1], w[:, 64:])  # block j = columns [64 j, 64 j + 64)
    np.testing.assert_array_equal(cpa.unblock_weight(b), w)
    np.testing.assert_array_equal(np.asarray(cpa.unblock_weight(cpa.block_weight(jnp.asarray(w)))),
                                  w)
    assert cpa.blocked_shape(576, 1536, jnp.bfloat16) == (24, 576, 64)
    assert cpa.blocked_shape(48, 128, jnp.bfloat16) is None  # K % 32
    assert cpa.blocked_shape(48, 128, jnp.float32) == (2, 48, 64)
    assert cpa.blocked_shape(64, 96, jnp.float32) is None  # N % 64
    with pytest.raises(ValueError, match="multiple of 64"):
        cpa.block_weight(w[:, :96])


@pytest.mark.parametrize("dtype", [
    pytest.param(jnp.bfloat16, marks=needs_blocked_bf16),
    pytest.param(jnp.float32, marks=needs_blocked_f32)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (2, 576, 192), (7, 64, 128), (10, 576, 192),
                                   (13, 1536, 576), (37, 576, 1536), (100, 576, 192),
                                   (256, 576, 576)])
def test_blocked_weights_give_bitwise_the_results_of_the_kn_layout(dtype, m, k, n):
    """The kernels read the same values in the same order from either layout: every row (and
    the zeros of the padding rows past ``live``) is bitwise the [K, N] call's, across the tile
    sizes, the 3- and 9-block row-chunk splits and SmolLM2's shapes."""
    f = cpa.matmul_bf16_cpu if dtype == jnp.bfloat16 else cpa.matmul_f32_cpu
    x, w = _inputs(m, k, n, False, seed=m, dtype=dtype)
    blocked = cpa.block_weight(w)
    run = jax.jit(f, static_argnums=2)
    np.testing.assert_array_equal(np.asarray(run(x, blocked, False)), np.asarray(run(x, w, False)))
    live = jnp.int32(max(1, m - 3))
    out = np.asarray(run(x, blocked, False, live))
    np.testing.assert_array_equal(out, np.asarray(run(x, w, False, live)))
    assert not out[max(1, m - 3):].any()
    want = np.asarray(cpa.matmul_bf16_reference(x, blocked))  # the oracle unblocks
    assert (np.abs(out[: max(1, m - 3)] - want[: max(1, m - 3)])
            <= _bound(x, w, False)[: max(1, m - 3)]).all()


@needs_blocked_bf16
def test_bad_blocked_weights_are_named():
    x, w = _inputs(3, 64, 128, False)
    b = cpa.block_weight(w)
    with pytest.raises(ValueError, match="not transposed"):
        cpa.matmul_bf16_cpu(x, b, True)
    with pytest.raises(ValueError, match=r"\[N / 64, K, 64\]"):
        cpa.matmul_bf16_cpu(x, b.reshape(4, 64, 32), False)
    with pytest.raises(ValueError, match="K % 32"):
        cpa.matmul_bf16_cpu(x[:, :48], b[:, :48], False)


@needs_blocked_bf16
@needs_blocked_f32
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_with_blocked_kernels_gives_the_logits_of_its_kn_kernels(dtype, monkeypatch):
    """``block_params`` blocks every blockable Dense kernel (tiny-gqa's q/o/MLP kernels, N a
    multiple of 64, not its 32-wide k/v projections); the model takes either layout, mixed:
    bitwise the same logits on the "cpu" backend, and on "xla" (which unblocks the kernels, a
    copy) XLA's logits."""
    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    cfg = preset("tiny-gqa").replace(dtype=dtype)
    params = init_params(cfg)
    blocked = cpa.block_params(params, cfg.jnp_dtype)
    leaves = dict(jax.tree_util.tree_leaves_with_path(blocked))
    original = dict(jax.tree_util.tree_leaves_with_path(params))
    kernels = {p: v for p, v in leaves.items() if "kernel" in jax.tree_util.keystr(p)}
    for path, value in kernels.items():
        want = cpa.blocked_shape(*original[path].shape, cfg.jnp_dtype)
        assert value.shape == (want or original[path].shape), jax.tree_util.keystr(path)
    assert {v.ndim for v in kernels.values()} == {2, 3}  # some blocked, some not
    assert jax.tree_util.tree_structure(blocked) == jax.tree_util.tree_structure(params)
    assert blocked["embed"]["embedding"].ndim == 2  # the tied [V, D] table stays as it is
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    meta = AttentionMetadata.for_dense(positions, jnp.full((2,), 9, jnp.int32))
    cache = DenseKVCache.create(cfg, batch=2, max_len=9)

    def logits(p, backend):
        return np.asarray(jax.jit(lambda p, t, m, c: Transformer(cfg).apply(
            {"params": p}, t, m, c, backend=backend)[0])(p, tokens, meta, cache))

    np.testing.assert_array_equal(logits(blocked, "cpu"), logits(params, "cpu"))
    np.testing.assert_array_equal(logits(blocked, "xla"), logits(params, "xla"))


def test_blocked_weights_apply_follows_the_kernels_and_the_opt_out(monkeypatch):
    """Blocked where the AVX-512 kernel for the dtype exists and wins at every row count; not
    on an AMX CPU for bf16 when the native kernels have no tiles (XLA's dot, which reads
    [K, N], wins from 8 rows); with the tiles bf16 is blocked again, paired
    (``paired_weights_apply``); not with ``LLMSERVE_BLOCKED_WEIGHTS=0``."""
    monkeypatch.setattr(cpa, "blocked_matmul_supported", lambda dtype: True)
    monkeypatch.setattr(cpa, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(cpa, "amx_matmul", lambda enabled=None: False)
    assert cpa.blocked_weights_apply(jnp.bfloat16) and cpa.blocked_weights_apply(jnp.float32)
    assert not cpa.paired_weights_apply(jnp.bfloat16)
    monkeypatch.setattr(cpa, "cpu_has_amx", lambda: True)
    assert not cpa.blocked_weights_apply(jnp.bfloat16) and cpa.blocked_weights_apply(jnp.float32)
    monkeypatch.setattr(cpa, "amx_matmul", lambda enabled=None: True)
    assert cpa.blocked_weights_apply(jnp.bfloat16) and cpa.paired_weights_apply(jnp.bfloat16)
    assert not cpa.paired_weights_apply(jnp.float32)
    assert cpa.blocked_shape(576, 1536, jnp.bfloat16) == (24, 288, 128)
    assert cpa.blocked_shape(576, 1536, jnp.float32) == (24, 576, 64)
    monkeypatch.setenv("LLMSERVE_BLOCKED_WEIGHTS", "0")
    assert not cpa.blocked_weights_apply(jnp.float32)
    monkeypatch.setattr(cpa, "blocked_matmul_supported", lambda dtype: False)
    monkeypatch.delenv("LLMSERVE_BLOCKED_WEIGHTS")
    assert not cpa.blocked_weights_apply(jnp.float32)


@needs_blocked_bf16
@needs_blocked_f32
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_blocks_its_weights_and_serves_the_same_tokens(dtype, monkeypatch):
    """``Runner`` blocks the Dense kernels on the "cpu" backend (the oracle: the same engine with
    ``LLMSERVE_BLOCKED_WEIGHTS=0``): the same greedy tokens and logprobs, bitwise; the server's
    prompt scorer, handed the runner's blocked weights, scores as with the others; and a draft
    model (the target itself) is blocked too, its greedy output the plain engine's (fp32)."""
    from llmserve import LLM, SamplingParams
    from llmserve.scoring import PromptScorer

    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    cfg = preset("tiny-gqa").replace(dtype=dtype)
    params = init_params(cfg, seed=2)
    prompts = [[5, 6, 7, 8, 9], [11, 3], [200, 17, 4, 4, 90, 31, 2]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    llm_params = {}  # each engine's weights

    def serve(blocked):
        monkeypatch.setenv("LLMSERVE_BLOCKED_WEIGHTS", "1" if blocked else "0")
        llm = LLM(params=params, model_config=cfg, tokenizer=None, warmup=False, backend="cpu",
                  max_num_seqs=4, max_model_len=64)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        ndims = {x.ndim for x in jax.tree_util.tree_leaves(llm.engine.runner.params)}
        llm_params[blocked] = llm.engine.runner.params
        scored = PromptScorer(cfg, llm.engine.runner.params, max_len=16).score(prompts[2], 2)
        return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], ndims, scored)

    got, ndims, scored = serve(True)
    want, plain_ndims, plain_scored = serve(False)
    assert 3 in ndims and 3 not in plain_ndims
    paired = {cpa.is_paired(x) for x in jax.tree_util.tree_leaves(llm_params[True])}
    assert (True in paired) == cpa.paired_weights_apply(cfg.jnp_dtype)  # bf16 on AMX tiles
    assert got == want
    assert scored == plain_scored
    monkeypatch.setenv("LLMSERVE_BLOCKED_WEIGHTS", "1")
    spec = LLM(params=params, model_config=cfg, tokenizer=None, warmup=False, backend="cpu",
               max_num_seqs=4, max_model_len=64, speculative_config={
                   "method": "draft", "model": (cfg, params), "num_speculative_tokens": 3,
                   "adaptive": False})
    draft = spec.engine.speculation.proposer.params
    assert 3 in {x.ndim for x in jax.tree_util.tree_leaves(draft)}
    outs = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ids for ids, _ in want]
    assert spec.engine.stats["spec_accepted"] > 0


# ---- the paired layout ([N / 64, K / 2, 128]) and AMX tiles (cpu_kernels.amx_matmul) ----

needs_amx = pytest.mark.skipif(not cpa.amx_matmul(),
                               reason="no AMX tiles here (the CPU, the build or the kernel)")


@pytest.fixture
def amx_restored():
    """A test that switches the AMX tiles leaves them as it found them."""
    before = cpa.amx_matmul()
    yield
    cpa.amx_matmul(before)


def test_the_paired_layout_round_trips_and_interleaves_rows_k_and_k_plus_1():
    w = np.arange(6 * 128, dtype=np.float32).reshape(6, 128)
    p = cpa.block_weight(w, paired=True)
    assert p.shape == (2, 3, 128) and p.flags["C_CONTIGUOUS"] and cpa.is_paired(p)
    assert not cpa.is_paired(cpa.block_weight(w))
    # block 1, pair row 2, column 5 of the block: (w[4, 69], w[5, 69])
    assert p[1, 2, 10] == w[4, 69] and p[1, 2, 11] == w[5, 69]
    np.testing.assert_array_equal(cpa.unblock_weight(p), w)
    np.testing.assert_array_equal(np.asarray(cpa.block_weight(jnp.asarray(w), paired=True)), p)
    np.testing.assert_array_equal(np.asarray(cpa.unblock_weight(jnp.asarray(p))), w)
    assert cpa.unblocked_shape(p) == (6, 128) == cpa.unblocked_shape(cpa.block_weight(w))
    with pytest.raises(ValueError, match="even K"):
        cpa.block_weight(w[:5], paired=True)


@needs_blocked_bf16
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (2, 576, 192), (7, 64, 128), (16, 576, 1536),
                                   (17, 1536, 576), (40, 576, 192), (100, 576, 576)])
def test_paired_weights_give_bitwise_the_blocked_layouts_results(amx, m, k, n, amx_restored):
    """The paired layout holds the pairs the blocked kernels interleave themselves, so every row
    (and the padding rows' zeros past ``live``) is bitwise the blocked call's: with the
    AVX512_BF16 kernels and, where the CPU has them, AMX tiles (row blocks of 16, a partial
    last one); and within the float32-rounding bound of the reference."""
    assert cpa.amx_matmul(amx) == amx
    x, w = _inputs(m, k, n, False, seed=m)
    paired, blocked = cpa.block_weight(w, paired=True), cpa.block_weight(w)
    run = jax.jit(cpa.matmul_bf16_cpu, static_argnums=2)
    keep = max(1, m - 3)
    np.testing.assert_array_equal(np.asarray(run(x, paired, False)),
                                  np.asarray(run(x, blocked, False)))
    out = np.asarray(run(x, paired, False, jnp.int32(keep)))
    np.testing.assert_array_equal(out, np.asarray(run(x, blocked, False, jnp.int32(keep))))
    assert not out[keep:].any()
    want = np.asarray(cpa.matmul_bf16_reference(x, paired))[:keep]  # the oracle unpairs
    assert (np.abs(out[:keep] - want) <= _bound(x, w, False)[:keep]).all()


@needs_amx
@pytest.mark.parametrize("layout", ["kn", "blocked", "paired", "nk"])
def test_amx_tiles_match_the_reference_and_keep_every_row_independent(layout, amx_restored):
    """AMX tiles on every bf16 layout ([K, N] and blocked: interleaved per work item; paired:
    read in place; the tied head's [N, K]: x interleaved once per call) against the reference,
    within the float32-rounding bound; batch invariant: rows of 1-17-row calls (row blocks of
    16, a partial last one) are bitwise those of the 40-row call. The AVX512_BF16 kernels
    (tiles off, the same compiled program) agree within the same bound."""
    t = layout == "nk"
    x, w = _inputs(40, 576, 4096 if t else 1536, t, seed=5)
    wl = {"kn": w, "nk": w, "blocked": cpa.block_weight(w),
          "paired": cpa.block_weight(w, paired=True)}[layout]
    run = jax.jit(cpa.matmul_bf16_cpu, static_argnums=2)
    want, bound = np.asarray(cpa.matmul_bf16_reference(x, w, t)), _bound(x, w, t)
    assert cpa.amx_matmul(True)
    full = np.asarray(run(x, wl, t))
    assert (np.abs(full - want) <= bound).all()
    for m in (1, 5, 16, 17):
        np.testing.assert_array_equal(np.asarray(run(x[:m], wl, t)), full[:m])
    np.testing.assert_array_equal(np.asarray(run(x[23:24], wl, t))[0], full[23])
    assert not cpa.amx_matmul(False)
    avx = np.asarray(run(x, wl, t))
    assert (np.abs(avx - want) <= bound).all()
    assert not np.array_equal(avx, full)  # another kernel really ran (its own sum order)


@needs_blocked_bf16
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
@pytest.mark.parametrize("m,live", [(1, 1), (16, 16), (40, 37)])
def test_one_call_over_paired_weights_is_bitwise_each_weights_blocked_call(amx, m, live,
                                                                             amx_restored):
    cpa.amx_matmul(amx)
    ws = [_inputs(m, 576, n, False, seed=j)[1] for j, n in enumerate((576, 192, 192))]
    x = _inputs(m, 576, 64, False, seed=9)[0]
    got = jax.jit(cpa.matmul_blocked_many)(x, [cpa.block_weight(w, paired=True) for w in ws],
                                           jnp.int32(live))
    for g, w in zip(got, ws):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(cpa.matmul_bf16_cpu(
            x, cpa.block_weight(w), False, jnp.int32(live))))


@needs_blocked_bf16
def test_bad_paired_weights_are_named():
    x, w = _inputs(3, 64, 128, False)
    p = cpa.block_weight(w, paired=True)
    with pytest.raises(ValueError, match="not transposed"):
        cpa.matmul_bf16_cpu(x, p, True)
    with pytest.raises(ValueError, match="paired"):  # float32 has no paired layout
        cpa.matmul_f32_cpu(x.astype(jnp.float32), p.astype(jnp.float32), False)
    with pytest.raises(ValueError, match="blocked weights"):  # one layout per fused call
        cpa.matmul_blocked_many(x, [p, cpa.block_weight(w)])


# ---- several blocked matmuls of one x in one call (cpu_kernels.matmul_blocked_many) ----

@pytest.mark.parametrize("dtype", [
    pytest.param(jnp.bfloat16, marks=needs_blocked_bf16),
    pytest.param(jnp.float32, marks=needs_blocked_f32)])
@pytest.mark.parametrize("m,live,k,ns", [
    (1, 1, 576, (576, 192, 192)), (7, 5, 576, (576, 192, 192)), (16, 16, 576, (1536, 1536)),
    (64, 60, 576, (576, 192, 192)), (3, 3, 64, (64,))])
def test_one_call_over_several_blocked_weights_is_bitwise_each_weights_own_call(
        dtype, m, live, k, ns):
    """Each output is bitwise the single matmul's (the same tiles in the same order), padding
    rows past ``live`` are zeros, across one to three weights, the tile sizes and the row-chunk
    split (64 rows over 15 blocks); and against the plain-jnp reference."""
    f = cpa.matmul_bf16_cpu if dtype == jnp.bfloat16 else cpa.matmul_f32_cpu
    ws = [cpa.block_weight(_inputs(m, k, n, False, seed=j, dtype=dtype)[1])
          for j, n in enumerate(ns)]
    x = _inputs(m, k, 64, False, seed=9, dtype=dtype)[0]
    got = jax.jit(cpa.matmul_blocked_many)(x, ws, jnp.int32(live))
    assert [g.shape for g in got] == [(m, n) for n in ns]
    for g, w in zip(got, ws):
        g = np.asarray(g)
        np.testing.assert_array_equal(g, np.asarray(jax.jit(f, static_argnums=2)(
            x, w, False, jnp.int32(live))))
        assert not g[live:].any()
        want = np.asarray(cpa.matmul_bf16_reference(x, w))[:live]
        assert (np.abs(g[:live] - want) <= _bound(x, cpa.unblock_weight(w), False)[:live]).all()


@needs_blocked_bf16
def test_bad_weights_for_the_fused_call_are_named(monkeypatch):
    x, w = _inputs(3, 64, 128, False)
    b = cpa.block_weight(w)
    for bad in ([b, w], [b, cpa.block_weight(_inputs(3, 96, 128, False)[1])],
                [b, b.astype(jnp.float32)], [b] * 9, []):
        with pytest.raises(ValueError, match="blocked weights"):
            cpa.matmul_blocked_many(x, bad)
    with pytest.raises(ValueError, match="blocked weights"):
        cpa.matmul_blocked_many(x.astype(jnp.float32), [b])
    monkeypatch.setenv("LLMSERVE_FUSED_MATMULS", "0")
    assert not cpa.fused_matmuls_apply([b])


@needs_blocked_bf16
@needs_blocked_f32
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_layers_qkv_and_gate_up_run_as_one_call_each_with_bitwise_the_same_logits(
        dtype, bias, monkeypatch):
    """tiny-mha (q, k, v, gate and up all blockable) with blocked kernels on the "cpu" backend:
    one fused call for q/k/v and one for gate/up per layer (2 per layer in the program, and
    the single matmuls only for o and down), bitwise the logits of the unfused program
    (``LLMSERVE_FUSED_MATMULS=0``), q/k/v biases included."""
    monkeypatch.setenv("LLMSERVE_NATIVE_MATMUL", "1")
    cfg = preset("tiny-mha").replace(dtype=dtype, qkv_bias=bias)
    params = init_params(cfg)
    if bias:  # non-zero biases, so adding them is checked
        params = jax.tree_util.tree_map_with_path(
            lambda p, v: v + 0.5 if "bias" in jax.tree_util.keystr(p) else v, params)
    blocked = cpa.block_params(params, cfg.jnp_dtype)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    meta = AttentionMetadata.for_dense(positions, jnp.full((2,), 7, jnp.int32))
    cache = DenseKVCache.create(cfg, batch=2, max_len=7)

    def program():
        return jax.jit(lambda p, t, m, c: Transformer(cfg).apply({"params": p}, t, m, c,
                                                                 backend="cpu")[0])

    fused_text = program().lower(blocked, tokens, meta, cache).as_text()
    assert fused_text.count("llmserve_matmul_blocked_many_cpu") == 2 * cfg.n_layers
    fused = np.asarray(program()(blocked, tokens, meta, cache))
    monkeypatch.setenv("LLMSERVE_FUSED_MATMULS", "0")
    assert "llmserve_matmul_blocked_many_cpu" not in program().lower(
        blocked, tokens, meta, cache).as_text()
    np.testing.assert_array_equal(fused, np.asarray(program()(blocked, tokens, meta, cache)))
    np.testing.assert_array_equal(fused, np.asarray(program()(params, tokens, meta, cache)))
