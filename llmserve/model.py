"""Flax (linen) decoder for the Llama family: GQA/MQA, RoPE, RMSNorm, SwiGLU.

Einsum letters, used in every module of llmserve:
  B batch/slots, T query tokens, S key/value tokens, N query heads, K kv heads,
  G query heads per kv head (N = K*G), H head dim, D model dim, F ffn dim, V vocab,
  P pages, L page size (tokens per page).

The model is functional: ``Transformer(cfg).apply({"params": p}, tokens, meta, cache)`` returns
``(logits, cache)``. The KV cache (dense or paged, see ``kv_cache.py``) is passed in and returned;
there are no mutable Flax collections. Attention goes through ``cache.update_and_attend``,
which writes the new K/V and calls the dispatcher in ``ops/attention.py``.

Numerics: weights and the KV cache are stored in ``cfg.dtype`` (float32 or bfloat16). Every
matmul takes its inputs in the storage dtype and accumulates in float32
(``preferred_element_type``); the residual stream, RoPE, norms, softmax and logits are float32.
No float32 copy of a bf16 weight is ever made (the embedding table is gathered, not converted).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata
from llmserve.ops import cpu_kernels

Array = jax.Array


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [H/2] (float64 on host), with Llama 3 / linear scaling applied."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, blended, out)


def rope_tables(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """cos and sin of each position's rotary angles: positions [B, T] -> two [B, T, H/2] f32.

    The model computes them once per forward and hands them to every layer. On CPU they are
    made inside a conditional, whose results XLA always materializes: computed plainly, XLA:CPU
    fuses cos and sin into every layer's RoPE and evaluates them once per rotated element
    (every head of q and k, every layer): 17 of a 256-row SmolLM2 bf16 decode step's ~315 ms,
    and 30 RoPEs of q alone at 256 rows took 11.4 ms against 0.9 with the tables materialized
    (``/tmp`` script, 2026-12-06). Both branches are the same function, so the predicate
    only has to be one XLA cannot fold."""
    def tables(pos):
        angles = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
        return jnp.cos(angles), jnp.sin(angles)

    if jax.default_backend() != "cpu" or positions.size == 0:
        return tables(positions)
    return jax.lax.cond(positions.reshape(-1)[0] >= 0, tables, tables, positions)


def apply_rope(x: Array, tables: tuple[Array, Array]) -> Array:
    """Rotates x [B, T, heads, H] by ``rope_tables`` (cos, sin [B, T, H/2]) (the "rotate
    half" convention of HF)."""
    cos, sin = tables[0][:, :, None, :], tables[1][:, :, None, :]  # [B, T, 1, H/2]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def row_sum(x: Array) -> Array:
    """The sum over x's last axis in one fixed order, whatever x's other dims: halves added
    elementwise while the length is even, then the odd rest left to right (a length whose odd
    factor exceeds 32 is first padded with zeros to a power of two, keeping the graph small).

    Why not ``jnp.sum``: XLA:CPU reduces a row in an order that depends on how many rows the
    call has (SmolLM2's RMSNorm over [N, 576]: one result for N = 1-7, another from 8 up), so
    a sequence's row rounded differently in a verify step of 2 sequences x 6 tokens than in
    their 2-row decode step, and speculative greedy output split from plain decoding at batch
    >= 2 (logprobs 0.03-0.1 apart in bf16). Elementwise adds are the same for every element of
    any shape, so this tree gives each row the same bits in any batch (tested)."""
    n = x.shape[-1]
    odd = n >> ((n & -n).bit_length() - 1) if n else 1  # n's largest odd factor
    if odd > 32:  # a long left-to-right rest: pad with zeros (exact) to a power of two instead
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << (n - 1).bit_length()) - n)])
    while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., 0]
    for i in range(1, x.shape[-1]):
        total = total + x[..., i]
    return total[..., None]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed and returned in float32 (scale stored in ``dtype``); the
    mean of squares in a fixed order (``row_sum``), so a row's result never depends on the
    rows beside it."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(row_sum(xf * xf) / xf.shape[-1] + self.eps)
        return xf * scale.astype(jnp.float32)


# XLA's CPU matrix-vector path converts a whole bf16 weight to f32 when the activation has one
# row (SmolLM2's tied head: 47 ms at 1 row vs 4 ms at 2); padding to this many rows avoids it.
MIN_BF16_ROWS = 2


def matmul_f32(x: Array, w: Array, transpose_w: bool = False,
               native: bool | str = False, live_rows: Array | None = None) -> Array:
    """x [..., D] @ w [D, F] (or w [F, D].T) -> [..., F] float32.

    x is cast to w's dtype; accumulation is float32 (``preferred_element_type``). A bf16 call with
    fewer than MIN_BF16_ROWS rows is padded (a static-shape decision, made at trace time).
    ``native`` (the "cpu" backend): a bf16 weight goes to the native bf16 matmul
    (``ops.cpu_kernels.matmul_bf16_cpu``; AVX512_BF16 or AVX2), a float32 weight to the native
    float32 one (``matmul_f32_cpu``), when this CPU has them, the shape suits them and they are
    measured faster at this row count (``cpu_kernels.native_matmul_wins``: on a CPU with AMX
    tiles XLA's dot wins bf16 from 8 rows up; on an AVX2-only CPU the native kernels win only at
    small row counts); ``native="always"`` skips that last test (the batch-invariant mode:
    every row count then takes the same kernel, whose rows never interact). Every other case
    stays on XLA's dot.

    ``live_rows`` (an int32 scalar, traced; None = all): only the first ``live_rows`` of x's
    flattened rows are real, the rest a step's bucket padding. The native kernels skip the
    padding rows (their results are zeros), so the step's matmuls cost what its real tokens
    do; XLA's dot computes every row.

    A 3-D ``w`` is a [D, F] kernel in the native kernels' blocked layout [F / 64, D, 64]
    (``cpu_kernels.block_weight``; ``Runner`` blocks a model's kernels where
    ``cpu_kernels.blocked_weights_apply``): it goes to the native matmul whenever ``native`` is
    set; elsewhere it is unblocked first (a copy: correct, not fast).
    """
    lead, d = x.shape[:-1], x.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    x2 = x.reshape(rows, d).astype(w.dtype)
    blocked = w.ndim == 3
    if blocked and not (native and not transpose_w
                        and cpu_kernels.blocked_matmul_supported(w.dtype)):
        w, blocked = cpu_kernels.unblock_weight(w), False
    f = w.shape[0] * cpu_kernels.BLOCK_COLUMNS if blocked else (
        w.shape[0] if transpose_w else w.shape[1])
    if native and native != "always" and not blocked:  # (blocked: native at every row count)
        native = cpu_kernels.native_matmul_wins(w.dtype, rows)
    if native and w.dtype == jnp.bfloat16 and cpu_kernels.matmul_bf16_supported(
            d, f, transpose_w) and cpu_kernels.has_bf16_matmul():
        return cpu_kernels.matmul_bf16_cpu(x2, w, transpose_w, live_rows).reshape(*lead, f)
    if native and w.dtype == jnp.float32 and cpu_kernels.matmul_f32_supported(
            d, f, transpose_w) and cpu_kernels.has_f32_matmul():
        return cpu_kernels.matmul_f32_cpu(x2, w, transpose_w, live_rows).reshape(*lead, f)
    if w.dtype == jnp.bfloat16 and rows < MIN_BF16_ROWS:
        x2 = jnp.pad(x2, ((0, MIN_BF16_ROWS - rows), (0, 0)))
    y = lax.dot_general(x2, w, (((1,), (1 if transpose_w else 0,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return y[:rows].reshape(*lead, y.shape[-1])


class Dense(nn.Module):
    """x @ kernel (+ bias) with the kernel in ``dtype`` and a float32 result.

    Parameter names ("kernel" [D, F], "bias" [F]) match flax's nn.Dense, so checkpoints load
    unchanged.
    """

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    native: bool | str = False  # matmul_f32's native matmuls (the "cpu" backend, unsharded)

    @nn.compact
    def __call__(self, x: Array, live_rows: Array | None = None) -> Array:
        """``live_rows``: see ``matmul_f32``. The kernel may come in the native matmuls' blocked
        layout ([F / 64, D, 64]) or paired one ([F / 64, D / 2, 128], bf16),
        ``cpu_kernels.block_weight``."""
        shape = (x.shape[-1], self.features)
        if self.has_variable("params", "kernel"):
            given = self.get_variable("params", "kernel")
            if given.ndim == 3 and cpu_kernels.unblocked_shape(given) == shape:
                shape = given.shape  # blocked or paired, whichever the runner chose
        kernel = self.param("kernel", nn.initializers.normal(0.02), shape, self.dtype)
        y = matmul_f32(x, kernel, native=self.native, live_rows=live_rows)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            y = y + bias.astype(jnp.float32)
        return y


class Embed(nn.Module):
    """Token embedding [V, D] in ``dtype``; lookups return float32 rows, ``attend`` f32 logits."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32

    def setup(self):
        self.embedding = self.param("embedding", nn.initializers.normal(0.02),
                                    (self.num_embeddings, self.features), self.dtype)

    def __call__(self, tokens: Array) -> Array:
        """tokens [B, T] -> [B, T, D] float32 (gathers rows; never converts the whole table)."""
        return jnp.take(self.embedding, tokens, axis=0).astype(jnp.float32)

    def attend(self, x: Array, native: bool | str = False,
               live_rows: Array | None = None) -> Array:
        """x [B, T, D] -> logits [B, T, V] float32 (tied output projection); ``live_rows``: see
        ``matmul_f32``."""
        return matmul_f32(x, self.embedding, transpose_w=True, native=native,
                          live_rows=live_rows)


def _dense(features: int, name: str, cfg: ModelConfig, bias: bool = False,
           native: bool | str = False) -> Dense:
    return Dense(features, use_bias=bias, dtype=cfg.jnp_dtype, native=native, name=name)


def _fused_dense(module: nn.Module, names: tuple, x: Array, live: Array | None,
                 native: bool | str) -> list | None:
    """The outputs ([..., F_j] float32) of ``module``'s child Dense layers ``names`` applied to
    x, in one native call (``cpu_kernels.matmul_blocked_many``: a layer's q/k/v or gate/up
    share the threads as one matmul's blocks do), or None where that does not apply: not the
    "cpu" backend's native matmuls, weights not yet there (``init``) or not all blocked, or
    ``LLMSERVE_FUSED_MATMULS=0``. Bitwise what the layers compute one by one."""
    if not native:
        return None
    params = module.variables.get("params", {})
    layers = [params.get(name, {}) for name in names]
    kernels = [layer.get("kernel") for layer in layers]
    if any(k is None for k in kernels) or not cpu_kernels.fused_matmuls_apply(kernels):
        return None
    lead, d = x.shape[:-1], x.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    x2 = x.reshape(rows, d).astype(kernels[0].dtype)
    outs = cpu_kernels.matmul_blocked_many(x2, kernels, live)
    result = []
    for layer, y in zip(layers, outs):
        y = y.reshape(*lead, y.shape[-1])
        if "bias" in layer:
            y = y + layer["bias"].astype(jnp.float32)
        result.append(y)
    return result


class Attention(nn.Module):
    """Grouped-query attention: N query heads over K kv heads; K/V are never repeated."""

    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x: Array, meta: AttentionMetadata, cache: Any, backend: str,
                 native_matmul: bool | str = True, rope: tuple[Array, Array] | None = None):
        """``rope``: the step's ``rope_tables`` (computed here from ``meta`` when None)."""
        cfg = self.cfg
        b, t, _ = x.shape
        n, k, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        native = backend == "cpu" and native_matmul
        live = getattr(meta, "live_tokens", None)  # a step's real tokens (the rest: padding)
        fused = _fused_dense(self, ("q_proj", "k_proj", "v_proj"), x, live, native)
        if fused is None:
            fused = [_dense(f, name, cfg, cfg.qkv_bias, native)(x, live) for f, name in
                     ((n * h, "q_proj"), (k * h, "k_proj"), (k * h, "v_proj"))]
        q, kk, vv = (y.reshape(b, t, heads, h) for y, heads in zip(fused, (n, k, k)))
        if rope is None:
            rope = rope_tables(meta.positions, rope_frequencies(cfg))
        # RoPE in f32; attention then reads q and the cache in the storage dtype (f32 dots).
        q = apply_rope(q, rope).astype(cfg.jnp_dtype)
        kk = apply_rope(kk, rope)
        out, cache = cache.update_and_attend(self.layer, q, kk, vv, meta, backend)  # [B,T,N,H]
        out = _dense(cfg.d_model, "o_proj", cfg, native=native)(out.reshape(b, t, n * h), live)
        return out, cache


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: Array, native: bool | str = False,
                 live_rows: Array | None = None) -> Array:
        """``live_rows``: see ``matmul_f32``."""
        cfg = self.cfg
        fused = _fused_dense(self, ("gate_proj", "up_proj"), x, live_rows, native)
        if fused is None:
            fused = [_dense(cfg.ffn_dim, name, cfg, native=native)(x, live_rows)
                     for name in ("gate_proj", "up_proj")]
        gate, up = fused
        return _dense(cfg.d_model, "down_proj", cfg, native=native)(nn.silu(gate) * up,
                                                                     live_rows)


class Block(nn.Module):
    """Pre-norm decoder block."""

    cfg: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x: Array, meta: AttentionMetadata, cache: Any, backend: str,
                 native_matmul: bool | str = True, rope: tuple[Array, Array] | None = None):
        cfg = self.cfg
        h = RMSNorm(cfg.norm_eps, cfg.jnp_dtype, name="attn_norm")(x)
        a, cache = Attention(cfg, self.layer, name="attn")(h, meta, cache, backend, native_matmul,
                                                           rope)
        x = x + a
        x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.norm_eps, cfg.jnp_dtype, name="mlp_norm")(x),
                                     backend == "cpu" and native_matmul,
                                     getattr(meta, "live_tokens", None))
        return x, cache


class Transformer(nn.Module):
    """The decoder: tokens [B, T] -> logits [B, T, V] (float32), cache in and out.

    ``logits_index`` (optional) selects positions before the vocabulary projection: [B] picks
    one per sequence (logits [B, 1, V], e.g. a prompt's last token), [B, R] picks R (a step's
    sampled rows over its flat tokens: logits [B, R, V]).

    ``return_hidden``: also return the last layer's output before the final norm at the same
    positions ([B, R, D] float32), or at every position with ``"all"`` ([B, T, D]): the
    feature an EAGLE draft head reads.

    ``native_matmul``: on the "cpu" backend, weight matmuls go to the native kernels where they
    apply and are measured faster (``matmul_f32``); "always" wherever they apply (the
    batch-invariant mode); False keeps XLA's dots (a sharded model: a custom call would gather
    its sharded weights).

    ``logits_rows`` (an int32 scalar, traced): only the first ``logits_rows`` of the rows
    ``logits_index`` picks are real (the rest a step's padding rows): the native vocabulary
    projection skips the others (their logits are zeros). The layers' matmuls skip the flat
    tokens past ``meta.live_tokens`` the same way (``matmul_f32``).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens: Array, meta: AttentionMetadata, cache: Any,
                 backend: str = "xla", logits_index: Array | None = None,
                 return_hidden: bool | str = False, native_matmul: bool | str = True,
                 logits_rows: Array | None = None):
        cfg = self.cfg
        embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.jnp_dtype, name="embed")
        x = embed(tokens)  # [B, T, D] float32: the residual stream stays f32
        rope = rope_tables(meta.positions, rope_frequencies(cfg))  # once for every layer
        for i in range(cfg.n_layers):
            x, cache = Block(cfg, i, name=f"layers_{i}")(x, meta, cache, backend, native_matmul,
                                                         rope)
        every = x
        if logits_index is not None:
            index = logits_index if logits_index.ndim == 2 else logits_index[:, None]
            x = jnp.take_along_axis(x, index[:, :, None].astype(jnp.int32), axis=1)
        hidden = x
        x = RMSNorm(cfg.norm_eps, cfg.jnp_dtype, name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x, native=backend == "cpu" and native_matmul,
                                  live_rows=logits_rows)
        else:
            logits = _dense(cfg.vocab_size, "lm_head", cfg,
                            native=backend == "cpu" and native_matmul)(x, logits_rows)
        if return_hidden:
            hidden = every if return_hidden == "all" else hidden
            return logits.astype(jnp.float32), cache, hidden.astype(jnp.float32)
        return logits.astype(jnp.float32), cache


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random parameters (normal(0.02) kernels, unit norms) for a config: tests and training."""
    from llmserve.kv_cache import DenseKVCache

    tokens = jnp.zeros((1, 1), jnp.int32)
    meta = AttentionMetadata.for_dense(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
    cache = DenseKVCache.create(cfg, batch=1, max_len=1)
    variables = jax.jit(Transformer(cfg).init)(jax.random.PRNGKey(seed), tokens, meta, cache)
    return variables["params"]


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Random parameters with init_params' distributions (normal(0.02) kernels and embedding,
    unit norm scales, zero biases) made leaf by leaf in ``dtype``, for benchmarks on full-size
    presets: tracing the whole model's init compiles for about 30 s on a 2-core CPU and about
    100 s on a GPU, while one small program per distinct leaf shape compiles in about a second.
    Not the same values as init_params for the same seed."""
    from llmserve.kv_cache import DenseKVCache

    tokens = jnp.zeros((1, 1), jnp.int32)
    meta = AttentionMetadata.for_dense(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
    cache = DenseKVCache.create(cfg, batch=1, max_len=1)
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(seed), tokens, meta,
                            cache)["params"]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        name = getattr(path[-1], "key", str(path[-1]))
        if name == "scale":
            out.append(jnp.ones(leaf.shape, dtype))
        elif name == "bias":
            out.append(jnp.zeros(leaf.shape, dtype))
        else:
            out.append(_scaled_normal(jax.random.fold_in(key, i), leaf.shape, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _scaled_normal(key, shape, dtype):
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
