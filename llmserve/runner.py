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
    prompt_len: Array  # [B] int32: positions below this are prompt tokens
    block_tables: Array  # [B, M] int32
    slot_ids: Array  # [B] int32: row in SamplerState (max_slots for padding rows)
    reset: Array  # [B] bool: first chunk of a (re)started sequence: clear its sampler row
    emit: Array  # [B] bool: the sampled token is kept (final prefill chunk, or decode)
    suppress_ids: Array  # [B, E] int32: token ids banned this step (min_tokens); V = none
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


def _step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput, *,
          cfg: ModelConfig, backend: str, num_logprobs: int):
    b, t = inp.tokens.shape
    meta = _metadata(inp)
    positions, token_mask = meta.positions, meta.token_mask
    last = jnp.maximum(inp.n_valid - 1, 0)
    logits, cache = Transformer(cfg).apply({"params": params}, inp.tokens, meta, cache,
                                           backend=backend, logits_index=last)
    logits = logits[:, 0]  # [B, V]

    rows = jnp.arange(b)[:, None]
    counts = jnp.where(inp.reset[:, None], 0, sstate.counts[inp.slot_ids])
    pmask = jnp.where(inp.reset[:, None], False, sstate.prompt_mask[inp.slot_ids])
    if t > 1:  # prefill: record prompt tokens; recomputed outputs (after preemption) count
        is_prompt = positions < inp.prompt_len[:, None]
        pmask = pmask.at[rows, inp.tokens].max(token_mask & is_prompt)
        counts = counts.at[rows, inp.tokens].add((token_mask & ~is_prompt).astype(jnp.int32))
    logits = logits.at[rows, inp.suppress_ids].set(-jnp.inf, mode="drop")
    new_pos = inp.q_start + inp.n_valid  # where the sampled token will sit
    out = sampling.sample(logits, inp.sampling, new_pos, counts, pmask,
                          num_logprobs=num_logprobs)
    counts = sampling.update_counts(counts, out.tokens, inp.emit)
    sstate = SamplerState(counts=sstate.counts.at[inp.slot_ids].set(counts),
                          prompt_mask=sstate.prompt_mask.at[inp.slot_ids].set(pmask))
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
    logits = logits.at[rows[:, :, None], jnp.arange(t)[None, :, None],
                       inp.suppress_ids[:, None, :]].set(-jnp.inf, mode="drop")
    out = speculative.verify(draft_tokens, draft_probs, logits, inp.sampling, inp.q_start + 1,
                             counts, pmask, num_draft=num_draft)
    emitted = (out.out_tokens >= 0) & inp.emit[:, None]
    counts = counts.at[rows, jnp.maximum(out.out_tokens, 0)].add(emitted.astype(jnp.int32))
    sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids].set(counts))
    return out, cache, sstate


_jit_verify = jax.jit(_verify_step, static_argnames=("cfg", "backend"),
                      donate_argnames=("cache", "sstate"))

@functools.partial(jax.jit, donate_argnames=("sstate",))
def _copy_sampler_rows(sstate: SamplerState, src: Array, dst: Array) -> SamplerState:
    # The child shares the parent's prompt, not its outputs: copy the prompt mask, zero counts.
    return SamplerState(counts=sstate.counts.at[dst].set(0),
                        prompt_mask=sstate.prompt_mask.at[dst].set(sstate.prompt_mask[src]))


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
            n_valid=np.zeros(b, np.int32), prompt_len=np.zeros(b, np.int32),
            block_tables=np.full((b, self.pages_per_seq), DUMMY_PAGE, np.int32),
            slot_ids=np.full(b, self.max_slots, np.int32), reset=np.zeros(b, bool),
            emit=np.zeros(b, bool), suppress_ids=np.full((b, 4), self.cfg.vocab_size, np.int32),
            sampling=[{} for _ in range(b)])

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
            n_valid=jnp.asarray(host["n_valid"]), prompt_len=jnp.asarray(host["prompt_len"]),
            block_tables=jnp.asarray(host["block_tables"]),
            slot_ids=jnp.asarray(host["slot_ids"]), reset=jnp.asarray(host["reset"]),
            emit=jnp.asarray(host["emit"]), suppress_ids=jnp.asarray(host["suppress_ids"]),
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

    def copy_sampler_rows(self, pairs: Sequence[tuple[int, int]]) -> None:
        """n > 1: a forked child takes its parent's prompt statistics (slot src -> dst)."""
        if not pairs:
            return
        src = np.full(self.max_slots, self.max_slots, np.int32)
        dst = np.full(self.max_slots, self.max_slots, np.int32)
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        self.sstate = _copy_sampler_rows(self.sstate, jnp.asarray(src), jnp.asarray(dst))

    def warmup(self) -> None:
        """Compiles every bucket once (all rows padding: writes go to the dummy page)."""
        for b in self.decode_buckets:
            jax.block_until_ready(self.run(self.empty_input(b, 1)).tokens)
        for b, c in self.prefill_buckets:
            jax.block_until_ready(self.run(self.empty_input(b, c)).tokens)
        self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        self.copy_sampler_rows([(self.max_slots, self.max_slots)])

    def num_compilations(self) -> int:
        """Executables the jitted steps hold, process-wide (grows only for a new shape)."""
        return (_jit_step._cache_size() + _copy_pages._cache_size()
                + _jit_verify._cache_size() + _copy_sampler_rows._cache_size())
