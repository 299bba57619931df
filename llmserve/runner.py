"""The device side: one jitted, fixed-shape step for prefill chunks and decode.

``step`` runs the model over ``tokens [B, T]`` (decode: T = 1; prefill: T = a chunk bucket),
writes their K/V into the paged cache, and samples one token per row. The cache and the sampler
state are donated and updated in place. Shapes come from a small set of buckets, compiled once
at warm-up; which rows are live is an array (``n_valid`` > 0), never a Python branch.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llmserve import sampling
from llmserve.config import ModelConfig
from llmserve.kv_cache import DUMMY_PAGE, AttentionMetadata, PagedKVCache
from llmserve.model import Transformer

Array = jax.Array

MAX_SUPPRESS_IDS = 32  # stop ids a min_tokens request may ban (EOS ids + stop_token_ids)


@flax.struct.dataclass
class SamplerState:
    """Per-slot token statistics for penalties; row ``max_slots`` is the padding row."""

    counts: Array  # [S + 1, V] int32: how often each token was generated
    prompt_mask: Array  # [S + 1, V] bool: tokens present in the prompt

    @classmethod
    def create(cls, max_slots: int, vocab_size: int) -> "SamplerState":
        return cls(counts=jnp.zeros((max_slots + 1, vocab_size), jnp.int32),
                   prompt_mask=jnp.zeros((max_slots + 1, vocab_size), bool))


@flax.struct.dataclass
class StepInput:
    """Everything one step needs; filled on the host by the scheduler."""

    tokens: Array  # [B, T] int32
    q_start: Array  # [B] int32: position of tokens[:, 0]
    n_valid: Array  # [B] int32: real tokens in the row (0 = padding row)
    block_tables: Array  # [B, M] int32
    slot_ids: Array  # [B] int32: row in SamplerState (max_slots for padding rows)
    emit: Array  # [B] bool: the sampled token is kept (final prefill chunk, or decode)
    suppress_ids: Array  # [B, E] int32: token ids banned (min_tokens not reached); V = none
    suppress_until: Array  # [B] int32: the ban holds for the first this-many sampled positions
    sampling: sampling.SamplingArrays  # [B] per-row parameters


@flax.struct.dataclass
class StepOutput:
    tokens: Array  # [B] int32
    logprobs: Array  # [B] float32
    top_ids: Array  # [B, n] int32
    top_logprobs: Array  # [B, n] float32


def _metadata(inp: StepInput) -> AttentionMetadata:
    """Row b's tokens sit at q_start[b] + t; the first n_valid[b] of them are real."""
    t = inp.tokens.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    return AttentionMetadata(positions=inp.q_start[:, None] + ar[None, :], q_start=inp.q_start,
                             lengths=inp.q_start + inp.n_valid,
                             token_mask=ar[None, :] < inp.n_valid[:, None],
                             block_tables=inp.block_tables)


def suppress(logits: Array, inp: StepInput) -> Array:
    """logits [B, T, V]: bans ``suppress_ids`` at sampled positions t < ``suppress_until``."""
    b, t, _ = logits.shape
    active = jnp.arange(t)[None, :] < inp.suppress_until[:, None]  # [B, T]
    ids = jnp.where(active[:, :, None], inp.suppress_ids[:, None, :], logits.shape[-1])
    return logits.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], ids].set(
        -jnp.inf, mode="drop")


def _step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput, *,
          cfg: ModelConfig, backend: str, num_logprobs: int):
    meta = _metadata(inp)
    last = jnp.maximum(inp.n_valid - 1, 0)
    logits, cache = Transformer(cfg).apply({"params": params}, inp.tokens, meta, cache,
                                           backend=backend, logits_index=last)
    logits = suppress(logits, inp)[:, 0]  # [B, V]

    # A sequence's sampler row was filled from its tokens when it was (re)admitted
    # (``init_sampler_rows``); each step only adds the tokens it emits.
    counts = sstate.counts[inp.slot_ids]
    pmask = sstate.prompt_mask[inp.slot_ids]
    new_pos = inp.q_start + inp.n_valid  # where the sampled token will sit
    out = sampling.sample(logits, inp.sampling, new_pos, counts, pmask,
                          num_logprobs=num_logprobs)
    counts = sampling.update_counts(counts, out.tokens, inp.emit)
    sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids].set(counts))
    result = StepOutput(tokens=out.tokens, logprobs=out.logprobs, top_ids=out.top_ids,
                        top_logprobs=out.top_logprobs)
    return result, cache, sstate


def _verify_step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput,
                 draft_tokens: Array, num_draft: Array, draft_probs, *, cfg: ModelConfig,
                 backend: str):
    """Speculative verify: tokens [B, K+1] = [last committed, draft_0..draft_{K-1}].

    One forward over all K+1 positions writes their K/V and scores them; the pure verifier then
    keeps the longest accepted prefix plus one target token. K/V written for rejected drafts is
    never read: attention stops at each sequence's length, and the next step overwrites it.
    """
    from llmserve import speculative

    b, t = inp.tokens.shape
    meta = _metadata(inp)
    logits, cache = Transformer(cfg).apply({"params": params}, inp.tokens, meta, cache,
                                           backend=backend)  # [B, K+1, V]
    rows = jnp.arange(b)[:, None]
    counts = sstate.counts[inp.slot_ids]
    pmask = sstate.prompt_mask[inp.slot_ids]
    logits = suppress(logits, inp)  # min_tokens: only positions still under it
    out = speculative.verify(draft_tokens, draft_probs, logits, inp.sampling, inp.q_start + 1,
                             counts, pmask, num_draft=num_draft)
    emitted = (out.out_tokens >= 0) & inp.emit[:, None]
    counts = counts.at[rows, jnp.maximum(out.out_tokens, 0)].add(emitted.astype(jnp.int32))
    sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids].set(counts))
    return out, cache, sstate


_jit_verify = jax.jit(_verify_step, static_argnames=("cfg", "backend"),
                      donate_argnames=("cache", "sstate"))

@functools.partial(jax.jit, donate_argnames=("sstate",))
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
    return SamplerState(counts=sstate.counts.at[slots].set(counts),
                        prompt_mask=sstate.prompt_mask.at[slots].set(pmask))


# Module-level jits with static config: every Runner of the same model and shapes shares one
# compile cache (tests build many engines; a server builds one).
_jit_step = jax.jit(_step, static_argnames=("cfg", "backend", "num_logprobs"),
                    donate_argnames=("cache", "sstate"))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_pages(cache: PagedKVCache, src: Array, dst: Array) -> PagedKVCache:
    return cache.copy_pages(src, dst)


class Runner:
    """Owns the device state (params, paged cache, sampler state) and the compiled steps."""

    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 max_slots: int, max_model_len: int, backend: str, num_logprobs: int = 0,
                 decode_buckets: Sequence[int] | None = None,
                 prefill_buckets: Sequence[tuple[int, int]] = ((1, 128),)):
        self.cfg = cfg
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = -(-max_model_len // page_size)
        self.num_logprobs = num_logprobs
        self.cache = PagedKVCache.create(cfg, num_pages, page_size)
        self.sstate = SamplerState.create(max_slots, cfg.vocab_size)
        if decode_buckets is None:
            decode_buckets = sorted({min(max_slots, 1 << i) for i in range(3, 12)}
                                    | {max_slots})
        self.decode_buckets = sorted(decode_buckets)
        self.prefill_buckets = sorted(prefill_buckets, key=lambda x: (x[0] * x[1], x))
        self.backend = backend

    # ------------------------------------------------------------------ shapes
    def decode_bucket(self, n: int) -> int:
        """The smallest decode batch bucket holding n rows."""
        for b in self.decode_buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decode rows exceed the largest bucket {self.decode_buckets[-1]}")

    def prefill_bucket(self, rows: int, longest: int) -> tuple[int, int]:
        """The cheapest (rows, chunk) bucket holding ``rows`` chunks of up to ``longest``."""
        for b, c in self.prefill_buckets:
            if b >= rows and c >= longest:
                return b, c
        raise ValueError(f"no prefill bucket holds {rows} rows of {longest} tokens")

    @property
    def max_prefill_rows(self) -> int:
        return max(b for b, _ in self.prefill_buckets)

    @property
    def max_chunk(self) -> int:
        return max(c for _, c in self.prefill_buckets)

    def empty_input(self, b: int, t: int) -> dict:
        """Host arrays for a [b, t] step with every row padding."""
        return dict(
            tokens=np.zeros((b, t), np.int32), q_start=np.zeros(b, np.int32),
            n_valid=np.zeros(b, np.int32),
            block_tables=np.full((b, self.pages_per_seq), DUMMY_PAGE, np.int32),
            slot_ids=np.full(b, self.max_slots, np.int32), emit=np.zeros(b, bool),
            suppress_ids=np.full((b, MAX_SUPPRESS_IDS), self.cfg.vocab_size, np.int32),
            suppress_until=np.zeros(b, np.int32), sampling=[{} for _ in range(b)])

    # ------------------------------------------------------------------ execution
    def run(self, host: dict) -> StepOutput:
        """Runs one step from host arrays (see ``empty_input``); returns device outputs."""
        inp = self._device_input(host)
        out, self.cache, self.sstate = _jit_step(self.params, self.cache, self.sstate, inp,
                                                 cfg=self.cfg, backend=self.backend,
                                                 num_logprobs=self.num_logprobs)
        return out

    def _device_input(self, host: dict) -> StepInput:
        return StepInput(
            tokens=jnp.asarray(host["tokens"]), q_start=jnp.asarray(host["q_start"]),
            n_valid=jnp.asarray(host["n_valid"]), block_tables=jnp.asarray(host["block_tables"]),
            slot_ids=jnp.asarray(host["slot_ids"]), emit=jnp.asarray(host["emit"]),
            suppress_ids=jnp.asarray(host["suppress_ids"]),
            suppress_until=jnp.asarray(host["suppress_until"]),
            sampling=sampling.SamplingArrays.from_lists(host["sampling"]))

    def run_verify(self, host: dict, draft_tokens, num_draft, draft_probs=None):
        """Runs one verify step; host arrays as for ``run`` with T = K + 1."""
        inp = self._device_input(host)
        out, self.cache, self.sstate = _jit_verify(
            self.params, self.cache, self.sstate, inp, jnp.asarray(draft_tokens),
            jnp.asarray(num_draft), draft_probs, cfg=self.cfg, backend=self.backend)
        return out

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates page src into dst for each pair (padded to a bucket)."""
        if not pairs:
            return
        n = 1 << max(0, (len(pairs) - 1).bit_length())
        src = np.full(max(n, 8), DUMMY_PAGE, np.int32)
        dst = np.full(max(n, 8), DUMMY_PAGE, np.int32)
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        self.cache = _copy_pages(self.cache, jnp.asarray(src), jnp.asarray(dst))

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
            self.sstate = _init_sampler_rows(self.sstate, jnp.asarray(slots), jnp.asarray(ids),
                                             jnp.asarray(n_prompt), jnp.asarray(n_total))

    def warmup(self) -> None:
        """Compiles every bucket once (all rows padding: writes go to the dummy page)."""
        for b in self.decode_buckets:
            jax.block_until_ready(self.run(self.empty_input(b, 1)).tokens)
        for b, c in self.prefill_buckets:
            jax.block_until_ready(self.run(self.empty_input(b, c)).tokens)
        self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        self.init_sampler_rows([(self.max_slots, [0], 1)])

    def num_compilations(self) -> int:
        """Executables the jitted steps hold, process-wide (grows only for a new shape)."""
        return (_jit_step._cache_size() + _copy_pages._cache_size()
                + _jit_verify._cache_size() + _init_sampler_rows._cache_size())
