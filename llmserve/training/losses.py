"""Training losses: masked next-token cross-entropy and distillation KL (forward or reverse).

All losses take student logits [B, T, V] (float32) and a loss mask [B, T]; they return the
mask-weighted mean over tokens. The teacher distribution is given either as full logits
[B, T, V] (computed on the fly by the frozen target) or as its top-k (precomputed):
ids [B, T, k] and log-probs [B, T, k+1] whose last entry is the log-mass of all other tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

KL_DIRECTIONS = ("forward", "reverse")


def masked_mean(values: Array, mask: Array) -> Array:
    """Mean of values [B, T] over mask [B, T] (0 when the mask is empty)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(logits: Array, targets: Array, mask: Array) -> Array:
    """Mean next-token cross-entropy: logits [B, T, V], targets [B, T] int, mask [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return masked_mean(nll, mask)


def token_accuracy(logits: Array, targets: Array, mask: Array) -> Array:
    """Fraction of masked positions where argmax(logits) == target (the greedy-draft match)."""
    hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return masked_mean(hit, mask)


def _kl(logp: Array, logq: Array, direction: str) -> Array:
    """KL over the last axis from log-probs: forward KL(p||q), reverse KL(q||p)."""
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"unknown KL direction {direction!r}; use one of {KL_DIRECTIONS}")
    if direction == "reverse":
        logp, logq = logq, logp
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def distill_kl(student_logits: Array, teacher_logits: Array, mask: Array,
               direction: str = "forward") -> Array:
    """Mean per-token KL between the teacher p and student q over the full vocabulary.

    forward = KL(p || q) = sum_v p (log p - log q) (mass-covering);
    reverse = KL(q || p) = sum_v q (log q - log p) (mode-seeking).
    """
    logq = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    return masked_mean(_kl(logp, logq, direction), mask)


def _log1mexp(x: Array) -> Array:
    """log(1 - exp(x)) for x < 0, accurate at both ends."""
    x = jnp.minimum(x, -1e-7)  # the rest mass never reaches exactly 0 (finite grads)
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def topk_log_probs(logits: Array, ids: Array) -> Array:
    """Log-probs [B, T, k+1] of the k distinct tokens ``ids`` [B, T, k] and of "every other
    token" (log(1 - top mass)).

    The (k+1)-way coarsening keeps the KL exactly zero when student == teacher, and it is a
    lower bound of the full-vocabulary KL (data processing inequality). No [B, T, V] scatter:
    one logsumexp and a gather.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    top = jnp.take_along_axis(logits, ids, axis=-1) - lse
    rest = _log1mexp(jax.nn.logsumexp(top, axis=-1, keepdims=True))
    return jnp.concatenate([top, rest], axis=-1)


def teacher_topk(teacher_logits: Array, k: int) -> tuple[Array, Array]:
    """(ids [B, T, k] int32, log-probs [B, T, k+1]) of the teacher's k most likely tokens."""
    _, ids = jax.lax.top_k(teacher_logits.astype(jnp.float32), k)
    ids = ids.astype(jnp.int32)
    return ids, topk_log_probs(teacher_logits, ids)


def distill_kl_topk(student_logits: Array, teacher_ids: Array, teacher_logprobs: Array,
                    mask: Array, direction: str = "forward") -> Array:
    """Mean per-token KL on the teacher's top-k support plus one "rest" bucket (precomputed)."""
    logq = topk_log_probs(student_logits, teacher_ids)
    logp = jax.lax.stop_gradient(teacher_logprobs).astype(jnp.float32)
    return masked_mean(_kl(logp, logq, direction), mask)
