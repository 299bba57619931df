"""The device side: ONE jitted, fixed-shape step for everything scheduled together.

A step's tokens are one flat vector ``[N]`` made of rectangular *parts*: the decode part
``[Bd, 1]`` (one token per running sequence) and the prefill part ``[Bp, C]`` (prompt chunks);
a verify step is one part ``[Bv, 1 + R]``. Every weight matmul runs once over the flat tokens,
so the weights are read once per step; attention splits them back into their parts and runs
the paged kernel per part (the idea of tpu-inference's ragged attention, split by shape).
Cost follows the real work through a small set of buckets: ``(Bd, Bp, C)`` with ``Bd = 0`` or
``Bp = 0`` when a part is absent, all compiled at warm-up. Which rows are live is data
(``lengths``), never a Python branch; padding tokens write to the dummy page.

The host side of a step is a typed ``StepInput`` of numpy arrays built by ``prepare``; it moves
to the device in one ``device_put``. The cache and the sampler state are donated and updated in
place.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llmserve import sampling
from llmserve.config import ModelConfig
from llmserve.kv_cache import DUMMY_PAGE, PagedKVCache, PartMetadata, RaggedMetadata
from llmserve.model import Transformer
from llmserve.speculative.verify import verify

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


@dataclasses.dataclass
class ScheduledRow:
    """One row of a step, as the engine hands it to ``Runner.prepare`` (host, plain Python)."""

    tokens: Sequence[int]  # the row's real tokens (decode: 1; prefill: a chunk; verify: 1)
    start: int  # position of tokens[0]
    block_table: Sequence[int]  # the sequence's pages
    slot: int  # its sampler-state row
    emit: bool  # the sampled token is kept (decode, verify, or a final prefill chunk)
    sampling: dict  # SamplingArrays fields (temperature, top_k, ..., seed)
    suppress_ids: Sequence[int] = ()  # stop ids banned while min_tokens is not reached
    suppress_until: int = 0  # ... for this many sampled positions


@flax.struct.dataclass
class StepInput:
    """Everything one step needs (numpy on the host, jax arrays on the device).

    N flat tokens; R sampled rows (the rows of every part, in part order).
    """

    tokens: Array  # [N] int32
    positions: Array  # [N] int32: each token's absolute position (RoPE)
    write_page: Array  # [N] int32: page its K/V goes to (dummy page 0 for padding)
    write_offset: Array  # [N] int32: offset in that page
    parts: tuple  # PartMetadata per part: q_start [B], lengths [B], block_tables [B, M]
    sample_index: Array  # [R] int32: flat index of the token whose logits row r samples from
    sample_pos: Array  # [R] int32: position the sampled token will take (its random key)
    slot_ids: Array  # [R] int32: row in SamplerState (max_slots for padding rows)
    emit: Array  # [R] bool: the sampled token is kept
    suppress_ids: Array  # [R, E] int32: token ids banned (min_tokens not reached); V = none
    suppress_until: Array  # [R] int32: the ban holds for this many sampled positions
    sampling: sampling.SamplingArrays  # [R] per-row parameters
    per_token: Optional[PartMetadata] = None  # batch-invariant mode: one query per token

    def metadata(self) -> RaggedMetadata:
        return RaggedMetadata(positions=self.positions[None], write_page=self.write_page,
                              write_offset=self.write_offset, parts=self.parts,
                              per_token=self.per_token)


@flax.struct.dataclass
class StepOutput:
    tokens: Array  # [R] int32
    logprobs: Array  # [R] float32
    top_ids: Array  # [R, n] int32
    top_logprobs: Array  # [R, n] float32


def suppress(logits: Array, inp: StepInput) -> Array:
    """logits [R, T, V]: bans ``suppress_ids`` at sampled positions t < ``suppress_until``."""
    r, t, v = logits.shape
    active = jnp.arange(t)[None, :] < inp.suppress_until[:, None]  # [R, T]
    ids = jnp.where(active[:, :, None], inp.suppress_ids[:, None, :], v)
    return logits.at[jnp.arange(r)[:, None, None], jnp.arange(t)[None, :, None], ids].set(
        -jnp.inf, mode="drop")


def forward(params, cache: PagedKVCache, inp: StepInput, *, cfg: ModelConfig, backend: str,
            logits_index: Optional[Array] = None, min_rows: int = 1):
    """The model over a step's flat tokens -> (logits [R, V] at ``logits_index``, default
    ``sample_index``; cache). ``min_rows`` pads the vocabulary projection to at least that many
    rows (batch-invariant mode: the matmul's numerics then never depend on R)."""
    index = inp.sample_index if logits_index is None else logits_index
    r = index.shape[0]
    index = jnp.pad(index, (0, max(0, min_rows - r)))
    logits, cache = Transformer(cfg).apply({"params": params}, inp.tokens[None],
                                           inp.metadata(), cache, backend=backend,
                                           logits_index=index[None])
    if cache.shardings is not None:  # vocab-split logits: gathered once, sampled locally
        logits = cache.shardings.gather_logits(logits, cfg.vocab_size)
    return logits[0, :r], cache


def _step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput, *,
          cfg: ModelConfig, backend: str, num_logprobs: int, min_rows: int = 1):
    logits, cache = forward(params, cache, inp, cfg=cfg, backend=backend, min_rows=min_rows)
    logits = suppress(logits[:, None], inp)[:, 0]  # [R, V]
    # A sequence's sampler row was filled from its tokens when it was (re)admitted
    # (``init_sampler_rows``); each step only adds the tokens it emits.
    counts = sstate.counts[inp.slot_ids]
    pmask = sstate.prompt_mask[inp.slot_ids]
    out = sampling.sample(logits, inp.sampling, inp.sample_pos, counts, pmask,
                          num_logprobs=num_logprobs)
    counts = sampling.update_counts(counts, out.tokens, inp.emit)
    sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids].set(counts))
    result = StepOutput(tokens=out.tokens, logprobs=out.logprobs, top_ids=out.top_ids,
                        top_logprobs=out.top_logprobs)
    return result, cache, sstate


def _verify_step(params, cache: PagedKVCache, sstate: SamplerState, inp: StepInput,
                 draft_tokens: Array, num_draft: Array, draft_probs, *, cfg: ModelConfig,
                 backend: str, min_rows: int = 1):
    """Speculative verify over one part [B, 1 + R]: [last committed token, R drafts] per row.

    The drafts (from the host or straight from the draft model's device output) enter the
    tokens here, inside the jit. One forward over all 1 + R positions writes their K/V and
    scores them; the pure verifier keeps the longest accepted prefix plus one target token.
    K/V written for rejected drafts is never read: attention stops at each sequence's length,
    and the next step overwrites it.
    """
    (part,) = inp.parts
    b, t = part.block_tables.shape[0], part.t
    rows = inp.tokens[: b * t].reshape(b, t).at[:, 1:].set(draft_tokens.astype(jnp.int32))
    inp = inp.replace(tokens=jnp.concatenate([rows.reshape(-1), inp.tokens[b * t:]]))
    logits, cache = forward(params, cache, inp, cfg=cfg, backend=backend,
                            logits_index=jnp.arange(b * t), min_rows=min_rows)
    logits = suppress(logits.reshape(b, t, -1), inp)  # [B, 1 + R, V]
    rows = jnp.arange(b)[:, None]
    counts = sstate.counts[inp.slot_ids]
    pmask = sstate.prompt_mask[inp.slot_ids]
    out = verify(draft_tokens, draft_probs, logits, inp.sampling, part.q_start + 1,
                             counts, pmask, num_draft=num_draft)
    emitted = (out.out_tokens >= 0) & inp.emit[:, None]
    counts = counts.at[rows, jnp.maximum(out.out_tokens, 0)].add(emitted.astype(jnp.int32))
    sstate = sstate.replace(counts=sstate.counts.at[inp.slot_ids].set(counts))
    return out, cache, sstate


# Module-level jits with static config: every Runner of the same model and shapes shares one
# compile cache (tests build many engines; a server builds one).
_jit_step = jax.jit(_step, static_argnames=("cfg", "backend", "num_logprobs", "min_rows"),
                    donate_argnames=("cache", "sstate"))
_jit_verify = jax.jit(_verify_step, static_argnames=("cfg", "backend", "min_rows"),
                      donate_argnames=("cache", "sstate"))


def invariant_min_rows(dtype: str) -> int:
    """Rows below which XLA:CPU's matmuls and batched attention change their summation order
    (measured: fp32 dots give one result for 1 row, another for 2-32 and another from 48 up;
    bf16 with f32 accumulation one for 1 row and another from 2 up; fp32 attention batches
    differ below 8). Batch-invariant steps pad to at least this many tokens, logits rows and
    attention queries, so every row is computed the same way whatever shares the step."""
    return 8 if "bfloat16" in str(dtype) else 64


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


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_pages(cache: PagedKVCache, src: Array, dst: Array) -> PagedKVCache:
    return cache.copy_pages(src, dst)


class Runner:
    """Owns the device state (params, paged cache, sampler state) and the compiled step."""

    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 max_slots: int, max_model_len: int, backend: str, num_logprobs: int = 0,
                 decode_buckets: Sequence[int] | None = None,
                 prefill_buckets: Sequence[tuple[int, int]] = ((1, 128),),
                 mixed_decode_buckets: Sequence[int] | None = None,
                 batch_invariant: bool = False, shardings=None):
        # ``shardings`` (llmserve.sharding.Shardings, or None for one device): the mesh this
        # runner's params and cache are split over; the jitted step follows their shardings.
        self.shardings = shardings
        if shardings is None:
            self.params = jax.tree_util.tree_map(jnp.asarray, params)
            self.cache = PagedKVCache.create(cfg, num_pages, page_size)
            self.sstate = SamplerState.create(max_slots, cfg.vocab_size)
        else:
            cfg, self.params = shardings.prepare_model(cfg, params)  # may expand kv heads
            self.cache = shardings.create_cache(cfg, num_pages, page_size)
            self.sstate = shardings.replicate(SamplerState.create(max_slots, cfg.vocab_size))
        self.cfg = cfg
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = -(-max_model_len // page_size)
        self.num_logprobs = num_logprobs
        if decode_buckets is None:
            decode_buckets = default_decode_buckets(max_slots, cfg.dtype)
        self.decode_buckets = sorted(decode_buckets)
        # Steps that carry prefill chunks pad their decode rows to one of these (default: the
        # largest decode bucket): beside a chunk the extra rows cost little, and the compiled
        # set stays |decode| + 2 |prefill| shapes instead of |decode| x |prefill|.
        self.mixed_decode_buckets = sorted(mixed_decode_buckets or [self.decode_buckets[-1]])
        self.prefill_buckets = sorted(prefill_buckets, key=lambda x: (x[0] * x[1], x))
        self.backend = backend
        self.batch_invariant = batch_invariant
        self.min_rows = invariant_min_rows(cfg.dtype) if batch_invariant else 1

    # ------------------------------------------------------------------ shapes
    def decode_bucket(self, n: int, mixed: bool = False) -> int:
        """The smallest decode bucket holding n rows (``mixed``: beside prefill chunks)."""
        for b in self.mixed_decode_buckets if mixed else self.decode_buckets:
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

    def step_shapes(self) -> list[tuple]:
        """Every (decode rows, (prefill rows, chunk)) shape a step can take: decode alone,
        prefill alone, and mixed. All are compiled at warm-up, so serving never compiles."""
        return ([(d, None) for d in self.decode_buckets]
                + [(0, p) for p in self.prefill_buckets]
                + list(itertools.product(self.mixed_decode_buckets, self.prefill_buckets)))

    # ------------------------------------------------------------------ host batch
    def prepare(self, decode: Sequence[ScheduledRow], prefill: Sequence[ScheduledRow] = (),
                decode_width: int = 1) -> StepInput:
        """Builds the typed host batch (numpy) for one step from its scheduled rows.

        ``decode`` rows get a part [Bd, decode_width] (width 1 + R for verify), ``prefill``
        rows a part [Bp, C]; each part is padded to its bucket, and an empty one is left out.
        """
        parts = []
        if decode:
            parts.append((decode, self.decode_bucket(len(decode), mixed=bool(prefill)),
                          decode_width))
        if prefill:
            b, c = self.prefill_bucket(len(prefill), max(len(r.tokens) for r in prefill))
            parts.append((prefill, b, c))
        return self._build(parts)

    def empty_batch(self, shape: tuple, decode_width: int = 1) -> StepInput:
        """A batch of the given ``step_shapes()`` entry with every row padding (warm-up)."""
        d, p = shape
        parts = ([([], d, decode_width)] if d else []) + ([([], p[0], p[1])] if p else [])
        return self._build(parts)

    def _build(self, parts) -> StepInput:
        n = max(sum(b * t for _, b, t in parts), self.min_rows)
        r = sum(b for _, b, _ in parts)
        size, m, v = self.page_size, self.pages_per_seq, self.cfg.vocab_size
        tokens = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        write_page = np.full(n, DUMMY_PAGE, np.int32)
        write_offset = np.zeros(n, np.int32)
        sample_index = np.zeros(r, np.int32)
        sample_pos = np.zeros(r, np.int32)
        slot_ids = np.full(r, self.max_slots, np.int32)
        emit = np.zeros(r, bool)
        suppress_ids = np.full((r, MAX_SUPPRESS_IDS), v, np.int32)
        suppress_until = np.zeros(r, np.int32)
        rows_sampling: list[dict] = [{} for _ in range(r)]
        metas = []
        off = row = 0
        for rows, b, t in parts:
            q_start = np.zeros(b, np.int32)
            lengths = np.zeros(b, np.int32)
            tables = np.full((b, m), DUMMY_PAGE, np.int32)
            for i, spec in enumerate(rows):
                k = len(spec.tokens)
                base = off + i * t
                pos = spec.start + np.arange(k)
                table = np.asarray(spec.block_table, np.int32)
                tokens[base:base + k] = spec.tokens
                positions[base:base + k] = pos
                write_page[base:base + k] = table[pos // size]
                write_offset[base:base + k] = pos % size
                q_start[i], lengths[i] = spec.start, spec.start + k
                tables[i, : len(table)] = table
                j = row + i
                sample_index[j] = base + k - 1
                sample_pos[j] = spec.start + k
                slot_ids[j], emit[j] = spec.slot, spec.emit
                suppress_ids[j, : len(spec.suppress_ids)] = spec.suppress_ids
                suppress_until[j] = spec.suppress_until
                rows_sampling[j] = spec.sampling
            for i in range(len(rows), b):  # padding rows sample from their own (dummy) token
                sample_index[row + i] = off + i * t
            metas.append(PartMetadata(q_start=q_start, lengths=lengths, block_tables=tables,
                                      t=t))
            off += b * t
            row += b
        per_token = self._per_token(metas, positions, write_page) \
            if self.batch_invariant else None
        return StepInput(tokens=tokens, positions=positions, write_page=write_page,
                         write_offset=write_offset, parts=tuple(metas), per_token=per_token,
                         sample_index=sample_index, sample_pos=sample_pos, slot_ids=slot_ids,
                         emit=emit, suppress_ids=suppress_ids, suppress_until=suppress_until,
                         sampling=sampling.SamplingArrays.from_lists(rows_sampling, xp=np))

    def _per_token(self, metas, positions: np.ndarray, write_page: np.ndarray) -> PartMetadata:
        """Batch-invariant attention metadata: each real token is a one-token query of its
        own sequence (q_start = its position, its row's block table); padding sees nothing."""
        owner = np.concatenate([np.repeat(np.arange(len(m.q_start)), m.t) + sum(
            len(p.q_start) for p in metas[:i]) for i, m in enumerate(metas)])  # token -> row
        tables = np.concatenate([m.block_tables for m in metas])  # [rows, M]
        nq = max(len(positions), self.min_rows)
        q_start = np.zeros(nq, np.int32)
        lengths = np.zeros(nq, np.int32)
        tok_tables = np.full((nq, tables.shape[1]), DUMMY_PAGE, np.int32)
        real = np.flatnonzero(write_page[: len(owner)] != DUMMY_PAGE)  # live pages only
        q_start[real] = positions[real]
        lengths[real] = positions[real] + 1
        tok_tables[real] = tables[owner[real]]
        return PartMetadata(q_start=q_start, lengths=lengths, block_tables=tok_tables, t=1)

    # ------------------------------------------------------------------ execution
    def run(self, batch: StepInput) -> StepOutput:
        """Runs one step (one device call) from a host batch; returns device outputs."""
        inp = self.put(batch)
        out, self.cache, self.sstate = _jit_step(self.params, self.cache, self.sstate, inp,
                                                 cfg=self.cfg, backend=self.backend,
                                                 num_logprobs=self.num_logprobs,
                                                 min_rows=self.min_rows)
        return out if self.shardings is None else self.shardings.local(out)

    def put(self, tree):
        """Host arrays -> device, in one transfer (replicated over the mesh when sharded)."""
        if self.shardings is None:
            return jax.device_put(tree)
        return self.shardings.replicate(tree)

    def lower_step(self, batch: StepInput):
        """The step for ``batch``'s shape, lowered (``.compile().as_text()`` is its HLO after
        partitioning: what experiments/sharding.py and the tests read for collectives)."""
        return _jit_step.lower(self.params, self.cache, self.sstate, self.put(batch),
                               cfg=self.cfg, backend=self.backend,
                               num_logprobs=self.num_logprobs, min_rows=self.min_rows)

    def run_verify(self, batch: StepInput, draft_tokens, num_draft, draft_probs=None):
        """Runs one verify step: ``batch`` from ``prepare(rows, decode_width=1 + R)``;
        draft_tokens [B, R] (host or device) enter the tokens inside the jit."""
        inp = self.put(batch)
        out, self.cache, self.sstate = _jit_verify(
            self.params, self.cache, self.sstate, inp, jnp.asarray(draft_tokens),
            jnp.asarray(num_draft), draft_probs, cfg=self.cfg, backend=self.backend,
            min_rows=self.min_rows)
        return out if self.shardings is None else self.shardings.local(out)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: duplicates page src into dst for each pair (padded to a bucket)."""
        if not pairs:
            return
        n = 1 << max(0, (len(pairs) - 1).bit_length())
        src = np.full(max(n, 8), DUMMY_PAGE, np.int32)
        dst = np.full(max(n, 8), DUMMY_PAGE, np.int32)
        for i, (s, d) in enumerate(pairs):
            src[i], dst[i] = s, d
        self.cache = _copy_pages(self.cache, *self.put((src, dst)))

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
            self.sstate = _init_sampler_rows(self.sstate, *self.put((slots, ids, n_prompt,
                                                                     n_total)))

    def reset(self) -> None:
        """Fresh (zeroed) cache and sampler state, e.g. after a failed step consumed the
        donated buffers; compiled steps are kept."""
        num_pages = self.cache.num_pages
        sstate = SamplerState.create(self.max_slots, self.cfg.vocab_size)
        if self.shardings is None:
            self.cache = PagedKVCache.create(self.cfg, num_pages, self.page_size)
            self.sstate = sstate
        else:
            self.cache = self.shardings.create_cache(self.cfg, num_pages, self.page_size)
            self.sstate = self.shardings.replicate(sstate)

    def warmup(self) -> None:
        """Compiles every step shape once (all rows padding: writes go to the dummy page)."""
        for shape in self.step_shapes():
            jax.block_until_ready(self.run(self.empty_batch(shape)).tokens)
        self.copy_pages([(DUMMY_PAGE, DUMMY_PAGE)])
        self.init_sampler_rows([(self.max_slots, [0], 1)])

    def num_compilations(self) -> int:
        """Executables the jitted steps hold, process-wide (grows only for a new shape)."""
        return (_jit_step._cache_size() + _copy_pages._cache_size()
                + _jit_verify._cache_size() + _init_sampler_rows._cache_size())


def part_arrays(batch: StepInput, index: int) -> tuple[np.ndarray, ...]:
    """Part ``index`` of a host batch in row form: (tokens [B, T], q_start [B], n_valid [B],
    block_tables [B, M]), for a draft model that mirrors the target's prefill."""
    part = batch.parts[index]
    off = sum(p.block_tables.shape[0] * p.t for p in batch.parts[:index])
    b, t = part.block_tables.shape[0], part.t
    tokens = np.asarray(batch.tokens[off:off + b * t]).reshape(b, t)
    return tokens, part.q_start, part.lengths - part.q_start, part.block_tables


def padded_verify_rows(rows: Sequence[ScheduledRow], num_draft: Optional[np.ndarray],
                       width: int) -> list[ScheduledRow]:
    """Verify rows: each row's token list padded with placeholders for its drafts (the
    drafts themselves enter inside the jit), so K/V write slots exist for 1 + num_draft."""
    out = []
    for i, row in enumerate(rows):
        k = 0 if num_draft is None else int(num_draft[i])
        out.append(dataclasses.replace(row, tokens=list(row.tokens) + [0] * min(k, width - 1)))
    return out


def default_decode_buckets(max_slots: int, dtype: str) -> list[int]:
    """Decode batch buckets chosen by measurement (experiments/matmul.py, SmolLM2 on this CPU).

    bf16 weight matmuls cost about the same from 1 to 8 rows (25.8 / 23.4 / 25.4 / 27.1 ms), so
    the smallest bf16 bucket is 8. fp32 at 1 row is a matrix-vector product (21 ms) and cheaper
    than 2-8 rows (29-44 ms), so fp32 also keeps a 1-row bucket for the last running request.
    Then powers of two from 8 up to ``max_slots``.
    """
    smallest = 8 if "bfloat16" in str(dtype) else 1
    return sorted({min(max_slots, smallest)} | {min(max_slots, 1 << i) for i in range(3, 12)}
                  | {max_slots})


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
