"""N-gram prompt lookup on the device (jnp): the drafts of ``NgramProposer.lookup`` from each
slot's token history, inside the step, so a verify step can be launched before the tokens of
the step in flight reach the host (async scheduling, ``Engine``).

The same choice as the host proposer: the longest n in [n_min, n_max] whose last-n tokens
occur earlier in the sequence, the earliest such occurrence, and the (up to) R tokens after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def lookup(history: Array, length: Array, n_max: int, n_min: int, r: int
           ) -> tuple[Array, Array]:
    """(drafts [B, R] i32 zero-padded, count [B] i32) for token rows ``history`` [B, M] of
    ``length`` [B] valid tokens each (the sequence so far, its newest token last).

    A window ending at e (< length - 1) matches m tokens when history[e - j] equals
    history[length - 1 - j] for j < m (j <= length - 2, as the host proposer: the match never
    spans the whole sequence); the longest match >= n_min wins, the earliest among equals."""
    b, m = history.shape
    pos = jnp.arange(m, dtype=jnp.int32)[None, :]  # [1, M]: window end e
    length = length.astype(jnp.int32)[:, None]  # [B, 1]
    alive = pos <= length - 2
    match = jnp.zeros((b, m), jnp.int32)
    for j in range(n_max):  # static: n_max is small
        tail = jnp.take_along_axis(history, jnp.maximum(length - 1 - j, 0), axis=1)  # [B, 1]
        earlier = jnp.roll(history, j, axis=1)  # earlier[:, e] = history[:, e - j]
        alive = alive & (pos >= j) & (j <= length - 2) & (earlier == tail)
        match = match + alive.astype(jnp.int32)
    best = jnp.max(match, axis=1)  # [B]
    found = best >= n_min
    e = jnp.argmax(match == best[:, None], axis=1).astype(jnp.int32)  # earliest of the best
    count = jnp.where(found, jnp.clip(length[:, 0] - 1 - e, 0, r), 0)
    idx = jnp.minimum(e[:, None] + 1 + jnp.arange(r, dtype=jnp.int32)[None, :], m - 1)
    drafts = jnp.take_along_axis(history, idx, axis=1)
    drafts = jnp.where(jnp.arange(r)[None, :] < count[:, None], drafts, 0)
    return drafts.astype(jnp.int32), count.astype(jnp.int32)
