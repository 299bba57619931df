"""Speculative decoding: the pure verifier, and the proposers (n-gram prompt lookup, draft model).

One speculative step for a row at position ``pos`` (the position draft token 0 would take):
  1. a proposer guesses K tokens x_0..x_{K-1} (and, for a draft model, their distributions q);
  2. the target model scores [last committed token, x_0..x_{K-1}] in one forward pass, giving
     logits [K+1, V] for positions pos..pos+K;
  3. ``verify`` accepts a prefix of the guesses and appends one token from the target, so every
     step yields 1..K+1 tokens whose distribution is exactly the target's (lossless).

Letters as in ``model.py``: B slots, K draft tokens (K+1 verified positions), V vocab.

The verifier is a pure, jittable function of fixed-shape arrays: greedy and sampled rows, every
sampling parameter and every value of K's padding are arrays, never Python branches. Its
randomness is drawn like the sampler's, from ``sampling.request_keys(seed, position)``, folded
with a stream tag per use (acceptance uniform, residual draw, draft draw), so a request's tokens
depend on its seed and positions only, never on the batch it shares.

Proposers sit behind ``Proposer``: ``propose(ProposeInput) -> Proposal``. ``NgramProposer`` is
host numpy (no model); ``DraftModelProposer`` runs a small llmserve model whose paged KV cache
follows the TARGET's block tables (same page ids, its own per-layer arrays).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llmserve import sampling
from llmserve.config import ModelConfig
from llmserve.kv_cache import AttentionMetadata, PagedKVCache
from llmserve.model import Transformer
from llmserve.sampling import SamplingArrays

Array = jax.Array

# Stream tags folded into request_keys(seed, position): independent randomness per use.
_ACCEPT_TAG = 1  # acceptance uniform of the draft token at a position
_RESIDUAL_TAG = 2  # the correction / bonus draw at a position
_DRAFT_TAG = 3  # the draft model's own draw at a position

PAD_TOKEN = -1  # out_tokens after the last emitted token


# ---------------------------------------------------------------------------------- verifier
@flax.struct.dataclass
class VerifyOutput:
    """What ``verify`` returns: row b emits out_tokens[b, :num_accepted[b] + 1]."""

    num_accepted: Array  # [B] i32, 0..K: draft tokens accepted
    out_tokens: Array  # [B, K+1] i32: accepted drafts, then the target's token, then -1
    logprobs: Array  # [B, K+1] f32: raw target log p of out_tokens (0 at padding)


def _repeat_rows(arrays: SamplingArrays, times: int) -> SamplingArrays:
    """[B] per-slot parameters -> [B*times] (row b*times + j is slot b)."""
    return jax.tree_util.tree_map(lambda x: jnp.repeat(x, times, axis=0), arrays)


def _tagged_uniforms(seed: Array, positions: Array, tag: int) -> Array:
    """Uniforms in [0, 1) of shape positions.shape ([B] or [B, T]) from (seed [B], position)."""
    shape = positions.shape
    seeds = jnp.broadcast_to(seed.reshape((-1,) + (1,) * (len(shape) - 1)), shape)
    keys = sampling.request_keys(seeds.reshape(-1), positions.reshape(-1))  # [n, 2]
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, tag)
    return jax.vmap(jax.random.uniform)(keys).reshape(shape)


# Draws from unnormalized masses [B, V] with one uniform [B] per row (no sort, no noise).
_draw = sampling.draw_from_mass


def _penalties_active(arrays: SamplingArrays) -> Array:
    """[B] bool: the row has a repetition, frequency or presence penalty."""
    return ((arrays.repetition_penalty != 1.0) | (arrays.frequency_penalty != 0.0)
            | (arrays.presence_penalty != 0.0))


def _penalize_drafts(logits: Array, arrays: SamplingArrays, output_counts: Array,
                     prompt_mask: Array, drafts: Array, valid: Array) -> Array:
    """sampling.apply_penalties on target logits [B, K+1, V], unconditionally.

    Position j is penalized as the plain sampler would after generating drafts 0..j-1: those
    (valid [B, K]) tokens are added to output_counts [B, V] for it; prompt_mask [B, V] is shared.
    """
    b, t, v = logits.shape
    k = drafts.shape[1]
    counts = jnp.broadcast_to(output_counts[:, None, :], (b, t, v)).astype(jnp.int32)
    bi = jnp.arange(b)[:, None, None]
    ji = jnp.arange(t)[None, :, None]
    ii = jnp.arange(k)[None, None, :]
    earlier = ((ii < ji) & valid[:, None, :]).astype(jnp.int32)  # [B, K+1, K]
    counts = counts.at[bi, ji, drafts[:, None, :]].add(earlier)
    pmask = jnp.broadcast_to(prompt_mask[:, None, :], (b, t, v))
    out = sampling.apply_penalties(logits.reshape(b * t, v), _repeat_rows(arrays, t),
                                   counts.reshape(b * t, v), pmask.reshape(b * t, v))
    return out.reshape(b, t, v)


def _leading_true(x: Array) -> Array:
    """Length of the all-True prefix of each row: [B, K] bool -> [B] i32."""
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=1), axis=1)


def _pick(x: Array, n: Array) -> Array:
    """x[b, n[b]]: [B, T] and [B] -> [B]."""
    return jnp.take_along_axis(x, n[:, None], axis=1)[:, 0]


def _accept(logits: Array, drafts: Array, valid: Array, draft_probs: Optional[Array],
            arrays: SamplingArrays, positions: Array) -> tuple[Array, Array]:
    """(num_accepted [B], target token [B]) from penalized target logits [B, K+1, V]."""
    b, t, v = logits.shape
    k = t - 1
    greedy = arrays.temperature < sampling.GREEDY_EPS  # [B]
    target_top = sampling.argmax(logits.reshape(b * t, v)).reshape(b, t)
    n_greedy = _leading_true(valid & (drafts == target_top[:, :k]))  # [B]
    tok_greedy = _pick(target_top, n_greedy)

    def sampled(_):
        # p = softmax(process_logits(...)): probs_from_logits for sampled rows (penalties are
        # already applied; greedy rows are overridden below). Only p(x_j) and row n are needed.
        proc = sampling.process_logits(logits.reshape(b * t, v), _repeat_rows(arrays, t))
        proc = proc.reshape(b, t, v)
        lse = sampling.logsumexp(proc.reshape(b * t, v)).reshape(b, t)  # [B, K+1]
        p_x = jnp.exp(jnp.take_along_axis(proc[:, :k], drafts[..., None], axis=-1)[..., 0]
                      - lse[:, :k])  # [B, K]
        if draft_probs is None:
            q_x = jnp.ones((b, k), jnp.float32)
        else:
            q_x = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        steps = jnp.arange(k, dtype=jnp.int32)
        u = _tagged_uniforms(arrays.seed, positions[:, None] + steps[None, :], _ACCEPT_TAG)
        # Accept x ~ q with probability min(1, p(x) / q(x)), i.e. u * q(x) < p(x), u ~ U[0, 1).
        # At the first rejection draw from norm(max(p - q, 0)); if all K pass, the bonus from p.
        n = _leading_true(valid & (u * q_x < p_x))  # [B]
        proc_n = jnp.take_along_axis(proc, n[:, None, None], axis=1)[:, 0]  # [B, V]
        p_n = jnp.exp(proc_n - _pick(lse, n)[:, None])
        if draft_probs is None:
            q_n = jax.nn.one_hot(_pick(jnp.pad(drafts, ((0, 0), (0, 1))), n), v)
        else:
            q_idx = jnp.minimum(n, k - 1)[:, None, None]
            q_n = jnp.take_along_axis(draft_probs, q_idx, axis=1)[:, 0]
        q_n = jnp.where((n < jnp.sum(valid, axis=1))[:, None], q_n, 0.0)  # no rejection: p
        residual = jnp.maximum(p_n - q_n, 0.0)
        # p == q up to rounding leaves (almost) no residual; then p itself is the right law.
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
        tok = _draw(residual, _tagged_uniforms(arrays.seed, positions + n, _RESIDUAL_TAG))
        return jnp.where(greedy, n_greedy, n), jnp.where(greedy, tok_greedy, tok)

    return jax.lax.cond(jnp.all(greedy), lambda _: (n_greedy, tok_greedy), sampled, None)


def verify(
    draft_tokens: Array,
    draft_probs: Optional[Array],
    target_logits: Array,
    arrays: SamplingArrays,
    positions: Array,
    output_counts: Optional[Array] = None,
    prompt_mask: Optional[Array] = None,
    *,
    num_draft: Optional[Array] = None,
) -> VerifyOutput:
    """Accepts a prefix of the draft tokens and appends one target token (lossless).

    draft_tokens [B, K] i32; draft_probs [B, K, V] f32, the draft's distribution q after its own
    sampling processing (``sampling.probs_from_logits`` with the same arrays), or None for a
    deterministic proposer (n-gram: q is a point mass on the draft token); target_logits
    [B, K+1, V], row j scoring position positions + j; positions [B] i32, where draft 0 sits;
    output_counts [B, V] i32 / prompt_mask [B, V] bool as for ``sampling.sample`` (the drafts
    before position j count as generated for it); num_draft [B] i32 (default K): drafts past it
    are padding and never accepted (n-gram proposers may find fewer than K).

    Greedy rows (temperature < 1e-5) accept while the draft equals the argmax of the penalized
    target logits, then append that argmax. Sampled rows use the speculative sampling rule
    (Leviathan et al. 2023; Chen et al. 2023) with p = softmax(``sampling.process_logits``) of
    the target logits, the distribution ``sampling.sample`` draws from, so temperature, top-k,
    top-p, min-p and penalties shape p exactly as in the plain sampler: the emitted tokens are
    distributed as the plain sampler's. Randomness: request_keys(seed, position) folded with a
    stream tag (acceptance uniform at positions + j, residual/bonus draw at positions + n).

    XLA:CPU: the expensive stages sit behind conds that return only [B]-sized results (no
    [B, K+1, V] copy): penalties run only when a row has one, and the softmax, filters and
    draws only when a row samples; an all-greedy batch costs one argmax and one log-sum-exp.
    """
    b, k = draft_tokens.shape
    v = target_logits.shape[-1]
    if k < 1 or target_logits.shape != (b, k + 1, v):
        raise ValueError(f"target_logits {target_logits.shape} must be [B, K+1, V] = "
                         f"[{b}, {k + 1}, V] for draft_tokens {draft_tokens.shape} (K >= 1)")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs {draft_probs.shape} must be [B, K, V] = [{b}, {k}, {v}]")
    if num_draft is None:
        valid = jnp.ones((b, k), jnp.bool_)
    else:
        valid = jnp.arange(k)[None, :] < num_draft.astype(jnp.int32)[:, None]  # [B, K]
    drafts = jnp.where(valid, jnp.clip(draft_tokens.astype(jnp.int32), 0, v - 1), 0)  # [B, K]
    positions = positions.astype(jnp.int32)
    if draft_probs is not None:
        draft_probs = draft_probs.astype(jnp.float32)
    raw = target_logits.astype(jnp.float32)

    def accept(x):
        return _accept(x, drafts, valid, draft_probs, arrays, positions)

    if output_counts is None and prompt_mask is None:
        num_accepted, final = accept(raw)
    else:
        if output_counts is None:
            output_counts = jnp.zeros((b, v), jnp.int32)
        if prompt_mask is None:
            prompt_mask = jnp.zeros((b, v), jnp.bool_)
        num_accepted, final = jax.lax.cond(
            jnp.any(_penalties_active(arrays)),
            lambda x: accept(_penalize_drafts(x, arrays, output_counts, prompt_mask, drafts,
                                              valid)),
            accept, raw)

    cols = jnp.arange(k + 1)[None, :]
    na = num_accepted[:, None]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    out = jnp.where(cols < na, padded, jnp.where(cols == na, final[:, None], PAD_TOKEN))
    lse = sampling.logsumexp(raw.reshape(b * (k + 1), v)).reshape(b, k + 1)
    chosen = jnp.take_along_axis(raw, jnp.maximum(out, 0)[..., None], axis=-1)[..., 0]
    logprobs = jnp.where(cols <= na, chosen - lse, 0.0)
    return VerifyOutput(num_accepted=num_accepted.astype(jnp.int32),
                        out_tokens=out.astype(jnp.int32), logprobs=logprobs)


# ---------------------------------------------------------------------------------- proposers
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


class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the sequence's last n tokens.

    For n = n_max down to n_min, the last n tokens are searched in prompt + output so far; the
    most recent earlier match wins and the (up to) k tokens that followed it are proposed.
    Deterministic, so ``verify`` takes draft_probs=None.
    """

    def __init__(self, n_max: int = 3, n_min: int = 1, k: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramProposer needs 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if k < 1:
            raise ValueError(f"NgramProposer needs k >= 1, got {k}")
        self.n_max, self.n_min, self.k = n_max, n_min, k

    def lookup(self, token_ids: Sequence[int], k: Optional[int] = None) -> tuple[np.ndarray, int]:
        """(tokens [k] i32 zero-padded, number proposed 0..k) for one sequence."""
        k = self.k if k is None else k
        ids = np.asarray(token_ids, np.int32)
        out = np.zeros(k, np.int32)
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            # Windows of ids[:-1] start at i <= len - 1 - n, so a token always follows them.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [len - n, n]
            hits = np.flatnonzero(np.all(windows == ids[-n:], axis=1))
            if hits.size:
                follow = ids[hits[-1] + n: hits[-1] + n + k]
                out[: len(follow)] = follow
                return out, len(follow)
        return out, 0

    def propose_batch(self, token_lists: Sequence[Sequence[int]], k: Optional[int] = None
                      ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [B, k] i32 zero-padded, lengths [B] i32) for a batch of sequences."""
        k = self.k if k is None else k
        tokens = np.zeros((len(token_lists), k), np.int32)
        lengths = np.zeros(len(token_lists), np.int32)
        for i, ids in enumerate(token_lists):
            tokens[i], lengths[i] = self.lookup(ids, k)
        return tokens, lengths

    def propose(self, batch: ProposeInput) -> Proposal:
        tokens, lengths = self.propose_batch(batch.token_ids)
        return Proposal(tokens=jnp.asarray(tokens), num_draft=jnp.asarray(lengths), probs=None)


# ---------------------------------------------------------------------------------- draft model
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
    tokens: Array  # [B, K] i32
    probs: Array  # [B, K, V] f32: q, the processed draft distribution each token came from


def _draft_token(logits: Array, arrays: SamplingArrays, positions: Array,
                 counts: Optional[Array], prompt_mask: Optional[Array]):
    """q = probs_from_logits(...) [B, V] and a token drawn from it with the draft stream."""
    q = sampling.probs_from_logits(logits, arrays, counts, prompt_mask)
    greedy = arrays.temperature < sampling.GREEDY_EPS
    drawn = _draw(q, _tagged_uniforms(arrays.seed, positions, _DRAFT_TAG))
    return jnp.where(greedy, sampling.argmax(q), drawn), q


@functools.partial(jax.jit, static_argnames=("cfg", "k", "backend"),
                   donate_argnames=("cache",))
def draft_propose(params, cache: PagedKVCache, tail: Array, q_start: Array, n_valid: Array,
                  block_tables: Array, arrays: SamplingArrays,
                  output_counts: Optional[Array] = None, prompt_mask: Optional[Array] = None,
                  *, cfg: ModelConfig, k: int, backend: str = "xla"):
    """K draft tokens per row from a small model, in one jit (a lax.scan of decode steps).

    params / cache: the draft model's parameters and its ``PagedKVCache`` (donated), addressed
    by the TARGET's block_tables [B, M] (the draft cache has the target's page count and size).
    tail [B, T] i32: committed tokens the draft cache has not seen, at q_start [B] (n_valid [B]
    real; 0 = padding row, which writes only the dummy page); draft 0 sits at q_start + n_valid.
    arrays [B]: the requests' SamplingArrays. Greedy rows draft greedily; the others draw from
    q = sampling.probs_from_logits(draft logits, arrays, counts + earlier drafts, prompt_mask)
    with key fold_in(request_keys(seed, position), draft tag). Drafts 0..K-2 enter the cache.
    Returns (DraftOutput(tokens [B, K] i32, probs [B, K, V] f32), cache).
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
        tok, q = _draft_token(logits, arrays, pos0 + j, counts, prompt_mask)
        if counts is not None:
            counts = sampling.update_counts(counts, tok, live)
        tokens = jnp.zeros_like(tokens).at[:, 0].set(tok)
        return (cache, tokens, pos0 + j, live.astype(jnp.int32), counts), (tok, q)

    init = (cache, tail.astype(jnp.int32), q_start.astype(jnp.int32),
            n_valid.astype(jnp.int32), counts)
    (cache, *_), (toks, qs) = jax.lax.scan(step, init, jnp.arange(k, dtype=jnp.int32))
    tokens = jnp.moveaxis(toks, 0, 1)  # [B, K]
    probs = jnp.moveaxis(qs, 0, 1)  # [B, K, V]
    return DraftOutput(tokens=tokens, probs=probs), cache


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


# ---------------------------------------------------------------------------------- engine policy
@dataclasses.dataclass
class SpeculativeConfig:
    """vLLM-style ``speculative_config``: method "ngram" or "draft", K, and the draft model."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: Any = None  # draft: a path, or a (ModelConfig, params) pair
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    adaptive: bool = True  # the "never slower" rule below

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        if isinstance(d, cls):
            return d
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        cfg = cls(**d)
        if cfg.method not in ("ngram", "draft"):
            raise ValueError(f"speculative_config.method={cfg.method!r}: use 'ngram' or 'draft'")
        if not 1 <= cfg.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in [1, 16]")
        if cfg.method == "draft" and cfg.model is None:
            raise ValueError("speculative_config: method 'draft' needs 'model'")
        return cfg


class SpeculationPolicy:
    """Decides per step whether to verify K drafts or decode one token, so it is never slower.

    Rule: each request keeps an EMA ``a`` of its per-token acceptance rate (prior 0.6). A row
    with K drafts is expected to emit 1 + a + a^2 + ... + a^K tokens. A step speculates when
    (expected tokens of all rows) / t_verify > rows / t_decode, with both step times measured
    (EMA per batch bucket, seeded at warm-up). A request whose EMA falls below ``min_rate``
    after ``min_steps`` verify steps stops proposing (its rows then carry 0 drafts).
    """

    def __init__(self, k: int, *, prior: float = 0.6, decay: float = 0.8,
                 min_rate: float = 0.1, min_steps: int = 4, adaptive: bool = True):
        self.k, self.prior, self.decay = k, prior, decay
        self.min_rate, self.min_steps, self.adaptive = min_rate, min_steps, adaptive
        self.rate: dict[int, float] = {}
        self.steps: dict[int, int] = {}
        self.t_decode: dict[int, float] = {}
        self.t_verify: dict[int, float] = {}

    def proposes(self, seq_id: int) -> bool:
        """False once a request has shown it rarely accepts drafts."""
        if not self.adaptive:
            return True
        return not (self.steps.get(seq_id, 0) >= self.min_steps
                    and self.rate.get(seq_id, self.prior) < self.min_rate)

    def expected_tokens(self, seq_id: int) -> float:
        if not self.proposes(seq_id):
            return 1.0
        a = self.rate.get(seq_id, self.prior)
        return sum(a ** j for j in range(self.k + 1))

    def speculate(self, seq_ids, bucket: int) -> bool:
        if not self.adaptive:
            return True
        td, tv = self.t_decode.get(bucket), self.t_verify.get(bucket)
        if td is None or tv is None:
            return True
        gain = sum(self.expected_tokens(s) for s in seq_ids) / tv
        return gain > len(seq_ids) / td

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        r = accepted / proposed
        old = self.rate.get(seq_id, self.prior)
        self.rate[seq_id] = self.decay * old + (1 - self.decay) * r
        self.steps[seq_id] = self.steps.get(seq_id, 0) + 1

    def time(self, kind: str, bucket: int, seconds: float) -> None:
        table = self.t_verify if kind == "verify" else self.t_decode
        old = table.get(bucket)
        table[bucket] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def forget(self, seq_id: int) -> None:
        self.rate.pop(seq_id, None)
        self.steps.pop(seq_id, None)
