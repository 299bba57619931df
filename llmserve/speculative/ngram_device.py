"""N-gram prompt lookup on the device (jnp): the drafts of ``NgramProposer.lookup`` from each
slot's token history, inside the step, so a verify step can be launched before the tokens of
the step in flight reach the host (async scheduling, ``Engine``).

The same choice as the host proposer: the longest n in [n_min, n_max] whose last-n tokens
occur earlier in the sequence, the earliest such occurrence, and the (up to) R tokens after it.
The runner's step calls ``verify_rows`` (drafts and each verify row's place, from the device)
and ``append_history`` (each step's emitted tokens join their slot's history).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llmserve.kv_cache import DUMMY_PAGE

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


def verify_rows(inp, sstate, ngram) -> tuple:
    """A verify part's rows placed from the device (``ngram`` steps): (inp, drafts [Bv, D]).

    A row whose last token was still in flight when the host built it (``feed``) sits where
    its slot's history ends (the step before may have accepted any number of drafts); the
    others where the host put them. Each row carries the drafts ``ngram_device.lookup`` finds
    in its slot's history (at most the host's ``num_draft`` and the room left before
    ``max_model_len``); its positions, K/V write slots, kv length and sampled position follow.
    Draft slots past a row's drafts write to the dummy page."""
    n_max, n_min, max_len, page_size = ngram
    part = inp.parts[0]
    bv, w = part.block_tables.shape[0], part.t
    slots = inp.slot_ids[:bv]
    base = jnp.arange(bv, dtype=jnp.int32) * w
    real = part.lengths > 0
    dev_len = sstate.length[slots]
    q_start = jnp.where(real & (inp.feed[base] >= 0), dev_len - 1, part.q_start)
    drafts, count = lookup(sstate.history[slots], q_start + 1, n_max, n_min, w - 1)
    count = jnp.where(real, jnp.minimum(count, jnp.minimum(
        inp.num_draft[:bv], jnp.maximum(max_len - 1 - q_start, 0))), 0)
    t = jnp.arange(w, dtype=jnp.int32)[None, :]
    pos = q_start[:, None] + t  # [Bv, W]
    live = real[:, None] & (t <= count[:, None])
    page = jnp.take_along_axis(part.block_tables,
                               jnp.clip(pos // page_size, 0, part.block_tables.shape[1] - 1),
                               axis=1)
    n = bv * w
    parts = (part.replace(q_start=jnp.where(real, q_start, 0),
                          lengths=jnp.where(real, q_start + 1 + count, 0)),) + inp.parts[1:]
    inp = inp.replace(
        positions=inp.positions.at[:n].set(jnp.where(real[:, None], pos, 0).reshape(-1)),
        write_page=inp.write_page.at[:n].set(jnp.where(live, page, DUMMY_PAGE).reshape(-1)),
        write_offset=inp.write_offset.at[:n].set(
            jnp.where(live, pos % page_size, 0).reshape(-1)),
        parts=parts, sample_pos=inp.sample_pos.at[:bv].set(
            jnp.where(real, q_start + 1, inp.sample_pos[:bv])),
        num_draft=inp.num_draft.at[:bv].set(count))
    return inp, drafts


def append_history(sstate, inp, result):
    """Each emitting row's tokens (a verify row's accepted drafts and the target's token) join
    its slot's history at their positions; the slot's length follows its newest token."""
    r, w = result.tokens.shape
    pad_slot = sstate.last.shape[0] - 1
    slots = jnp.where(inp.emit, inp.slot_ids, pad_slot)
    pos = inp.sample_pos[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [R, W]
    keep = inp.emit[:, None] & (jnp.arange(w)[None, :] <= result.num_accepted[:, None])
    rows = jnp.broadcast_to(jnp.where(keep, slots[:, None], pad_slot), (r, w))
    history = sstate.history.at[rows, pos].set(result.tokens, mode="drop")
    length = sstate.length.at[slots].set(inp.sample_pos + result.num_accepted + 1)
    return sstate.replace(history=history, length=length)
