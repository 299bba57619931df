"""The device side: ONE jitted, fixed-shape step for everything scheduled together.

A step's tokens are one flat vector ``[N]`` made of rectangular *parts*: the decode part
``[Bd, 1]`` (one token per running sequence) and the prefill part ``[Bp, C]`` (prompt chunks);
a verify step is one part ``[Bv, 1 + R]``. Every weight matmul runs once over the flat tokens,
so the weights are read once per step; attention splits them back into their parts and runs
the paged kernel per part (the idea of tpu-inference's ragged attention, split by shape).
Cost follows the real work through a small set of buckets: ``(Bd, Bp, C)`` with ``Bd = 0`` or
``Bp = 0`` when a part is absent, all compiled at warm-up. Which rows are live is data
(``lengths``), never a Python branch; padding tokens write to the dummy page.

The host side of a step is a typed ``StepInput`` of numpy arrays (``llmserve.batch``, which
also picks the buckets); it moves to the device as one int32 buffer (``pack_inputs``) and is
unpacked inside the jitted step. The cache and the sampler state are donated and updated in
place.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llmserve import sampling
from llmserve.batch import (  # noqa: F401  (re-exported: the runner's host-batch names)
    MAX_SUPPRESS_IDS,
    BatchBuilder,
    HeadInput,
    ScheduledRow,
    StepInput,
    StepOutput,
    default_decode_buckets,
    padded_page_pairs,
    part_arrays,
)
from llmserve.config import ModelConfig
from llmserve.kv_cache import DUMMY_PAGE, PagedKVCache
from llmserve.model import Transformer
from llmserve.ops import cpu_kernels
from llmserve.packed import pack_inputs, unpack_inputs  # noqa: F401  (re-exported)
from llmserve.programs import owned_jit, programs_for
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
            return_hidden: bool = False):
    """The model over a step's flat tokens -> (logits [R, V] at ``logits_index``, default
    ``sample_index``; cache). ``min_rows`` pads the vocabulary projection to at least that many
    rows (batch-invariant mode: the matmul's numerics then never depend on R)."""
    index = inp.sample_index if logits_index is None else logits_index
    r = index.shape[0]
    index = jnp.pad(index, (0, max(0, min_rows - r)))
    out = Transformer(cfg).apply({"params": params}, inp.tokens[None], inp.metadata(), cache,
                                 backend=backend, logits_index=index[None],
                                 return_hidden="all" if return_hidden else False,
                                 native_matmul=native_matmul(cache, min_rows, inp, cfg.dtype))
    logits, cache = out[:2]
    if cache.shardings is not None:  # vocab-split logits: gathered once, sampled locally
        logits = cache.shardings.gather_logits(logits, cfg.vocab_size)
    if return_hidden:
        return logits[0, :r], cache, out[2][0]  # hidden [N, D]
    return logits[0, :r], cache


def _top_logprobs(logits: Array, num_logprobs: int, fixed_order: bool = False,
                  want: Optional[Array] = None) -> tuple[Array, Array]:
    """The ``num_logprobs`` most likely raw tokens of logits [..., V] and their logprobs
    (zeros, without the search, when no row of ``want`` asks for them)."""
    shape = logits.shape[:-1] + (num_logprobs,)
    if num_logprobs == 0:
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    def top(x):
        vals, ids = sampling.top_k(x, num_logprobs)
        lse = sampling.logsumexp(x.reshape(-1, x.shape[-1]), fixed_order)
        return ids.astype(jnp.int32), vals - lse.reshape(x.shape[:-1])[..., None]

    if want is None:
        return top(logits)
    return jax.lax.cond(jnp.any(want), top, lambda x: (jnp.zeros(shape, jnp.int32),
                                                       jnp.zeros(shape, jnp.float32)), logits)


def _step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput,
          drafts: Optional[Array] = None, draft_probs: Optional[Array] = None,
          eagle: Optional[EagleState] = None, *, cfg: ModelConfig, backend: str,
          num_logprobs: int, min_rows: int = 1, eagle_cfg=None, ngram=None):
    """One engine step: decode rows, prefill chunks and (``inp.verify``) verify rows at once.

    Verify rows [Bv, 1 + D] carry [last committed token, D drafts]; the drafts are already in
    ``inp.tokens`` (n-gram: written on the host) or enter here from ``drafts`` [Bv, D] (a draft
    model's device output, never copied to the host). All 1 + D positions are scored by the one
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
    fixed_order = min_rows > 1  # the batch-invariant mode: logprobs in a fixed order too
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
                              fixed_order=fixed_order, want_top=inp.want_top,
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
        if drafts is not None:  # a draft model's tokens enter here, on the device
            rows = inp.tokens[: bv * w].reshape(bv, w).at[:, 1:].set(drafts.astype(jnp.int32))
            inp = inp.replace(tokens=jnp.concatenate([rows.reshape(-1), inp.tokens[bv * w:]]))
        index = jnp.arange(bv * w, dtype=jnp.int32)
        if r > bv:
            index = jnp.concatenate([index, inp.sample_index[bv:]])
        logits, cache, *hidden = forward(params, cache, inp, cfg=cfg, backend=backend,
                                         logits_index=index, min_rows=min_rows,
                                         return_hidden=eagle is not None)
        v = logits.shape[-1]
        head = lambda x: jax.tree_util.tree_map(lambda a: a[:bv], x)  # noqa: E731
        tail = lambda x: jax.tree_util.tree_map(lambda a: a[bv:], x)  # noqa: E731
        rows = inp.replace(head=None)  # per-row fields only (sliced by row below)
        vlogits = suppress(logits[: bv * w].reshape(bv, w, v), head(rows))  # [Bv, 1 + D, V]
        ver = verify(inp.tokens[: bv * w].reshape(bv, w)[:, 1:], draft_probs, vlogits,
                     head(inp.sampling), part.q_start + 1, counts[:bv], pmask[:bv],
                     num_draft=inp.num_draft[:bv], fixed_order=fixed_order)
        top_ids, top_lp = _top_logprobs(vlogits, num_logprobs, fixed_order,
                                        inp.want_top[:bv])  # [Bv, 1 + D, n]
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
                                  fixed_order=fixed_order, want_top=inp.want_top[bv:])
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


class StepPrograms:
    """The jitted programs of one engine shape: the step, the page copy, the penalty-row init
    (owned by the engine: see ``llmserve.programs``)."""

    def __init__(self):
        self.step = owned_jit(_packed_step, static_argnames=("layout", "param_tree", "cfg",
                                                             "backend", "num_logprobs",
                                                             "min_rows", "eagle_cfg",
                                                             "ngram"),
                              donate_argnames=("cache", "sstate", "eagle"))
        self.copy_pages = owned_jit(copy_cache_pages, donate_argnames=("cache",))
        self.init_rows = owned_jit(_init_sampler_rows, donate_argnames=("sstate",))

    def num_compilations(self) -> int:
        return (self.step._cache_size() + self.copy_pages._cache_size()
                + self.init_rows._cache_size())


class Runner:
    """Owns the device state (params, paged cache, sampler state) and the compiled step."""

    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 max_slots: int, max_model_len: int, backend: str, num_logprobs: int = 0,
                 decode_buckets: Sequence[int] | None = None,
                 prefill_buckets: Sequence[tuple[int, int]] = ((1, 128),),
                 mixed_decode_buckets: Sequence[int] | None = None,
                 num_speculative_tokens: int = 0,
                 verify_buckets: Sequence[int] | None = None, eagle=None,
                 batch_invariant: bool = False, shardings=None, max_prefill_seqs: int = 8,
                 ngram: Optional[tuple] = None):
        # ``ngram`` = (n_max, n_min): verify steps look their n-gram drafts up on the device
        # (``ngram_device.verify_rows``); every step keeps each slot's token history for it.
        # ``shardings`` (llmserve.sharding.Shardings, or None for one device): the mesh this
        # runner's params and cache are split over; the jitted step follows their shardings.
        self.shardings = shardings
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = -(-max_model_len // page_size)
        if ngram is not None and (batch_invariant or shardings is not None or eagle is not None
                                  or not num_speculative_tokens):
            raise ValueError("device n-gram lookup needs num_speculative_tokens, one device, "
                             "no EAGLE head and the default (not batch-invariant) mode")
        self.ngram = None if ngram is None else (int(ngram[0]), int(ngram[1]),
                                                  int(max_model_len), int(page_size))
        self._history_len = self.pages_per_seq * page_size if ngram is not None else 1
        if shardings is None:
            self.params = jax.tree_util.tree_map(jnp.asarray, params)
            self.cache = PagedKVCache.create(cfg, num_pages, page_size)
            self.sstate = SamplerState.create(max_slots, cfg.vocab_size, self._history_len)
        else:
            cfg, self.params = shardings.prepare_model(cfg, params)  # may expand kv heads
            self.cache = shardings.create_cache(cfg, num_pages, page_size)
            self.sstate = shardings.replicate(SamplerState.create(max_slots, cfg.vocab_size))
        self.cfg = cfg
        self.num_logprobs = num_logprobs
        self.num_speculative_tokens = num_speculative_tokens
        self.backend = backend
        # ``eagle``: (EagleConfig, head params, vocab_map): the head runs inside every step.
        self.eagle_cfg = self.eagle = None
        if eagle is not None:
            from llmserve.speculative import eagle as eagle_lib

            ecfg, head_params, vocab_map = eagle
            if not num_speculative_tokens:
                raise ValueError("an EAGLE head needs num_speculative_tokens >= 1")
            self.eagle_cfg = ecfg
            self.eagle = self.put(EagleState(
                params=jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), head_params),
                vocab_map=jnp.asarray(vocab_map, jnp.int32),
                cache=eagle_lib.create_cache(ecfg, num_pages, page_size),
                drafts=jnp.zeros((max_slots + 1, num_speculative_tokens), jnp.int32),
                features=jnp.zeros((max_slots + 1, cfg.d_model), jnp.float32)))
        self.batch_invariant = batch_invariant
        self.min_rows = invariant_min_rows(cfg.dtype) if batch_invariant else 1
        if decode_buckets is None:
            decode_buckets = default_decode_buckets(
                max_slots, cfg.dtype,
                native_bf16_matmul=(backend == "cpu" and shardings is None
                                    and cpu_kernels.has_bf16_matmul()))
        self.batches = BatchBuilder(
            vocab_size=cfg.vocab_size, page_size=page_size, pages_per_seq=self.pages_per_seq,
            max_slots=max_slots, decode_buckets=decode_buckets, prefill_buckets=prefill_buckets,
            mixed_decode_buckets=mixed_decode_buckets,
            num_speculative_tokens=num_speculative_tokens, verify_buckets=verify_buckets,
            head=eagle is not None, batch_invariant=batch_invariant, min_rows=self.min_rows,
            max_prefill_seqs=max_prefill_seqs)
        self.programs = programs_for((
            cfg, backend, num_logprobs, self.min_rows, self.eagle_cfg, max_slots, num_pages,
            page_size, self.pages_per_seq, tuple(self.step_shapes()),
            None if shardings is None else id(shardings), self.ngram), StepPrograms)

    # ------------------------------------------------------------------ host batch
    # The buckets and the host batch belong to ``self.batches`` (llmserve.batch); these
    # delegates keep the runner the one object callers build steps with.
    @property
    def params(self):
        """The weights (a pytree of device arrays)."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        # The step takes the weights as one flat tuple with a static treedef: jax flattens a
        # tuple of ~270 arrays faster than the nested dicts on every dispatch (0.15-0.35 ms a
        # step on 2 CPU cores, of ~1.1 ms).
        self._params = value
        leaves, self._param_tree = jax.tree_util.tree_flatten(value)
        self._param_leaves = tuple(leaves)

    @property
    def decode_buckets(self) -> list[int]:
        return self.batches.decode_buckets

    @property
    def mixed_decode_buckets(self) -> list[int]:
        return self.batches.mixed_decode_buckets

    @property
    def prefill_buckets(self) -> list[tuple[int, int]]:
        return self.batches.prefill_buckets

    @property
    def verify_buckets(self) -> list[int]:
        return self.batches.verify_buckets

    @property
    def max_prefill_rows(self) -> int:
        return self.batches.max_prefill_rows

    @property
    def max_chunk(self) -> int:
        return self.batches.max_chunk

    def decode_bucket(self, n: int, mixed: bool = False, verify: bool = False) -> int:
        """See ``BatchBuilder.decode_bucket``."""
        return self.batches.decode_bucket(n, mixed, verify)

    def prefill_bucket(self, lengths: Sequence[int]) -> tuple[int, int]:
        """See ``BatchBuilder.prefill_bucket``."""
        return self.batches.prefill_bucket(lengths)

    def fit_chunk(self, lengths: Sequence[int], want: int) -> int:
        """See ``BatchBuilder.fit_chunk``."""
        return self.batches.fit_chunk(lengths, want)

    def step_shapes(self) -> list[tuple]:
        """See ``BatchBuilder.step_shapes``."""
        return self.batches.step_shapes()

    def prepare(self, decode: Sequence[ScheduledRow], prefill: Sequence[ScheduledRow] = (),
                verify: bool = False, head_drafts: bool = True) -> StepInput:
        """See ``BatchBuilder.prepare``."""
        return self.batches.prepare(decode, prefill, verify, head_drafts)

    def empty_batch(self, shape: tuple) -> StepInput:
        """See ``BatchBuilder.empty_batch``."""
        return self.batches.empty_batch(shape)

    def build(self, parts, verify: bool = False, head_drafts: bool = True) -> StepInput:
        """See ``BatchBuilder.build``."""
        return self.batches.build(parts, verify, head_drafts)

    # ------------------------------------------------------------------ execution
    def run(self, batch: StepInput, drafts=None, draft_probs=None) -> StepOutput:
        """Runs one step (one device call) from a host batch; returns device outputs.

        ``drafts`` [Bv, D] / ``draft_probs`` [Bv, D, V]: a draft model's device output for a
        verify step (n-gram drafts are already in the batch's tokens; probs None = point mass).
        """
        buf, layout = pack_inputs(batch)
        buf = self.put(buf)
        if self.eagle is not None:
            out, self.cache, self.sstate, self.eagle = self.programs.step(
                self._param_leaves, self.cache, self.sstate, buf, None, None, self.eagle,
                layout=layout, param_tree=self._param_tree, cfg=self.cfg, backend=self.backend,
                num_logprobs=self.num_logprobs, min_rows=self.min_rows, eagle_cfg=self.eagle_cfg)
        else:
            out, self.cache, self.sstate = self.programs.step(
                self._param_leaves, self.cache, self.sstate, buf, drafts, draft_probs,
                layout=layout, param_tree=self._param_tree, cfg=self.cfg, backend=self.backend,
                num_logprobs=self.num_logprobs, min_rows=self.min_rows, ngram=self.ngram)
        return out if self.shardings is None else self.shardings.local(out)

    def put(self, tree):
        """Host arrays -> device, in one transfer (replicated over the mesh when sharded)."""
        if self.shardings is None:
            return jax.device_put(tree)
        return self.shardings.replicate(tree)

    def lower_step(self, batch: StepInput):
        """The step for ``batch``'s shape, lowered (``.compile().as_text()`` is its HLO after
        partitioning: what experiments/sharding.py and the tests read for collectives)."""
        buf, layout = pack_inputs(batch)
        return self.programs.step.lower(self._param_leaves, self.cache, self.sstate,
                                        self.put(buf), layout=layout,
                                        param_tree=self._param_tree, cfg=self.cfg,
                                        backend=self.backend, num_logprobs=self.num_logprobs,
                                        min_rows=self.min_rows, ngram=self.ngram)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates page src into dst for each pair (padded to a bucket)."""
        if not pairs:
            return
        src_dst = self.put(padded_page_pairs(pairs))
        self.cache = self.programs.copy_pages(self.cache, *src_dst)
        if self.eagle is not None:  # the head's cache follows the same pages
            self.eagle = self.eagle.replace(cache=self.programs.copy_pages(self.eagle.cache,
                                                                           *src_dst))

    def init_sampler_rows(self, rows: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """Fills the penalty rows of (re)admitted sequences from their tokens.

        ``rows`` holds ``(slot, token_ids, num_prompt_tokens)``; a sequence admitted after a
        prefix-cache hit or a preemption gets its whole prompt and every output it already
        generated, however much of it the cache serves. Runs in groups of 4 (one shape).
        """
        m = self.pages_per_seq * self.page_size
        for g in range(0, len(rows), 4):
            slots = np.full(4, self.max_slots, np.int32)
            ids = np.zeros((4, m), np.int32)
            n_prompt = np.zeros(4, np.int32)
            n_total = np.zeros(4, np.int32)
            for i, (slot, tokens, num_prompt) in enumerate(rows[g:g + 4]):
                slots[i], n_prompt[i], n_total[i] = slot, num_prompt, len(tokens)
                ids[i, : len(tokens)] = tokens
            self.sstate = self.programs.init_rows(self.sstate, *self.put((slots, ids, n_prompt,
                                                                          n_total)))

    def reset(self) -> None:
        """Fresh (zeroed) cache and sampler state, e.g. after a failed step consumed the
        donated buffers; compiled steps are kept."""
        num_pages = self.cache.num_pages
        sstate = SamplerState.create(self.max_slots, self.cfg.vocab_size, self._history_len)
        if self.shardings is None:
            self.cache = PagedKVCache.create(self.cfg, num_pages, self.page_size)
            self.sstate = sstate
        else:
            self.cache = self.shardings.create_cache(self.cfg, num_pages, self.page_size)
            self.sstate = self.shardings.replicate(sstate)
        if self.eagle is not None:
            from llmserve.speculative import eagle as eagle_lib

            self.eagle = self.put(self.eagle.replace(
                cache=eagle_lib.create_cache(self.eagle_cfg, num_pages, self.page_size),
                drafts=jnp.zeros(self.eagle.drafts.shape, jnp.int32),
                features=jnp.zeros(self.eagle.features.shape, jnp.float32)))

    def warmup(self, device_drafts: bool = False) -> None:
        """Compiles every step shape once (all rows padding: writes go to the dummy page).

        ``device_drafts``: verify steps take a draft model's device drafts and distributions
        (``run(batch, drafts, draft_probs)``), compiled with zero drafts of that shape."""
        for shape in self.step_shapes():
            batch = self.empty_batch(shape)
            drafts = probs = None
            if device_drafts and batch.verify:
                bv, d = batch.parts[0].block_tables.shape[0], self.num_speculative_tokens
                drafts = self.put(np.zeros((bv, d), np.int32))
                probs = self.put(np.zeros((bv, d, self.cfg.vocab_size), np.float32))
            jax.block_until_ready(self.run(batch, drafts, probs).tokens)
        self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        self.init_sampler_rows([(self.max_slots, [0], 1)])

    def num_compilations(self) -> int:
        """Executables this engine's programs hold (grows only for a new shape)."""
        return self.programs.num_compilations()


def fetch(tree):
    """Device results to host numpy, in one transfer."""
    return jax.device_get(tree)


def wait(tree) -> None:
    """Blocks until every array of ``tree`` is computed (timing, warm-up)."""
    jax.block_until_ready(tree)


def tree_bytes(tree) -> int:
    """Bytes held by the arrays of a pytree (e.g. the weights)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def device_memory_bytes() -> int:
    """Memory of the default device: its allocator's limit on an accelerator, else the
    system's available memory (``MemAvailable``, or total RAM where /proc is absent)."""
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # CPU devices have no memory stats
        pass
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
