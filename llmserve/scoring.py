"""Prompt logprobs: the log-probability of every prompt token given the tokens before it.

Log-likelihood evaluation (lm-evaluation-harness through ``echo`` + ``logprobs``, or
``max_tokens=0`` for pure scoring) needs logits at every prompt position, which the engine's
step does not produce: its prefill projects only the last token and may skip cached prefix
pages. ``PromptScorer`` runs the model once over the whole prompt with a dense cache, outside
the engine step (a side call the server makes between steps; the unified step will absorb it).

Prompts are right-padded to a few length buckets, so scoring compiles once per bucket.
Logprobs are the raw ``log_softmax`` of the logits (no temperature, no penalties), as vLLM's.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata, DenseKVCache
from llmserve.model import Transformer


@functools.partial(jax.jit, static_argnames=("cfg", "num_top", "backend"))
def score_tokens(params, tokens, length, *, cfg: ModelConfig, num_top: int,
                 backend: str = "xla"):
    """Per-position next-token logprobs of one right-padded prompt.

    tokens [1, T] int32, length [] int32 (real tokens) -> (token_logprobs [T-1]: logprob of
    tokens[t+1] at position t, top_ids [T-1, num_top], top_logprobs [T-1, num_top]). Entries at
    t >= length - 1 are padding.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    lengths = jnp.full((b,), length, jnp.int32)
    meta = AttentionMetadata.for_dense(positions, lengths, positions < lengths[:, None])
    cache = DenseKVCache.create(cfg, b, t)
    logits, _ = Transformer(cfg).apply({"params": params}, tokens, meta, cache, backend=backend)
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)  # [T-1, V]
    token_lp = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]  # [T-1]
    top_lp, top_ids = jax.lax.top_k(logp, num_top)  # [T-1, num_top]
    return token_lp, top_ids, top_lp


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of four from 64 up to ``max_len`` (which is always the last bucket)."""
    out, b = [], 64
    while b < max_len:
        out.append(b)
        b *= 4
    return tuple(out) + (max_len,)


class PromptScorer:
    """Scores prompts: ``score(ids)`` gives, per position, ``{token: logprob, top ids...}``.

    ``num_top`` is the most top-n alternatives a request may ask for (the engine's
    ``max_logprobs``); ``buckets`` are the padded prompt lengths (default ``default_buckets``).
    """

    def __init__(self, cfg: ModelConfig, params, *, max_len: int, num_top: int = 5,
                 buckets: Optional[Sequence[int]] = None, backend: str = "xla"):
        if num_top < 0:
            raise ValueError(f"PromptScorer: num_top={num_top} must be >= 0")
        self.cfg = cfg
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.max_len = int(max_len)
        self.num_top = int(num_top)
        self.buckets = tuple(sorted(buckets or default_buckets(self.max_len)))
        if self.buckets[-1] < self.max_len:
            raise ValueError(f"PromptScorer: largest bucket {self.buckets[-1]} < max_len "
                             f"{self.max_len}")
        self.backend = backend

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` tokens."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"prompt of {n} tokens exceeds the scorer's max_len {self.max_len}")

    def _run(self, ids: Sequence[int]):
        t = self.bucket(max(len(ids), 2))
        tokens = np.zeros((1, t), np.int32)
        tokens[0, : len(ids)] = ids
        # top_k needs k >= 1: compute one alternative even when none is asked for.
        return score_tokens(self.params, jnp.asarray(tokens), jnp.int32(len(ids)), cfg=self.cfg,
                            num_top=max(self.num_top, 1), backend=self.backend)

    def score(self, token_ids: Sequence[int], num_top: int = 0
              ) -> list[Optional[dict[int, float]]]:
        """Prompt logprobs in vLLM's layout: ``[None, {tok_1: lp, alt: lp, ...}, ...]``.

        Entry i (i >= 1) holds the logprob of ``token_ids[i]`` first, then the ``num_top`` most
        likely tokens at that position (the prompt token may be among them).
        """
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("PromptScorer.score: empty prompt")
        if not 0 <= num_top <= self.num_top:
            raise ValueError(f"prompt_logprobs={num_top} exceeds max_logprobs={self.num_top}")
        token_lp, top_ids, top_lp = jax.device_get(self._run(ids))
        out: list[Optional[dict[int, float]]] = [None]
        for i in range(1, len(ids)):
            entry = {ids[i]: float(token_lp[i - 1])}
            for tid, lp in zip(top_ids[i - 1][:num_top], top_lp[i - 1][:num_top]):
                entry.setdefault(int(tid), float(lp))
            out.append(entry)
        return out

    def warmup(self) -> None:
        """Compiles every bucket once."""
        for b in self.buckets:
            jax.block_until_ready(self._run([0] * b))

    @staticmethod
    def num_compilations() -> int:
        """Executables ``score_tokens`` holds, process-wide."""
        return score_tokens._cache_size()
