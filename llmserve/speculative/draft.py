"""A small llmserve model as the draft: its device functions (prefill mirror, R-token chain).

The draft's paged KV cache follows the TARGET's block tables (same page ids, its own per-layer
arrays), so it needs no allocator of its own. Letters as in ``model.py``; R draft tokens.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from llmserve import sampling
from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata, PagedKVCache
from llmserve.model import Transformer
from llmserve.sampling import SamplingArrays
from llmserve.speculative.verify import DRAFT_TAG, tagged_uniforms

Array = jax.Array


def _draft_forward(params, cache: PagedKVCache, tokens: Array, q_start: Array, n_valid: Array,
                   block_tables: Array, *, cfg: ModelConfig, backend: str):
    """Draft model over tokens [B, T] from q_start -> (last real token's logits [B, V], cache)."""
    t = tokens.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    q_start = q_start.astype(jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    meta = AttentionMetadata(positions=q_start[:, None] + ar[None, :], q_start=q_start,
                             lengths=q_start + n_valid, token_mask=ar[None, :] < n_valid[:, None],
                             block_tables=block_tables)
    logits, cache = Transformer(cfg).apply({"params": params}, tokens.astype(jnp.int32), meta,
                                           cache, backend=backend,
                                           logits_index=jnp.maximum(n_valid - 1, 0))
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("cache",))
def draft_prefill(params, cache: PagedKVCache, tokens: Array, q_start: Array, n_valid: Array,
                  block_tables: Array, *, cfg: ModelConfig, backend: str = "xla") -> PagedKVCache:
    """Writes a prompt chunk tokens [B, T] (n_valid [B] real) into the draft's paged cache."""
    return _draft_forward(params, cache, tokens, q_start, n_valid, block_tables, cfg=cfg,
                          backend=backend)[1]


@flax.struct.dataclass
class DraftOutput:
    tokens: Array  # [B, R] i32
    probs: Array  # [B, R, V] f32: q, the processed draft distribution each token came from


def draft_token(logits: Array, arrays: SamplingArrays, positions: Array,
                 counts: Optional[Array], prompt_mask: Optional[Array]):
    """q = probs_from_logits(...) [B, V] and a token drawn from it with the draft stream
    (greedy rows: the argmax). Shared by the draft model and the EAGLE head."""
    q = sampling.probs_from_logits(logits, arrays, counts, prompt_mask)
    greedy = arrays.temperature < sampling.GREEDY_EPS
    drawn = sampling.draw_from_mass(q, tagged_uniforms(arrays.seed, positions, DRAFT_TAG))
    return jnp.where(greedy, sampling.argmax(q), drawn), q


@functools.partial(jax.jit, static_argnames=("cfg", "k", "backend"),
                   donate_argnames=("cache",))
def draft_propose(params, cache: PagedKVCache, tail: Array, q_start: Array, n_valid: Array,
                  block_tables: Array, arrays: SamplingArrays,
                  output_counts: Optional[Array] = None, prompt_mask: Optional[Array] = None,
                  *, cfg: ModelConfig, k: int, backend: str = "xla"):
    """R (``k``) draft tokens per row from a small model, in one jit (a lax.scan of decode steps).

    params / cache: the draft model's parameters and its ``PagedKVCache`` (donated), addressed
    by the TARGET's block_tables [B, M] (the draft cache has the target's page count and size).
    tail [B, T] i32: committed tokens the draft cache has not seen, at q_start [B] (n_valid [B]
    real; 0 = padding row, which writes only the dummy page); draft 0 sits at q_start + n_valid.
    arrays [B]: the requests' SamplingArrays. Greedy rows draft greedily; the others draw from
    q = sampling.probs_from_logits(draft logits, arrays, counts + earlier drafts, prompt_mask)
    with key fold_in(request_keys(seed, position), draft tag). Drafts 0..R-2 enter the cache.
    Returns (DraftOutput(tokens [B, R] i32, probs [B, R, V] f32), cache).
    """
    live = n_valid > 0  # [B]
    pos0 = (q_start + n_valid).astype(jnp.int32)  # [B]: where draft 0 sits
    counts = output_counts
    if counts is None and prompt_mask is not None:
        counts = jnp.zeros(prompt_mask.shape, jnp.int32)

    # Every step runs the tail's [B, T] shape, so the model and the sampler compile once:
    # step 0 feeds the tail, step j > 0 feeds draft j-1 (one real token) at pos0 + j - 1.
    def step(carry, j):
        cache, tokens, start, count, counts = carry
        logits, cache = _draft_forward(params, cache, tokens, start, count, block_tables,
                                       cfg=cfg, backend=backend)
        tok, q = draft_token(logits, arrays, pos0 + j, counts, prompt_mask)
        if counts is not None:
            counts = sampling.update_counts(counts, tok, live)
        tokens = jnp.zeros_like(tokens).at[:, 0].set(tok)
        return (cache, tokens, pos0 + j, live.astype(jnp.int32), counts), (tok, q)

    init = (cache, tail.astype(jnp.int32), q_start.astype(jnp.int32),
            n_valid.astype(jnp.int32), counts)
    # Unrolled (R is small): as a while loop, XLA:CPU ran the bf16 steps ~3x slower
    # (SmolLM2 dims, 2 layers, batch 1, R=4: 72 ms scanned vs 21 ms unrolled; f32: equal).
    (cache, *_), (toks, qs) = jax.lax.scan(step, init, jnp.arange(k, dtype=jnp.int32),
                                           unroll=True)
    tokens = jnp.moveaxis(toks, 0, 1)  # [B, R]
    probs = jnp.moveaxis(qs, 0, 1)  # [B, R, V]
    return DraftOutput(tokens=tokens, probs=probs), cache
