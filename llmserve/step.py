"""The one engine step as pure, jittable functions: the device state a step carries between
calls (``SamplerState``, ``EagleState``), the model over a step's flat tokens (``forward``),
sampling or verifying, the EAGLE head after the step, and the small programs beside it
(sampler-row init, page copy). ``llmserve.runner`` jits them and owns the state they update;
see its docstring for the step's shape.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from llmserve import sampling
from llmserve.batch import HeadInput, StepInput, StepOutput
from llmserve.config import ModelConfig
from llmserve.kv_cache import PagedKVCache
from llmserve.model import Transformer
from llmserve.ops import cpu_kernels
from llmserve.packed import unpack_inputs
from llmserve.speculative import ngram_device
from llmserve.speculative.verify import verify

Array = jax.Array

# The host batch types are plain dataclasses (llmserve.batch imports no jax): pytrees from here.
for _cls in (HeadInput, StepInput, StepOutput):
    jax.tree_util.register_dataclass(_cls)


@flax.struct.dataclass
class SamplerState:
    """Per-slot token statistics for penalties, and each slot's last emitted token (async
    scheduling feeds it to the slot's next step); row ``max_slots`` is the padding row."""

    counts: Array  # [S + 1, V] int32: how often each token was generated
    prompt_mask: Array  # [S + 1, V] bool: tokens present in the prompt
    last: Array  # [S + 1] int32: the token the slot emitted last
    # Device n-gram lookup (``ngram`` steps): each slot's tokens and how many there are
    # (prompt and every emitted token); [S + 1, 1] and unused otherwise.
    history: Array  # [S + 1, M] int32
    length: Array  # [S + 1] int32

    @classmethod
    def create(cls, max_slots: int, vocab_size: int, history_len: int = 1) -> "SamplerState":
        return cls(counts=jnp.zeros((max_slots + 1, vocab_size), jnp.int32),
                   prompt_mask=jnp.zeros((max_slots + 1, vocab_size), bool),
                   last=jnp.zeros(max_slots + 1, jnp.int32),
                   history=jnp.zeros((max_slots + 1, history_len), jnp.int32),
                   length=jnp.zeros(max_slots + 1, jnp.int32))


@flax.struct.dataclass
class EagleState:
    """An EAGLE head inside the step (``speculative/eagle.py``): its params, its one-layer
    paged cache (the target's page ids) and the drafts it made for each slot at the end of the
    slot's last step, which the slot's next verify step reads on the device."""

    params: dict
    vocab_map: Array  # [Vd] int32: draft vocabulary -> target ids
    cache: PagedKVCache
    drafts: Array  # [S + 1, D] int32: each slot's next drafts (target ids)
    features: Array  # [S + 1, D_model] float32: each slot's last feature h_{L-1}


def suppress(logits: Array, inp: StepInput) -> Array:
    """logits [R, T, V]: bans ``suppress_ids`` at sampled positions t < ``suppress_until``."""
    r, t, v = logits.shape
    active = jnp.arange(t)[None, :] < inp.suppress_until[:, None]  # [R, T]
    ids = jnp.where(active[:, :, None], inp.suppress_ids[:, None, :], v)
    return logits.at[jnp.arange(r)[:, None, None], jnp.arange(t)[None, :, None], ids].set(
        -jnp.inf, mode="drop")


def step_rows(inp: StepInput) -> int:
    """The row count a step's matmul kernel is chosen by: its sequences when it only decodes or
    verifies (a verify row's 1 + R tokens then take the kernel of the same batch's decode step,
    so speculation never changes a greedy token through rounding), else its flat tokens."""
    first = inp.parts[0]
    if len(inp.parts) == 1 and (first.t == 1 or inp.verify):
        return first.block_tables.shape[0]
    return inp.tokens.shape[0]


def native_matmul(cache: PagedKVCache, min_rows: int, inp: StepInput, dtype) -> bool | str:
    """The model's ``native_matmul`` for a step, one kernel for all of the step's matmuls: off
    when sharded (a custom call would gather the sharded weights); "always" in the
    batch-invariant mode (``min_rows`` > 1: every row count runs the same row-independent
    kernel); else the native kernels when measured faster at ``step_rows`` (a static shape)."""
    if cache.shardings is not None:
        return False
    if min_rows > 1 or cpu_kernels.native_matmul_wins(dtype, step_rows(inp)):
        return "always"
    return False


def forward(params, cache: PagedKVCache, inp: StepInput, *, cfg: ModelConfig, backend: str,
            logits_index: Optional[Array] = None, min_rows: int = 1,
            return_hidden: bool = False, logits_rows: Optional[Array] = None):
    """The model over a step's flat tokens -> (logits [R, V] at ``logits_index``, default
    ``sample_index``; cache). ``min_rows`` pads the vocabulary projection to at least that many
    rows (batch-invariant mode: the matmul's numerics then never depend on R).
    ``logits_rows``: how many leading rows of ``logits_index`` are real (the native vocabulary
    projection skips the rest; their logits are zeros); default: the step's live sampled rows
    when ``logits_index`` is None, else every row."""
    if logits_index is None and logits_rows is None:
        logits_rows = inp.live[1]
    index = inp.sample_index if logits_index is None else logits_index
    r = index.shape[0]
    index = jnp.pad(index, (0, max(0, min_rows - r)))
    out = Transformer(cfg).apply({"params": params}, inp.tokens[None], inp.metadata(), cache,
                                 backend=backend, logits_index=index[None],
                                 return_hidden="all" if return_hidden else False,
                                 native_matmul=native_matmul(cache, min_rows, inp, cfg.dtype),
                                 logits_rows=logits_rows)
    logits, cache = out[:2]
    if cache.shardings is not None:  # vocab-split logits: gathered once, sampled locally
        logits = cache.shardings.gather_logits(logits, cfg.vocab_size)
    if return_hidden:
        return logits[0, :r], cache, out[2][0]  # hidden [N, D]
    return logits[0, :r], cache


def _top_logprobs(logits: Array, num_logprobs: int,
                  want: Optional[Array] = None) -> tuple[Array, Array]:
    """The ``num_logprobs`` most likely raw tokens of logits [..., V] and their logprobs
    (zeros, without the search, when no row of ``want`` asks for them)."""
    shape = logits.shape[:-1] + (num_logprobs,)
    if num_logprobs == 0:
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    def top(x):
        vals, ids = sampling.top_k(x, num_logprobs)
        lse = sampling.logsumexp(x.reshape(-1, x.shape[-1]))
        return ids.astype(jnp.int32), vals - lse.reshape(x.shape[:-1])[..., None]

    if want is None:
        return top(logits)
    return jax.lax.cond(jnp.any(want), top, lambda x: (jnp.zeros(shape, jnp.int32),
                                                       jnp.zeros(shape, jnp.float32)), logits)


def trim_verify_tokens(inp: StepInput, bv: int, w: int) -> StepInput:
    """A verify-only step's live tokens end after its last real row's drafts.

    A verify row has room for 1 + D tokens, and the batch counts it whole (``live``), since
    drafts found on the device may fill it. Once the row's drafts are known here (``num_draft``:
    the host's n-gram proposal, or the device lookup's count), the tokens after the last real
    row's drafts are padding: the native matmuls and the vocabulary projection skip them
    (``live_tokens``, ``logits_rows``), so a row that carries fewer drafts costs less (at batch
    1, a device lookup that finds none costs about a decode step). Nothing changes for the
    rows kept: the native kernels compute each row alone, and the verifier never reads logits
    past a row's drafts. A batch with no real row (warm-up timing) keeps its count."""
    part = inp.parts[0]
    real = part.lengths[:bv] > 0
    ends = jnp.where(real, jnp.arange(bv, dtype=jnp.int32) * w + 1 + inp.num_draft[:bv], 0)
    live = jnp.where(jnp.any(real), jnp.minimum(inp.live[0], jnp.max(ends)), inp.live[0])
    return inp.replace(live=inp.live.at[0].set(live.astype(inp.live.dtype)))


def _step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput,
          drafts: Optional[Array] = None, draft_probs: Optional[Array] = None,
          eagle: Optional[EagleState] = None, *, cfg: ModelConfig, backend: str,
          num_logprobs: int, min_rows: int = 1, eagle_cfg=None, ngram=None):
    """One engine step: decode rows, prefill chunks and (``inp.verify``) verify rows at once.

    Verify rows [Bv, 1 + D] carry [last committed token, D drafts]; the drafts are already in
    ``inp.tokens`` (n-gram: written on the host) or enter here from ``drafts`` [Bv, D] (a draft
    model's device output, never copied to the host; a bucket whose rows carry fewer drafts,
    ``BatchBuilder.verify_drafts``, takes the first ones). All 1 + D positions are scored by the one
    forward over the flat tokens; the pure verifier keeps the longest accepted prefix plus one
    target token. K/V written for rejected drafts is never read: attention stops at each
    sequence's length and the next step overwrites it. The other rows sample as usual.

    With an EAGLE head (``eagle``), the step also runs the head over its tokens (the target's
    last hidden states paired with each next token) and drafts D tokens for every row that
    emitted, from its newest token; a slot's next verify step reads them here on the device.

    ``ngram`` = (n_max, n_min, max_model_len, page_size): n-gram drafts are looked up here, in
    each slot's token history (``SamplerState.history``), and every verify row's place comes
    from the device (``ngram_device.verify_rows``): a verify step can be launched while the step
    before it, which may accept any number of drafts, still runs (async scheduling).
    """
    hidden = None
    if eagle is not None and inp.verify:
        drafts = eagle.drafts[inp.slot_ids[: inp.parts[0].block_tables.shape[0]]]
    # Async scheduling: a row built before its previous token reached the host takes that
    # token here, from its slot's last emitted token (the previous step ran first).
    inp = inp.replace(tokens=jnp.where(inp.feed >= 0, sstate.last[jnp.maximum(inp.feed, 0)],
                                       inp.tokens))
    # A sequence's sampler row was filled from its tokens when it was (re)admitted
    # (``init_sampler_rows``); each step only adds the tokens it emits.
    r = inp.sample_index.shape[0]
    if not inp.verify:
        logits, cache, *hidden = forward(params, cache, inp, cfg=cfg, backend=backend,
                                         min_rows=min_rows, return_hidden=eagle is not None)
        logits = suppress(logits[:, None], inp)[:, 0]  # [R, V]
        # The penalty rows are read only when a row has a penalty (inside sample's cond), and
        # the emitted tokens are counted in place: no [R, V] gather and write-back per step.
        out = sampling.sample(logits, inp.sampling, inp.sample_pos, num_logprobs=num_logprobs,
                              want_top=inp.want_top,
                              history=(sstate.counts, sstate.prompt_mask, inp.slot_ids))
        sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids, out.tokens].add(
            inp.emit.astype(jnp.int32)))
        result = StepOutput(tokens=out.tokens[:, None], logprobs=out.logprobs[:, None],
                            top_ids=out.top_ids[:, None], top_logprobs=out.top_logprobs[:, None],
                            num_accepted=jnp.zeros(r, jnp.int32))
    else:
        counts = sstate.counts[inp.slot_ids]
        pmask = sstate.prompt_mask[inp.slot_ids]
        part = inp.parts[0]
        bv, w = part.block_tables.shape[0], part.t
        if ngram is not None:
            inp, drafts = ngram_device.verify_rows(inp, sstate, ngram)
            part = inp.parts[0]
        if draft_probs is not None:  # [Bv, D, V]: a step of many rows may verify fewer
            draft_probs = draft_probs[:, : w - 1]
        if drafts is not None:  # a draft model's tokens enter here, on the device
            rows = inp.tokens[: bv * w].reshape(bv, w).at[:, 1:].set(
                drafts[:, : w - 1].astype(jnp.int32))
            inp = inp.replace(tokens=jnp.concatenate([rows.reshape(-1), inp.tokens[bv * w:]]))
        if r == bv:
            inp = trim_verify_tokens(inp, bv, w)
        index = jnp.arange(bv * w, dtype=jnp.int32)
        if r > bv:
            index = jnp.concatenate([index, inp.sample_index[bv:]])
        # A verify-only step's logits rows are its flat tokens: the live ones come first.
        logits, cache, *hidden = forward(params, cache, inp, cfg=cfg, backend=backend,
                                         logits_index=index, min_rows=min_rows,
                                         return_hidden=eagle is not None,
                                         logits_rows=inp.live[0] if r == bv else None)
        v = logits.shape[-1]
        head = lambda x: jax.tree_util.tree_map(lambda a: a[:bv], x)  # noqa: E731
        tail = lambda x: jax.tree_util.tree_map(lambda a: a[bv:], x)  # noqa: E731
        rows = inp.replace(head=None)  # per-row fields only (sliced by row below)
        vlogits = suppress(logits[: bv * w].reshape(bv, w, v), head(rows))  # [Bv, 1 + D, V]
        ver = verify(inp.tokens[: bv * w].reshape(bv, w)[:, 1:], draft_probs, vlogits,
                     head(inp.sampling), part.q_start + 1, counts[:bv], pmask[:bv],
                     num_draft=inp.num_draft[:bv])
        top_ids, top_lp = _top_logprobs(vlogits, num_logprobs, inp.want_top[:bv])  # [Bv, 1 + D, n]
        emitted = (ver.out_tokens >= 0) & inp.emit[:bv, None]
        vcounts = counts[:bv].at[jnp.arange(bv)[:, None], jnp.maximum(ver.out_tokens, 0)].add(
            emitted.astype(jnp.int32))
        result = StepOutput(tokens=ver.out_tokens, logprobs=ver.logprobs, top_ids=top_ids,
                            top_logprobs=top_lp, num_accepted=ver.num_accepted,
                            num_draft=inp.num_draft)
        new_counts = vcounts
        if r > bv:  # the other parts' rows (prefill chunks) sample as in a plain step
            # (a static branch: a verify-only step has no such rows, and sampling ops over
            # zero rows are left out of its program altogether)
            rlogits = suppress(logits[bv * w:][:, None], tail(rows))[:, 0]  # [R - Bv, V]
            out = sampling.sample(rlogits, tail(inp.sampling), inp.sample_pos[bv:],
                                  counts[bv:], pmask[bv:], num_logprobs=num_logprobs,
                                  want_top=inp.want_top[bv:])
            rcounts = sampling.update_counts(counts[bv:], out.tokens, inp.emit[bv:])
            new_counts = jnp.concatenate([vcounts, rcounts])
            pad = lambda x, fill: jnp.pad(  # noqa: E731
                x[:, None], [(0, 0), (0, w - 1)] + [(0, 0)] * (x.ndim - 1),
                constant_values=fill)
            result = StepOutput(
                tokens=jnp.concatenate([ver.out_tokens, pad(out.tokens, -1)]),
                logprobs=jnp.concatenate([ver.logprobs, pad(out.logprobs, 0.0)]),
                top_ids=jnp.concatenate([top_ids, pad(out.top_ids, 0)]),
                top_logprobs=jnp.concatenate([top_lp, pad(out.top_logprobs, 0.0)]),
                num_accepted=jnp.concatenate([ver.num_accepted,
                                              jnp.zeros(r - bv, jnp.int32)]),
                num_draft=inp.num_draft)
        sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids].set(new_counts))
    # Each emitting row's newest token (a verify row's: after its accepted drafts) is its
    # slot's last token; rows that emit nothing write the padding row.
    newest = result.tokens[jnp.arange(r), result.num_accepted]
    pad_slot = sstate.last.shape[0] - 1
    sstate = sstate.replace(last=sstate.last.at[jnp.where(inp.emit, inp.slot_ids, pad_slot)].set(
        newest))
    if ngram is not None:
        sstate = ngram_device.append_history(sstate, inp, result)
    if eagle is not None:
        eagle = _eagle_after_step(params, eagle, inp, hidden[0], result, eagle_cfg, backend)
        return result, cache, sstate, eagle
    return result, cache, sstate


def _packed_step(params, cache: PagedKVCache, sstate: SamplerState, buf: Array,
                 drafts: Optional[Array] = None, draft_probs: Optional[Array] = None,
                 eagle: Optional[EagleState] = None, *, layout: tuple, param_tree=None,
                 **static):
    """``_step`` over a packed ``StepInput`` (``pack_inputs``). ``param_tree``: ``params`` is
    the tuple of the weights' leaves, in that treedef's order (``Runner.run``)."""
    if param_tree is not None:
        params = jax.tree_util.tree_unflatten(param_tree, params)
    return _step(params, cache, sstate, unpack_inputs(buf, layout), drafts, draft_probs, eagle,
                 **static)


def _eagle_after_step(params, eagle: EagleState, inp: StepInput, hidden: Array,
                      result: StepOutput, ecfg, backend: str) -> EagleState:
    """The EAGLE head's share of a step: write its cache for the step's tokens, then draft.

    hidden [N, D]: the target's features of the step's flat tokens. The head's input at
    token i (position p) is (h_{p-1}, x_p) (``HeadInput``), stored at p with the target's own
    metadata. Then every emitting row drafts D tokens from its newest token x_L, i.e. from
    (h_{L-1}, x_L) at position L, where h_{L-1} is the hidden state of the row's last kept
    token (a verify row's last accepted one). Greedy rows draft the head's argmax, sampled rows
    draw from it; the verifier treats drafts as point masses, which keeps sampled output
    exactly the target's (accept x with probability p(x), else draw from p without x: a draw
    from p whatever x was).
    """
    from llmserve.speculative import eagle as eagle_lib

    n = inp.tokens.shape[0]
    head = inp.head
    embed, norm = params["embed"], params["final_norm"]
    tokens = inp.tokens
    last = inp.sample_index  # [R]: flat index of each row's last kept token
    if inp.verify:
        part = inp.parts[0]
        bv, w = part.block_tables.shape[0], part.t
        drafts = jnp.maximum(result.tokens[:bv, : w - 1], 0)  # accepted drafts are the tokens
        tokens = tokens.at[: bv * w].set(jnp.concatenate(
            [tokens[: bv * w].reshape(bv, w)[:, :1], drafts], axis=1).reshape(-1))
        last = last.at[:bv].set(jnp.arange(bv) * w + result.num_accepted[:bv])
    row = jnp.maximum(head.first_row, 0)
    carried = jnp.where(head.carry[row, None], eagle.features[inp.slot_ids[row]], 0.0)
    feats = jnp.where((head.prev >= 0)[:, None], hidden[jnp.maximum(head.prev, 0)],
                      jnp.where((head.first_row >= 0)[:, None], carried, 0.0))  # [N, D]
    _, hcache = eagle_lib.run_head(eagle.params, embed, eagle.cache, feats[None], tokens[None],
                                    inp.metadata(), ecfg, backend)
    # Each emitting row drafts from (h_{L-1}, x_L) at position L.
    tables = head.tables  # [R, M]: each sampled row's block table
    feat = hidden[jnp.clip(last, 0, n - 1)]  # [R, D]: h_{L-1}
    emitted = jnp.take_along_axis(result.tokens, result.num_accepted[:, None], axis=1)[:, 0]
    pos = jnp.where(inp.emit, inp.positions[jnp.clip(last, 0, n - 1)] + 1, 0)

    def chain(hcache):
        out, hcache = eagle_lib.eagle_propose(
            eagle.params, embed, norm, eagle.vocab_map, hcache, feat[:, None],
            emitted[:, None], pos, inp.emit.astype(jnp.int32), tables, inp.sampling,
            ecfg=ecfg, num_draft=eagle.drafts.shape[1], backend=backend, with_probs=False)
        return hcache, out.tokens

    # The chain costs D small sequential steps: skipped when the next step will not verify
    # (the never-slower policy chose plain decoding); the head's cache is written either way.
    hcache, drafts = jax.lax.cond(head.draft, chain,
                                  lambda c: (c, eagle.drafts[inp.slot_ids]), hcache)
    return eagle.replace(cache=hcache, drafts=eagle.drafts.at[inp.slot_ids].set(drafts),
                         features=eagle.features.at[inp.slot_ids].set(feat))


def invariant_min_rows(dtype: str) -> int:
    """Rows below which XLA:CPU's matmuls and batched attention change their summation order
    (measured: fp32 dots give one result for 1 row, another for 2-32 and another from 48 up;
    bf16 with f32 accumulation one for 1 row and another from 2 up; fp32 attention batches
    differ below 8). Batch-invariant steps pad to at least this many tokens, logits rows and
    attention queries, so every row is computed the same way whatever shares the step."""
    return 8 if "bfloat16" in str(dtype) else 64


def _init_sampler_rows(sstate: SamplerState, slots: Array, ids: Array, n_prompt: Array,
                       n_total: Array) -> SamplerState:
    """Rebuilds sampler rows from a sequence's tokens: slots [R], ids [R, M] (padded).

    Prompt tokens (positions < n_prompt) set the prompt mask; output tokens (n_prompt <= pos <
    n_total) are counted. Padding rows target the padding slot, whose value is never read.
    """
    r, m = ids.shape
    pos = jnp.arange(m)[None, :]
    rows = jnp.arange(r)[:, None]
    v = sstate.counts.shape[1]
    pmask = jnp.zeros((r, v), bool).at[rows, ids].max(pos < n_prompt[:, None])
    counts = jnp.zeros((r, v), jnp.int32).at[rows, ids].add(
        ((pos >= n_prompt[:, None]) & (pos < n_total[:, None])).astype(jnp.int32))
    sstate = sstate.replace(counts=sstate.counts.at[slots].set(counts),
                            prompt_mask=sstate.prompt_mask.at[slots].set(pmask))
    if sstate.history.shape[1] == m:  # device n-gram lookup: the slot's tokens so far
        sstate = sstate.replace(history=sstate.history.at[slots].set(ids),
                                length=sstate.length.at[slots].set(n_total))
    return sstate


def copy_cache_pages(cache: PagedKVCache, src: Array, dst: Array) -> PagedKVCache:
    """Copy-on-write (jitted with the cache donated, in place): page src[i] into dst[i]."""
    return cache.copy_pages(src, dst)
