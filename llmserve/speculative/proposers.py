"""Proposers behind one protocol: what the engine calls, the same way for every method."""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence

import jax
import jax.numpy as jnp

from llmserve.config import ModelConfig
from llmserve.kv_cache import PagedKVCache
from llmserve.sampling import SamplingArrays
from llmserve.speculative.draft import draft_prefill, draft_propose

Array = jax.Array


@dataclasses.dataclass
class ProposeInput:
    """What a proposer may read for one speculative step over B rows.

    ``token_ids`` is host state (the n-gram proposer reads only it). The device arrays are for a
    draft model: ``tail`` holds the committed tokens its cache has not seen yet (normally the
    last two: the token before the last is rewritten harmlessly, and the last one of a fully
    accepted step is caught up), so draft token 0 sits at ``q_start + n_valid``.
    """

    token_ids: Sequence[Sequence[int]]  # per row: prompt + output so far
    tail: Optional[Array] = None  # [B, T] i32
    q_start: Optional[Array] = None  # [B] i32: position of tail[:, 0]
    n_valid: Optional[Array] = None  # [B] i32: real tail tokens (0 = padding row)
    block_tables: Optional[Array] = None  # [B, M] i32: the TARGET's pages
    sampling: Optional[SamplingArrays] = None  # [B]
    output_counts: Optional[Array] = None  # [B, V] i32
    prompt_mask: Optional[Array] = None  # [B, V] bool


@dataclasses.dataclass
class Proposal:
    """K guesses per row, as ``verify`` takes them."""

    tokens: Array  # [B, K] i32 (padding past num_draft)
    num_draft: Array  # [B] i32
    probs: Optional[Array] = None  # [B, K, V] f32, or None for a deterministic proposer


class Proposer(Protocol):
    """Guesses ``k`` tokens per row for the verifier."""

    k: int

    def propose(self, batch: ProposeInput) -> Proposal:
        """Draft tokens (and their distributions, if any) for every row of ``batch``."""
        ...


class DraftModelProposer:
    """A small llmserve model as the proposer; owns its paged KV cache (target's page ids).

    The engine keeps it in step with the target: ``prefill`` on every prompt chunk the target
    prefills, ``copy_pages`` on every copy-on-write, and ``propose`` before each verify step.
    """

    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int, k: int,
                 backend: str = "xla", target_vocab: Optional[int] = None):
        if target_vocab is not None and target_vocab != cfg.vocab_size:
            raise ValueError(f"draft vocab {cfg.vocab_size} != target vocab {target_vocab}")
        self.cfg, self.k, self.backend = cfg, k, backend
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.cache = PagedKVCache.create(cfg, num_pages, page_size)

    def prefill(self, tokens: Array, q_start: Array, n_valid: Array, block_tables: Array) -> None:
        """Writes a prompt chunk [B, T] into the draft cache (same rows as the target's chunk)."""
        self.cache = draft_prefill(self.params, self.cache, tokens, q_start, n_valid,
                                   block_tables, cfg=self.cfg, backend=self.backend)

    def copy_pages(self, src: Array, dst: Array) -> None:
        """Copy-on-write, mirroring the target cache's copies."""
        self.cache = self.cache.copy_pages(src, dst)

    def propose(self, batch: ProposeInput) -> Proposal:
        out, self.cache = draft_propose(
            self.params, self.cache, batch.tail, batch.q_start, batch.n_valid,
            batch.block_tables, batch.sampling, batch.output_counts, batch.prompt_mask,
            cfg=self.cfg, k=self.k, backend=self.backend)
        num = jnp.where(batch.n_valid > 0, self.k, 0).astype(jnp.int32)
        return Proposal(tokens=out.tokens, num_draft=num, probs=out.probs)
