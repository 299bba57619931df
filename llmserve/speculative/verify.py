"""The speculative verifier: pure, jittable, lossless.

One speculative step for a row at position ``pos`` (the position draft token 0 would take):
  1. a proposer guesses R tokens x_0..x_{R-1} (and, for a sampled draft, their distributions q);
  2. the target model scores [last committed token, x_0..x_{R-1}] in one forward pass, giving
     logits [R+1, V] for positions pos..pos+R;
  3. ``verify`` accepts a prefix of the guesses and appends one token from the target, so every
     step yields 1..R+1 tokens whose distribution is exactly the target's (lossless).

Letters as in ``model.py``: B rows, R draft tokens (R+1 verified positions), V vocab.

Greedy and sampled rows, every sampling parameter and every value of R's padding are arrays,
never Python branches. Randomness is drawn like the sampler's, from
``sampling.request_keys(seed, position)`` folded with a stream tag per use (acceptance uniform,
residual draw, draft draw), so a request's tokens depend on its seed and positions only, never
on the batch it shares.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from llmserve import sampling
from llmserve.sampling import SamplingArrays

Array = jax.Array

# Stream tags folded into request_keys(seed, position): independent randomness per use.
ACCEPT_TAG = 1  # acceptance uniform of the draft token at a position
RESIDUAL_TAG = 2  # the correction / bonus draw at a position
DRAFT_TAG = 3  # the draft model's own draw at a position

PAD_TOKEN = -1  # out_tokens after the last emitted token


# ---------------------------------------------------------------------------------- verifier
@flax.struct.dataclass
class VerifyOutput:
    """What ``verify`` returns: row b emits out_tokens[b, :num_accepted[b] + 1]."""

    num_accepted: Array  # [B] i32, 0..R: draft tokens accepted
    out_tokens: Array  # [B, R+1] i32: accepted drafts, then the target's token, then -1
    logprobs: Array  # [B, R+1] f32: raw target log p of out_tokens (0 at padding)


def _repeat_rows(arrays: SamplingArrays, times: int) -> SamplingArrays:
    """[B] per-slot parameters -> [B*times] (row b*times + j is slot b)."""
    return jax.tree_util.tree_map(lambda x: jnp.repeat(x, times, axis=0), arrays)


def tagged_uniforms(seed: Array, positions: Array, tag: int) -> Array:
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
    """sampling.apply_penalties on target logits [B, R+1, V], unconditionally.

    Position j is penalized as the plain sampler would after generating drafts 0..j-1: those
    (valid [B, R]) tokens are added to output_counts [B, V] for it; prompt_mask [B, V] is shared.
    """
    b, t, v = logits.shape
    k = drafts.shape[1]
    counts = jnp.broadcast_to(output_counts[:, None, :], (b, t, v)).astype(jnp.int32)
    bi = jnp.arange(b)[:, None, None]
    ji = jnp.arange(t)[None, :, None]
    ii = jnp.arange(k)[None, None, :]
    earlier = ((ii < ji) & valid[:, None, :]).astype(jnp.int32)  # [B, R+1, R]
    counts = counts.at[bi, ji, drafts[:, None, :]].add(earlier)
    pmask = jnp.broadcast_to(prompt_mask[:, None, :], (b, t, v))
    out = sampling.apply_penalties(logits.reshape(b * t, v), _repeat_rows(arrays, t),
                                   counts.reshape(b * t, v), pmask.reshape(b * t, v))
    return out.reshape(b, t, v)


def _leading_true(x: Array) -> Array:
    """Length of the all-True prefix of each row: [B, R] bool -> [B] i32."""
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=1), axis=1)


def _pick(x: Array, n: Array) -> Array:
    """x[b, n[b]]: [B, T] and [B] -> [B]."""
    return jnp.take_along_axis(x, n[:, None], axis=1)[:, 0]


def _accept(logits: Array, drafts: Array, valid: Array, draft_probs: Optional[Array],
            arrays: SamplingArrays, positions: Array) -> tuple[Array, Array]:
    """(num_accepted [B], target token [B]) from penalized target logits [B, R+1, V]."""
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
        lse = sampling.logsumexp(proc.reshape(b * t, v)).reshape(b, t)  # [B, R+1]
        p_x = jnp.exp(jnp.take_along_axis(proc[:, :k], drafts[..., None], axis=-1)[..., 0]
                      - lse[:, :k])  # [B, R]
        if draft_probs is None:
            q_x = jnp.ones((b, k), jnp.float32)
        else:
            q_x = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
        steps = jnp.arange(k, dtype=jnp.int32)
        u = tagged_uniforms(arrays.seed, positions[:, None] + steps[None, :], ACCEPT_TAG)
        # Accept x ~ q with probability min(1, p(x) / q(x)), i.e. u * q(x) < p(x), u ~ U[0, 1).
        # At the first rejection draw from norm(max(p - q, 0)); if all R pass, the bonus from p.
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
        tok = _draw(residual, tagged_uniforms(arrays.seed, positions + n, RESIDUAL_TAG))
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

    draft_tokens [B, R] i32; draft_probs [B, R, V] f32, the draft's distribution q after its own
    sampling processing (``sampling.probs_from_logits`` with the same arrays), or None for a
    deterministic proposer (n-gram: q is a point mass on the draft token); target_logits
    [B, R+1, V], row j scoring position positions + j; positions [B] i32, where draft 0 sits;
    output_counts [B, V] i32 / prompt_mask [B, V] bool as for ``sampling.sample`` (the drafts
    before position j count as generated for it); num_draft [B] i32 (default R): drafts past it
    are padding and never accepted (n-gram proposers may find fewer than R).

    Greedy rows (temperature < 1e-5) accept while the draft equals the argmax of the penalized
    target logits, then append that argmax. Sampled rows use the speculative sampling rule
    (Leviathan et al. 2023; Chen et al. 2023) with p = softmax(``sampling.process_logits``) of
    the target logits, the distribution ``sampling.sample`` draws from, so temperature, top-k,
    top-p, min-p and penalties shape p exactly as in the plain sampler: the emitted tokens are
    distributed as the plain sampler's. Randomness: request_keys(seed, position) folded with a
    stream tag (acceptance uniform at positions + j, residual/bonus draw at positions + n).

    XLA:CPU: the expensive stages sit behind conds that return only [B]-sized results (no
    [B, R+1, V] copy): penalties run only when a row has one, and the softmax, filters and
    draws only when a row samples; an all-greedy batch costs one argmax and one log-sum-exp.
    """
    b, k = draft_tokens.shape
    v = target_logits.shape[-1]
    if k < 1 or target_logits.shape != (b, k + 1, v):
        raise ValueError(f"target_logits {target_logits.shape} must be [B, R+1, V] = "
                         f"[{b}, {k + 1}, V] for draft_tokens {draft_tokens.shape} (R >= 1)")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs {draft_probs.shape} must be [B, R, V] = [{b}, {k}, {v}]")
    if num_draft is None:
        valid = jnp.ones((b, k), jnp.bool_)
    else:
        valid = jnp.arange(k)[None, :] < num_draft.astype(jnp.int32)[:, None]  # [B, R]
    drafts = jnp.where(valid, jnp.clip(draft_tokens.astype(jnp.int32), 0, v - 1), 0)  # [B, R]
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


