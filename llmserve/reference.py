"""The reference generate loop: a dense cache, one padded batch, greedy or temperature sampling.

It is the correctness oracle for the engine (paged cache, continuous batching, speculation) and
the "naive" baseline in benchmarks. It does no paging and no scheduling: all prompts are
prefilled together (right-padded), then decoded in lock step until every sequence is done.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata, DenseKVCache
from llmserve.model import Transformer


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("cache",))
def prefill_dense(params, tokens, lengths, cache, *, cfg: ModelConfig, backend: str = "xla"):
    """tokens [B, T] right-padded, lengths [B] -> (last-token logits [B, V], cache)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    meta = AttentionMetadata.for_dense(positions, lengths, positions < lengths[:, None])
    logits, cache = Transformer(cfg).apply({"params": params}, tokens, meta, cache,
                                           backend=backend, logits_index=lengths - 1)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("cache",))
def decode_dense(params, tokens, positions, cache, *, cfg: ModelConfig, backend: str = "xla"):
    """tokens [B], positions [B] -> (logits [B, V], cache)."""
    meta = AttentionMetadata.for_dense(positions[:, None], positions + 1)
    logits, cache = Transformer(cfg).apply({"params": params}, tokens[:, None], meta, cache,
                                           backend=backend)
    return logits[:, 0], cache


def forward_dense(params, tokens: np.ndarray, cfg: ModelConfig, backend: str = "xla"):
    """Full-sequence logits [B, T, V] for unpadded tokens [B, T] (parity tests)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    meta = AttentionMetadata.for_dense(positions, jnp.full((b,), t, jnp.int32))
    cache = DenseKVCache.create(cfg, b, t)
    logits, _ = jax.jit(Transformer(cfg).apply, static_argnames=("backend",))(
        {"params": params}, tokens, meta, cache, backend=backend)
    return logits


def generate_reference(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                       eos_token_ids: Sequence[int] = (), backend: str = "xla"
                       ) -> list[list[int]]:
    """Generates up to ``max_new_tokens`` per prompt; stops a row at any of ``eos_token_ids``.

    Greedy when ``temperature == 0``; otherwise samples softmax(logits / temperature) with
    key fold_in(PRNGKey(seed), position).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_reference needs non-empty prompts")
    b = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    t = int(lens.max())
    if cfg.sliding_window is not None and t + max_new_tokens > cfg.sliding_window:
        raise ValueError(f"{t + max_new_tokens} tokens exceed the model's sliding_window="
                         f"{cfg.sliding_window}; sliding-window attention is not implemented")
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    cache = DenseKVCache.create(cfg, b, t + max_new_tokens)
    logits, cache = prefill_dense(params, jnp.asarray(tokens), jnp.asarray(lens), cache,
                                  cfg=cfg, backend=backend)
    outputs: list[list[int]] = [[] for _ in range(b)]
    done = np.zeros(b, bool)
    positions = lens.copy()
    base_key = jax.random.PRNGKey(seed)
    eos = set(int(e) for e in eos_token_ids)
    for _ in range(max_new_tokens):
        if temperature > 0:
            keys = jax.vmap(lambda p: jax.random.fold_in(base_key, p))(jnp.asarray(positions))
            nxt = jax.vmap(jax.random.categorical)(keys, logits / temperature)
        else:
            nxt = jnp.argmax(logits, axis=-1)
        nxt = np.asarray(nxt)
        for i in range(b):
            if not done[i]:
                outputs[i].append(int(nxt[i]))
                done[i] = int(nxt[i]) in eos
        if done.all():
            break
        logits, cache = decode_dense(params, jnp.asarray(nxt, jnp.int32),
                                     jnp.asarray(positions), cache, cfg=cfg, backend=backend)
        positions = positions + 1
    return outputs
