"""An EAGLE-style draft head (Li et al. 2024, EAGLE-1): device functions, loader and saver.

The head drafts from the TARGET's features. The target's feature at position p is ``h_p``, its
last decoder layer's output before the final norm (``Transformer(..., return_hidden=True)``).
Alignment (the engine relies on it):

* the head's input at position p is ``fc(concat(h_p, embed(x_{p+1})))`` (fc: 2D -> D, with
  bias); one pre-norm decoder block (``llmserve.model.Block``, a 1-layer config, so attention
  goes through the same paged / dense caches and backends) turns it into ``f_{p+1}``, a
  prediction of ``h_{p+1}``;
* its K/V is stored at position p+1 of the head's own cache (RoPE position p+1). Position 0
  holds the input of p = -1, whose feature ``h_{-1}`` is defined as ZERO: a sequence's first
  head input is (features = 0, next token = x_0) at q_start = 0, so no cache slot is ever read
  before it is written;
* draft logits = final_norm(f) @ E[vocab_map]^T with the target's final norm and tied
  embedding E [V, D] (frozen, passed in, never part of the head's params); vocab_map [Vd] int32
  is the reduced draft vocabulary (sorted target ids; Vd = V allowed). Draft logits at output
  position q therefore predict the token at q + 1, like the target's logits at q.

The head's paged cache is a 1-layer ``PagedKVCache`` addressed by the TARGET's block tables
and page ids (as ``draft.py`` does for a draft model). Letters as in ``model.py``; R draft
tokens, Vd the draft vocabulary.

Files (``save_eagle`` / ``load_eagle``): ``<dir>/eagle.json`` (EagleConfig fields and a format
version), ``<dir>/vocab_map.npy`` (int32 [Vd]) and ``<dir>/params/`` (an Orbax param tree).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from llmserve import sampling
from llmserve.config import ModelConfig, RopeScaling, resolve_dtype
from llmserve.kv_cache import AttentionMetadata, DenseKVCache, PagedKVCache
from llmserve.model import Block, Dense, RMSNorm, matmul_f32
from llmserve.sampling import SamplingArrays
from llmserve.speculative.draft import DraftOutput, draft_token

Array = jax.Array

FORMAT_VERSION = 1
_INT_FIELDS = ("vocab_size", "draft_vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim",
               "ffn_dim")


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """The head's shape: the target's dims (V its vocabulary, Vd the draft's), one layer."""

    vocab_size: int  # V: the target's vocabulary
    draft_vocab_size: int  # Vd <= V: rows of vocab_map
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    dtype: str = "float32"
    max_position_embeddings: int = 2048

    def __post_init__(self):
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"EagleConfig.{name} must be a positive int, got {value!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"EagleConfig.draft_vocab_size={self.draft_vocab_size} exceeds "
                             f"vocab_size={self.vocab_size}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"EagleConfig.n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if not self.norm_eps > 0:
            raise ValueError(f"EagleConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"EagleConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        try:
            resolve_dtype(self.dtype)
        except (ValueError, TypeError) as e:
            raise ValueError(f"EagleConfig.dtype={self.dtype!r}: {e}") from None

    @classmethod
    def from_target(cls, cfg: ModelConfig, draft_vocab_size: Optional[int] = None,
                    dtype: Optional[str] = None) -> "EagleConfig":
        """The head for target ``cfg``: its d_model, heads, head_dim, ffn_dim, RoPE, norm eps
        and dtype (``dtype`` overrides, e.g. float32 for training); Vd defaults to V."""
        vd = cfg.vocab_size if draft_vocab_size is None else draft_vocab_size
        return cls(vocab_size=cfg.vocab_size, draft_vocab_size=vd, d_model=cfg.d_model,
                   n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                   ffn_dim=cfg.ffn_dim, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                   norm_eps=cfg.norm_eps, dtype=dtype or cfg.dtype,
                   max_position_embeddings=cfg.max_position_embeddings)

    def replace(self, **kwargs) -> "EagleConfig":
        """A copy with fields replaced (validated again)."""
        return dataclasses.replace(self, **kwargs)

    @property
    def jnp_dtype(self):
        return resolve_dtype(self.dtype)

    def block_config(self) -> ModelConfig:
        """The 1-layer ModelConfig of the head's decoder block (and of its KV cache)."""
        return ModelConfig(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=1,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           head_dim=self.head_dim, ffn_dim=self.ffn_dim,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           norm_eps=self.norm_eps, dtype=self.dtype, tie_embeddings=True,
                           max_position_embeddings=self.max_position_embeddings)

    def to_dict(self) -> dict:
        """JSON-ready fields (rope_scaling as a dict or None)."""
        d = dataclasses.asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EagleConfig":
        """Inverse of ``to_dict``; unknown keys raise ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"EagleConfig: unknown fields {sorted(unknown)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


class EagleHead(nn.Module):
    """fc(concat(feature, token embedding)) -> one pre-norm decoder block -> f [B, T, D] f32."""

    ecfg: EagleConfig

    @nn.compact
    def __call__(self, features: Array, embeds: Array, meta: AttentionMetadata, cache: Any,
                 backend: str):
        x = jnp.concatenate([features.astype(jnp.float32), embeds], axis=-1)  # [B, T, 2D]
        x = Dense(self.ecfg.d_model, use_bias=True, dtype=self.ecfg.jnp_dtype, name="fc")(x)
        return Block(self.ecfg.block_config(), 0, name="block")(x, meta, cache, backend)


def _table(x: Any, key: str) -> Array:
    """A target param given as the array or as its params subtree ({key: array})."""
    return x[key] if isinstance(x, Mapping) else x


def init_head_params(ecfg: EagleConfig, seed: int = 0) -> dict:
    """Random head parameters: fc {kernel [2D, D], bias [D]} and block (a 1-layer Block)."""
    b, d = 1, ecfg.d_model
    meta = AttentionMetadata.for_dense(jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))
    cache = DenseKVCache.create(ecfg.block_config(), batch=b, max_len=1)
    x = jnp.zeros((b, 1, d), jnp.float32)
    init = jax.jit(functools.partial(EagleHead(ecfg).init, backend="reference"))
    return init(jax.random.PRNGKey(seed), x, x, meta, cache)["params"]


def create_cache(ecfg: EagleConfig, num_pages: int, page_size: int) -> PagedKVCache:
    """The head's paged cache: one layer, the target's page count and page size."""
    return PagedKVCache.create(ecfg.block_config(), num_pages, page_size)


def draft_logits(f: Array, target_embed: Any, target_norm: Any, vocab_map: Array,
                 ecfg: EagleConfig) -> Array:
    """final_norm(f [..., D]) @ E[vocab_map]^T -> [..., Vd] float32 (target's norm and E)."""
    scale = _table(target_norm, "scale")
    x = RMSNorm(ecfg.norm_eps, scale.dtype).apply({"params": {"scale": scale}}, f)
    head = jnp.take(_table(target_embed, "embedding"), vocab_map.astype(jnp.int32), axis=0)
    return matmul_f32(x, head, transpose_w=True)


def _head_meta(q_start: Array, n_valid: Array, t: int, block_tables: Optional[Array]):
    """Output t of row b at position q_start[b] + t; n_valid[b] real inputs."""
    ar = jnp.arange(t, dtype=jnp.int32)
    q_start = q_start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    return AttentionMetadata(positions=q_start[:, None] + ar[None, :], q_start=q_start,
                             lengths=q_start + n_valid, token_mask=ar[None, :] < n_valid[:, None],
                             block_tables=block_tables)


def run_head(head_params, target_embed: Any, cache: Any, features: Array, next_tokens: Array,
              meta: AttentionMetadata, ecfg: EagleConfig, backend: str):
    """The head over inputs [B, T] (features [B, T, D], next tokens [B, T]) -> (f, cache).

    ``meta`` is any attention metadata the model's blocks take (row-form, or a step's
    ragged flat tokens with batch dim 1, as the runner passes it)."""
    table = _table(target_embed, "embedding")
    tokens = jnp.clip(next_tokens.astype(jnp.int32), 0, table.shape[0] - 1)
    embeds = jnp.take(table, tokens, axis=0).astype(jnp.float32)  # [B, T, D]
    return EagleHead(ecfg).apply({"params": head_params}, features, embeds, meta, cache, backend)


def eagle_forward(head_params, target_embed: Any, target_norm: Any, vocab_map: Array,
                  cache: PagedKVCache, features: Array, next_tokens: Array, q_start: Array,
                  n_valid: Array, block_tables: Array, *, ecfg: EagleConfig,
                  backend: str = "xla"):
    """The head at engine time (paged cache) -> (f [B, T, D] f32, logits [B, T, Vd] f32, cache).

    Input t of row b is (features[b, t] = h_p, next_tokens[b, t] = x_{p+1}) with
    p + 1 = q_start[b] + t: its K/V is written at position p + 1 (the output's position).
    n_valid [B]: real inputs (0 = padding row, which writes only the dummy page 0).
    block_tables [B, M]: the TARGET's. target_embed: E [V, D] (or {"embedding": E});
    target_norm: the final norm's scale [D] (or {"scale": ...}). Pure and jittable.
    """
    meta = _head_meta(q_start, n_valid, features.shape[1], block_tables)
    f, cache = run_head(head_params, target_embed, cache, features, next_tokens, meta, ecfg,
                         backend)
    return f, draft_logits(f, target_embed, target_norm, vocab_map, ecfg), cache


def eagle_forward_dense(head_params, target_embed: Any, target_norm: Any, vocab_map: Array,
                        features: Array, next_tokens: Array, *, ecfg: EagleConfig,
                        backend: str = "reference"):
    """The training-time forward: whole sequences, dense causal attention, no cache kept.

    features [B, T, D] / next_tokens [B, T] are inputs for outputs at positions 0..T-1, i.e.
    features[:, 0] = h_{-1} = 0, features[:, t] = h_{t-1}, next_tokens[:, t] = x_t. Right padding
    is harmless (causal). Returns (f [B, T, D] f32, logits [B, T, Vd] f32), the same function as
    ``eagle_forward`` run over the same inputs in any chunking.
    """
    b, t = next_tokens.shape
    meta = _head_meta(jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32), t, None)
    cache = DenseKVCache.create(ecfg.block_config(), b, t)
    f, _ = run_head(head_params, target_embed, cache, features, next_tokens, meta, ecfg,
                     backend)
    return f, draft_logits(f, target_embed, target_norm, vocab_map, ecfg)


@functools.partial(jax.jit, static_argnames=("ecfg", "backend"), donate_argnames=("cache",))
def eagle_prefill(head_params, target_embed: Any, cache: PagedKVCache, features: Array,
                  next_tokens: Array, q_start: Array, n_valid: Array, block_tables: Array, *,
                  ecfg: EagleConfig, backend: str = "xla") -> PagedKVCache:
    """Writes head inputs [B, T] (as ``eagle_forward``) into the head's cache (donated)."""
    meta = _head_meta(q_start, n_valid, features.shape[1], block_tables)
    return run_head(head_params, target_embed, cache, features, next_tokens, meta, ecfg,
                     backend)[1]


def scatter_logits(logits: Array, vocab_map: Array, vocab_size: int) -> Array:
    """Draft logits [B, Vd] -> [B, V] over target ids (-inf outside vocab_map)."""
    full = jnp.full((logits.shape[0], vocab_size), -jnp.inf, jnp.float32)
    return full.at[:, vocab_map.astype(jnp.int32)].set(logits.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("ecfg", "num_draft", "backend", "with_probs"),
                   donate_argnames=("cache",))
def eagle_propose(head_params, target_embed: Any, target_norm: Any, vocab_map: Array,
                  cache: PagedKVCache, features: Array, next_tokens: Array, q_start: Array,
                  n_valid: Array, block_tables: Array, arrays: SamplingArrays,
                  output_counts: Optional[Array] = None, prompt_mask: Optional[Array] = None, *,
                  ecfg: EagleConfig, num_draft: int, backend: str = "xla",
                  with_probs: bool = True):
    """R = num_draft draft tokens per row from the head, in one jit (tail + an unrolled chain).

    The tail: head inputs (features [B, T, D], next_tokens [B, T]) of committed positions the
    head cache has not seen, outputs at q_start [B] + t (n_valid [B] real; 0 = padding row,
    which writes only the dummy page), as in ``eagle_forward``. Its last real output, at
    pos0 - 1 with pos0 = q_start + n_valid, gives draft 0 (at pos0); chain step j >= 1 feeds
    (f of the previous step, draft j-1) at position pos0 + j - 1 and gives draft j. Drafts
    0..R-2 enter the cache (the next tail overwrites them with the target's features).

    arrays [B]: SamplingArrays. Greedy rows draft the argmax; the others draw from
    q = sampling.probs_from_logits(draft logits, arrays, counts + earlier drafts, prompt_mask)
    with the draft stream ``tagged_uniforms(seed, position, DRAFT_TAG)`` (as ``draft.py``).
    The sampling runs over the Vd draft tokens (counts and prompt_mask [B, V] gathered through
    vocab_map): the law of the logits scattered into V (-inf elsewhere), at a Vd/V of the cost.
    Returns (DraftOutput(tokens [B, R] i32 in TARGET ids, probs [B, R, V] f32 (q scattered
    through vocab_map), or None when with_probs=False (greedy-only batches skip the [B, R, V]
    output)), cache).
    """
    live = n_valid > 0  # [B]
    q_start = q_start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    pos0 = q_start + n_valid  # [B]: where draft 0 sits
    vocab_map = vocab_map.astype(jnp.int32)
    counts = None if output_counts is None else output_counts[:, vocab_map]  # [B, Vd]
    pmask = None if prompt_mask is None else prompt_mask[:, vocab_map]  # [B, Vd]
    if counts is None and pmask is not None:
        counts = jnp.zeros(pmask.shape, jnp.int32)
    head = jnp.take(_table(target_embed, "embedding"), vocab_map, axis=0)  # [Vd, D], once
    scale = _table(target_norm, "scale")

    def pick(f, j, counts):  # f [B, D] -> draft j in target ids [B], q [B, Vd]
        x = RMSNorm(ecfg.norm_eps, scale.dtype).apply({"params": {"scale": scale}}, f)
        idx, q = draft_token(matmul_f32(x, head, transpose_w=True), arrays, pos0 + j, counts,
                             pmask)
        if counts is not None:
            counts = sampling.update_counts(counts, idx, live)
        return vocab_map[idx], q, counts

    meta = _head_meta(q_start, n_valid, features.shape[1], block_tables)
    f, cache = run_head(head_params, target_embed, cache, features, next_tokens, meta, ecfg,
                         backend)
    last = jnp.maximum(n_valid - 1, 0)
    f_last = jnp.take_along_axis(f, last[:, None, None], axis=1)[:, 0]  # [B, D]
    tok0, q0, counts = pick(f_last, 0, counts)

    def step(carry, j):
        cache, f_prev, tok, counts = carry
        meta = _head_meta(pos0 + j - 1, live.astype(jnp.int32), 1, block_tables)
        f, cache = run_head(head_params, target_embed, cache, f_prev[:, None], tok[:, None],
                             meta, ecfg, backend)
        tok, q, counts = pick(f[:, 0], j, counts)
        return (cache, f[:, 0], tok, counts), (tok, q if with_probs else None)

    steps = jnp.arange(1, num_draft, dtype=jnp.int32)
    # Unrolled (R is small): as a while loop, XLA:CPU ran each bf16 chain step ~10x slower
    # than the same step outside it (SmolLM2 dims, batch 1: 20 ms vs 1.8 ms).
    (cache, *_), (toks, qs) = jax.lax.scan(step, (cache, f_last, tok0, counts), steps,
                                           unroll=True)
    tokens = jnp.concatenate([tok0[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)  # [B, R]
    probs = None
    if with_probs:
        q = jnp.concatenate([q0[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)  # [B, R, Vd]
        probs = jnp.zeros(q.shape[:2] + (ecfg.vocab_size,), jnp.float32)
        probs = probs.at[:, :, vocab_map].set(q)  # [B, R, V]
    return DraftOutput(tokens=tokens.astype(jnp.int32), probs=probs), cache


# ------------------------------------------------------------------------------ files
def save_eagle(path: str, ecfg: EagleConfig, head_params, vocab_map,
               extra: Optional[Mapping[str, Any]] = None) -> str:
    """Writes ``path`` (replaced if it exists): eagle.json, vocab_map.npy, params/ (Orbax).

    ``extra``: JSON-able notes stored in eagle.json (e.g. the target and the training run).
    """
    from llmserve.checkpoint import save_params

    vocab_map = np.asarray(vocab_map, np.int32)
    check_vocab_map(vocab_map, ecfg)
    path = os.path.abspath(path)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    save_params(os.path.join(path, "params"), jax.device_get(head_params))
    np.save(os.path.join(path, "vocab_map.npy"), vocab_map)
    with open(os.path.join(path, "eagle.json"), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "config": ecfg.to_dict(),
                   "extra": dict(extra or {})}, f, indent=2)
    return path


def load_eagle(path: str, dtype: Optional[str] = None) -> tuple[EagleConfig, dict, np.ndarray]:
    """(EagleConfig, head params (numpy), vocab_map int32 [Vd]) from a ``save_eagle`` folder.

    ``dtype`` (e.g. the target's ``cfg.dtype``): the config and params cast to it (heads are
    trained and saved in float32); None keeps the saved dtype.
    """
    from llmserve.checkpoint import restore_params

    meta_path = os.path.join(path, "eagle.json")
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path}: not an EAGLE head folder (no eagle.json)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')!r}, "
                         f"expected {FORMAT_VERSION}")
    ecfg = EagleConfig.from_dict(meta["config"])
    vocab_map = np.load(os.path.join(path, "vocab_map.npy")).astype(np.int32)
    check_vocab_map(vocab_map, ecfg)
    params = restore_params(os.path.join(path, "params"))
    if dtype is not None:
        ecfg = ecfg.replace(dtype=dtype)
        params = jax.tree_util.tree_map(
            lambda x: np.asarray(jnp.asarray(x, ecfg.jnp_dtype)), params)
    return ecfg, params, vocab_map


def check_vocab_map(vocab_map: np.ndarray, ecfg: EagleConfig) -> None:
    """ValueError unless vocab_map is [Vd] strictly increasing ids in [0, V)."""
    vm = np.asarray(vocab_map)
    if vm.shape != (ecfg.draft_vocab_size,):
        raise ValueError(f"vocab_map shape {vm.shape} != [draft_vocab_size] = "
                         f"[{ecfg.draft_vocab_size}]")
    if vm.size and (vm.min() < 0 or vm.max() >= ecfg.vocab_size or np.any(np.diff(vm) <= 0)):
        raise ValueError(f"vocab_map must hold strictly increasing ids in [0, {ecfg.vocab_size})")


def frequent_vocab(token_lists, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """vocab_map: the ``draft_vocab_size`` most frequent ids of ``token_lists`` (ties and
    unseen ids filled by smallest id), sorted by id, int32 [Vd]."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {vocab_size}]")
    counts = np.zeros(vocab_size, np.int64)
    for toks in token_lists:
        np.add.at(counts, np.asarray(toks, np.int64), 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id
    return np.sort(order[:draft_vocab_size]).astype(np.int32)
