"""The host batch of one step: its typed arrays (numpy) and the bucket each part pads to.

The engine hands the rows it scheduled (``ScheduledRow``) to a ``BatchBuilder``, which picks
each part's bucket (decode ``[Bd, 1]``, verify ``[Bv, 1 + D]``, prefill ``[Bp, C]``) from the
few shapes compiled at warm-up and fills one ``StepInput`` of numpy arrays in flat-token order;
the runner moves it to the device in one ``device_put``. Numpy only: this module imports no
jax. The batch types are plain frozen dataclasses; the runner registers them as pytrees
(fields marked ``STATIC`` are part of the compiled shape, not arrays).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence

import numpy as np

from llmserve.sampling_params import SamplingArrays

Array = Any  # numpy on the host, jax.Array once the runner has moved the batch to the device

DUMMY_PAGE = 0  # page 0 is reserved: padding tokens write there, never into a live page
MAX_SUPPRESS_IDS = 32  # stop ids a min_tokens request may ban (EOS ids + stop_token_ids)
STATIC = {"static": True}  # a pytree metadata field (jax.tree_util.register_dataclass)


class _Pytree:
    """``replace`` for the frozen batch types (as flax.struct dataclasses have it)."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class PartMetadata(_Pytree):
    """One rectangular part [B, t] of a step's flat tokens (decode, prefill chunks, verify).

    Row b's tokens sit at ``q_start[b] + i`` for i < ``lengths[b] - q_start[b]``; the rest of
    its t tokens are padding. Padding rows have ``lengths == q_start == 0``. A prefill chunk
    longer than t spans consecutive rows (blocks of t tokens of one sequence, only the last
    one partial), so several chunks of any length pack into one part; the part then samples
    one row per chunk (``samples`` rows, fewer than B), not one per block.
    """

    q_start: Array  # [B] int32
    lengths: Array  # [B] int32: valid kv length after this step's tokens are written
    block_tables: Array  # [B, pages_per_seq] int32
    t: int = dataclasses.field(metadata=STATIC)  # tokens per row (part of the shape)
    samples: int = dataclasses.field(default=0, metadata=STATIC)  # sampled rows (0: B)

    @property
    def num_samples(self) -> int:
        """Rows of the step's R sampled rows that belong to this part."""
        return self.samples or self.block_tables.shape[0]


@dataclasses.dataclass(frozen=True)
class RaggedMetadata(_Pytree):
    """A step's flat tokens [N] (batch dim 1): its parts in order, and where each token's K/V
    is written (computed on the host from the block tables; padding goes to the dummy page)."""

    positions: Array  # [1, N] int32: absolute positions (RoPE)
    write_page: Array  # [N] int32
    write_offset: Array  # [N] int32
    parts: tuple  # PartMetadata, in flat order
    # Batch-invariant mode: every token attends alone, as a one-token query of its own
    # sequence, so its bits never depend on its part's shape or on which tokens share the
    # step. None in the default mode (parts attend as [B, t] batches).
    per_token: Optional[PartMetadata] = None  # [Nq >= N] rows, t = 1
    # [] int32: the flat tokens [0, live_tokens) hold every real token (the rest is the step's
    # bucket padding, which the native matmuls skip); None: every token may be real.
    live_tokens: Optional[Array] = None


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
    # In a verify step ``tokens`` is [last committed token, its drafts] (the draft tokens may be
    # placeholders that a draft model's device output replaces inside the step).
    carry_feature: bool = False  # EAGLE: the slot holds this row's h_{start-1} (continuing)
    top_logprobs: bool = False  # the request asked for its top-n logprobs
    # Async scheduling: tokens[0] is a placeholder; the step takes the token its slot emitted
    # last (the previous step's, still on the device when this step was built).
    feed: bool = False


@dataclasses.dataclass(frozen=True)
class HeadInput(_Pytree):
    """Where the EAGLE head's input features come from. The head's input at position p is
    (h_{p-1}, x_p), stored at p like the target's K/V: within a row h_{p-1} is the target's
    hidden state of the token before; a row's first token takes its slot's carried feature
    (the last step's), or zero at position 0 and after (re)admission."""

    prev: Array  # [N] int32: flat index of the token before in the same row, else -1
    first_row: Array  # [N] int32: the row whose first token this is, else -1
    carry: Array  # [R] bool: the slot's carried feature is this row's h_{start-1}
    draft: Array  # [] bool: draft for the next step (False: the next step will not verify)
    tables: Array  # [R, pages_per_seq] int32: each sampled row's block table (its drafts)

@dataclasses.dataclass(frozen=True)
class StepInput(_Pytree):
    """Everything one step needs (numpy on the host, jax arrays on the device).

    N flat tokens; R sampled rows (the rows of every part, in part order). In a verify step the
    first part is [Bv, 1 + D] (D = ``num_speculative_tokens``, or fewer for a large Bv:
    ``BatchBuilder.verify_drafts``): each row's last committed token and its drafts, all scored
    at once.
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
    sampling: SamplingArrays  # [R] per-row parameters
    num_draft: Array  # [R] int32: drafts a verify row carries (0 elsewhere)
    want_top: Array  # [R] bool: the row's request asked for top-n logprobs (else top-k skipped)
    feed: Array  # [N] int32: the slot whose last emitted token replaces this token, else -1
    # [2] int32: (tokens, rows): flat tokens [0, live[0]) hold every real token, sampled rows
    # [0, live[1]) every real sampled row; what follows is bucket padding (the native matmuls
    # skip it, so a padded step costs what its real tokens do). A verify row counts whole.
    live: Array
    per_token: Optional[PartMetadata] = None  # batch-invariant mode: one query per token
    head: Optional[HeadInput] = None  # an EAGLE head runs inside the step
    verify: bool = dataclasses.field(default=False, metadata=STATIC)  # parts[0] verifies

    def metadata(self) -> RaggedMetadata:
        return RaggedMetadata(positions=self.positions[None], write_page=self.write_page,
                              write_offset=self.write_offset, parts=self.parts,
                              per_token=self.per_token, live_tokens=self.live[0])


@dataclasses.dataclass(frozen=True)
class StepOutput(_Pytree):
    """What a step returns, per sampled row r: row r emits ``tokens[r, :num_accepted[r] + 1]``.

    W = 1 + D in a verify step (accepted drafts, then the target's token, then -1), else 1.
    """

    tokens: Array  # [R, W] int32
    logprobs: Array  # [R, W] float32: raw target log p of each emitted token
    top_ids: Array  # [R, W, n] int32: the n most likely raw tokens at each position
    top_logprobs: Array  # [R, W, n] float32
    num_accepted: Array  # [R] int32: drafts accepted (0 for decode and prefill rows)
    # [R] int32: drafts each row carried (device n-gram lookup: found inside the step)
    num_draft: Optional[Array] = None


class BatchBuilder:
    """Picks each part's bucket and builds the typed host batch of a step (numpy only).

    ``head``: an EAGLE head runs inside the step (the batch says where its input features come
    from); ``min_rows``: batch-invariant steps pad to at least this many tokens;
    ``max_prefill_seqs``: chunks one prefill part may carry (its sampled rows).
    """

    def __init__(self, *, vocab_size: int, page_size: int, pages_per_seq: int, max_slots: int,
                 decode_buckets: Sequence[int], prefill_buckets: Sequence[tuple[int, int]],
                 mixed_decode_buckets: Sequence[int] | None = None,
                 num_speculative_tokens: int = 0, verify_buckets: Sequence[int] | None = None,
                 head: bool = False, batch_invariant: bool = False, min_rows: int = 1,
                 max_prefill_seqs: int = 8, trim_from: int = 128,
                 max_verify_tokens: int | None = None):
        if max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs={max_prefill_seqs} must be >= 1")
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.max_slots = max_slots
        self.decode_buckets = sorted(decode_buckets)
        # Steps that carry prefill chunks pad their decode rows to one of these (default: the
        # largest decode bucket): beside a chunk the extra rows cost little, and the compiled
        # set stays |decode| + 2 |prefill| shapes instead of |decode| x |prefill|.
        self.mixed_decode_buckets = sorted(mixed_decode_buckets or [self.decode_buckets[-1]])
        # Prefill parts [Bp, C], cheapest (fewest tokens) first. A chunk takes ceil(len / C)
        # consecutive rows, so with a small C several chunks of any length pack into one part
        # and a step's prefill cost follows its real tokens, not the longest chunk.
        self.prefill_buckets = sorted(prefill_buckets, key=lambda x: (x[0] * x[1], x))
        self.max_prefill_seqs = max_prefill_seqs
        # fit_chunk stops a chunk at a bucket's edge only for buckets of at least this many
        # tokens: below it a step costs about the same whatever its tokens (the weight reads
        # dominate), so a smaller bucket saves little; above, cost grows with the tokens.
        self.trim_from = trim_from
        # Verify steps [Bv, 1 + D]: a row of 1 + D tokens costs about one decode row's weight
        # pass at batch 1-2 (bf16 runs 2-8 token rows in the time of 8), so verify keeps the
        # small buckets that decode drops; beside prefill chunks it pads to the largest.
        self.num_speculative_tokens = num_speculative_tokens
        if verify_buckets is None:
            verify_buckets = {min(max_slots, b) for b in (1, 2, 4)} | set(self.decode_buckets)
        # A repeated bucket (EngineConfig.verify_buckets=(8, 8)) is one shape, compiled once.
        self.verify_buckets = sorted(set(verify_buckets)) if num_speculative_tokens else []
        # A verify step of b rows carries at most max(1, max_verify_tokens // b - 1) drafts a row
        # (``verify_drafts``): past ~16 tokens a CPU step's matmuls turn compute-bound, so at
        # batch 4 fewer drafts a row pay more than D (README "Speculative decoding").
        if max_verify_tokens is not None and max_verify_tokens < 2:
            raise ValueError(f"max_verify_tokens={max_verify_tokens} must be >= 2 (one draft)")
        self.max_verify_tokens = max_verify_tokens
        self.head = head
        self.batch_invariant = batch_invariant
        self.min_rows = min_rows

    def verify_drafts(self, bucket: int) -> int:
        """Drafts a row of a verify step of ``bucket`` rows carries at most (its width is 1 +
        that): D, or fewer where ``max_verify_tokens`` caps the step's tokens."""
        d = self.num_speculative_tokens
        if self.max_verify_tokens is None or not d:
            return d
        return max(1, min(d, self.max_verify_tokens // bucket - 1))

    def decode_bucket(self, n: int, mixed: bool = False, verify: bool = False) -> int:
        """The smallest decode (``verify``: verify) bucket holding n rows (``mixed``: beside
        prefill chunks, where one bucket, the largest, serves)."""
        buckets = self.verify_buckets if verify else self.decode_buckets
        if mixed:
            buckets = buckets[-1:] if verify else self.mixed_decode_buckets
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} decode rows exceed the largest bucket {buckets[-1:]}")

    # ------------------------------------------------------------------ prefill packing
    def prefill_seqs(self, rows: int) -> int:
        """Chunks (sampled rows) a prefill part of ``rows`` rows carries at most."""
        return min(rows, self.max_prefill_seqs)

    @staticmethod
    def _rows(lengths: Sequence[int], c: int) -> int:
        """Rows of C tokens that chunks of ``lengths`` take (each ceil(len / C), at least 1)."""
        return sum(-(-max(n, 1) // c) for n in lengths)

    def _fits(self, bucket: tuple[int, int], lengths: Sequence[int]) -> bool:
        b, c = bucket
        return (len(lengths) <= self.prefill_seqs(b)
                and self._rows(lengths, c) <= b)

    def prefill_bucket(self, lengths: Sequence[int]) -> tuple[int, int]:
        """The cheapest (rows, chunk) bucket holding chunks of these lengths (each takes
        ceil(length / chunk) rows)."""
        for bucket in self.prefill_buckets:
            if self._fits(bucket, lengths):
                return bucket
        raise ValueError(f"no prefill bucket of {self.prefill_buckets} holds chunks of "
                         f"{list(lengths)} tokens")

    def prefill_room(self, lengths: Sequence[int]) -> int:
        """The most tokens one more chunk may take beside chunks of ``lengths`` (0: none)."""
        room = 0
        for b, c in self.prefill_buckets:
            if len(lengths) < self.prefill_seqs(b):
                room = max(room, (b - self._rows(lengths, c)) * c)
        return room

    def fit_chunk(self, lengths: Sequence[int], want: int) -> int:
        """How many of ``want`` tokens the next chunk takes beside chunks of ``lengths``.

        As many as fit, unless that spills into a bigger bucket for few tokens: when the
        tokens past the next smaller bucket's room are fewer than half the two buckets'
        difference (and that bucket holds >= ``trim_from`` tokens, where step cost grows with
        tokens), the chunk stops at that room and the rest waits for the next step (where it
        packs beside other work). The first chunk of a step always gets >= 1.
        """
        take = min(want, self.prefill_room(lengths))
        if take <= 0:
            return 0
        used = self.prefill_bucket([*lengths, take])
        size = used[0] * used[1]
        for b, c in reversed(self.prefill_buckets):
            if b * c >= size or len(lengths) >= self.prefill_seqs(b):
                continue
            if b * c < self.trim_from:
                break
            room = (b - self._rows(lengths, c)) * c
            if (room >= 1 or (room == 0 and lengths)) and 2 * (take - room) < size - b * c:
                return room
            break  # only the next smaller bucket is considered
        return take

    @property
    def max_prefill_rows(self) -> int:
        """Chunks one step may carry at most."""
        return max(self.prefill_seqs(b) for b, _ in self.prefill_buckets)

    @property
    def max_chunk(self) -> int:
        """Tokens one chunk may take at most (a whole part)."""
        return max(b * c for b, c in self.prefill_buckets)

    def step_shapes(self) -> list[tuple]:
        """Every (decode rows, (prefill rows, chunk), width) shape a step can take: decode
        alone, prefill alone and mixed; with speculation, verify rows of width 1 + D (of a
        bucket's ``verify_drafts``) alone and beside prefill. All are compiled at warm-up, so
        serving never compiles."""
        shapes = ([(d, None, 1) for d in self.decode_buckets]
                  + [(0, p, 1) for p in self.prefill_buckets]
                  + [(d, p, 1) for d, p in itertools.product(self.mixed_decode_buckets,
                                                             self.prefill_buckets)])
        if self.num_speculative_tokens:
            top = self.verify_buckets[-1]
            shapes += ([(b, None, 1 + self.verify_drafts(b)) for b in self.verify_buckets]
                       + [(top, p, 1 + self.verify_drafts(top)) for p in self.prefill_buckets])
        return shapes

    # ------------------------------------------------------------------ host batch
    def prepare(self, decode: Sequence[ScheduledRow], prefill: Sequence[ScheduledRow] = (),
                verify: bool = False, head_drafts: bool = True) -> StepInput:
        """Builds the typed host batch (numpy) for one step from its scheduled rows.

        ``decode`` rows get a part [Bd, 1] (``verify``: [Bv, 1 + D], each row its last token
        and up to D drafts), ``prefill`` chunks a part [Bp, C] (each chunk ceil(len / C)
        rows); each part is padded to its bucket, and an empty one is left out.
        ``head_drafts``: an EAGLE head drafts for the next step (False when the next step will
        not verify).
        """
        parts = []
        if decode:
            if verify and not self.num_speculative_tokens:
                raise ValueError("a verify step needs a Runner built with num_speculative_tokens")
            b = self.decode_bucket(len(decode), bool(prefill), verify)
            width = 1 + self.verify_drafts(b) if verify else 1
            if any(len(r.tokens) > width for r in decode):
                raise ValueError(f"a verify row carries {max(len(r.tokens) for r in decode)} "
                                 f"tokens; a step of {b} rows takes at most {width}")
            parts.append((decode, b, width, b))
        if prefill:
            b, c = self.prefill_bucket([len(r.tokens) for r in prefill])
            parts.append((prefill, b, c, self.prefill_seqs(b)))
        return self.build(parts, verify=verify and bool(decode), head_drafts=head_drafts)

    def empty_batch(self, shape: tuple, full: bool = False) -> StepInput:
        """A batch of the given ``step_shapes()`` entry with every row padding (warm-up).
        ``full``: every padding token and row counts as live, so the step costs what a full
        bucket of real rows does (for timing it; by default the native matmuls skip them)."""
        d, p, w = shape if len(shape) == 3 else (*shape, 1)
        parts = (([([], d, w, d)] if d else [])
                 + ([([], p[0], p[1], self.prefill_seqs(p[0]))] if p else []))
        batch = self.build(parts, verify=w > 1)
        if full:
            batch = batch.replace(live=np.array([batch.tokens.shape[0],
                                                 batch.sample_index.shape[0]], np.int32))
        return batch

    def build(self, parts, verify: bool = False, head_drafts: bool = True) -> StepInput:
        """The host batch for ``parts`` = [(rows, bucket rows B, tokens per row t, sampled
        rows S)], in flat order (``prepare`` and ``empty_batch`` choose the buckets;
        multi-host followers rebuild a template of the leader's shape with it). Each
        scheduled row takes ceil(len / t) consecutive rows of its part and one sampled row;
        its tokens sit contiguously in the flat order (only its last block is partial)."""
        parts = [p if len(p) == 4 else (*p, p[1]) for p in parts]
        n = max(sum(b * t for _, b, t, _ in parts), self.min_rows)
        r = sum(s for *_, s in parts)
        size, m, v = self.page_size, self.pages_per_seq, self.vocab_size
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
        num_draft = np.zeros(r, np.int32)
        want_top = np.zeros(r, bool)
        feed = np.full(n, -1, np.int32)
        head = self.head
        if head:  # where the EAGLE head's input features come from
            prev = np.full(n, -1, np.int32)
            first_row = np.full(n, -1, np.int32)
            carry = np.zeros(r, bool)
            sample_tables = np.full((r, m), DUMMY_PAGE, np.int32)
        rows_sampling: list[dict] = [{} for _ in range(r)]
        metas = []
        off = row = 0
        live = np.zeros(2, np.int32)  # (tokens, sampled rows) up to the last real one
        for rows, b, t, s in parts:
            if len(rows) > s:
                raise ValueError(f"{len(rows)} rows exceed the part's {s} sampled rows")
            q_start = np.zeros(b, np.int32)
            lengths = np.zeros(b, np.int32)
            tables = np.full((b, m), DUMMY_PAGE, np.int32)
            blk = 0  # the part's next free row
            verify_part = verify and not metas  # each row: its last token, then its drafts
            for i, spec in enumerate(rows):
                k = len(spec.tokens)
                nblk = -(-max(k, 1) // t)
                if blk + nblk > b:
                    raise ValueError(f"rows of {[len(x.tokens) for x in rows]} tokens do not "
                                     f"fit a part of {b} rows of {t}")
                base = off + blk * t
                pos = spec.start + np.arange(k)
                table = np.asarray(spec.block_table, np.int32)
                tokens[base:base + k] = spec.tokens
                if spec.feed:
                    feed[base] = spec.slot
                positions[base:base + k] = pos
                write_page[base:base + k] = table[pos // size]
                write_offset[base:base + k] = pos % size
                for j in range(nblk):  # block j: tokens [j t, min((j + 1) t, k))
                    q_start[blk + j] = spec.start + j * t
                    lengths[blk + j] = spec.start + min((j + 1) * t, k)
                    tables[blk + j, : len(table)] = table
                blk += nblk
                j = row + i
                # A verify row counts whole: a device lookup may fill drafts past its tokens.
                live[0] = max(live[0], base + (t if verify_part else k))
                live[1] = max(live[1], j + 1)
                if verify_part:
                    num_draft[j] = k - 1
                sample_index[j] = base + k - 1
                sample_pos[j] = spec.start + k
                slot_ids[j], emit[j] = spec.slot, spec.emit
                suppress_ids[j, : len(spec.suppress_ids)] = spec.suppress_ids
                suppress_until[j] = spec.suppress_until
                want_top[j] = spec.top_logprobs
                rows_sampling[j] = spec.sampling
                if head:
                    prev[base + 1:base + k] = np.arange(base, base + k - 1)
                    first_row[base] = j
                    carry[j] = spec.carry_feature
                    sample_tables[j, : len(table)] = table
            for i in range(len(rows), s):  # padding rows sample from a padding-row token
                sample_index[row + i] = off + min(i, b - 1) * t
            metas.append(PartMetadata(q_start=q_start, lengths=lengths, block_tables=tables,
                                      t=t, samples=s))
            off += b * t
            row += s
        per_token = self._per_token(metas, positions, write_page) \
            if self.batch_invariant else None
        head_input = HeadInput(prev=prev, first_row=first_row, carry=carry,
                               draft=np.asarray(head_drafts), tables=sample_tables) \
            if head else None
        return StepInput(tokens=tokens, positions=positions, write_page=write_page,
                         write_offset=write_offset, parts=tuple(metas), per_token=per_token,
                         sample_index=sample_index, sample_pos=sample_pos, slot_ids=slot_ids,
                         emit=emit, suppress_ids=suppress_ids, suppress_until=suppress_until,
                         sampling=SamplingArrays.from_lists(rows_sampling),
                         num_draft=num_draft, want_top=want_top, feed=feed, live=live,
                         head=head_input, verify=verify)

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


def padded_page_pairs(pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) page ids padded with dummy-page pairs to a power of two >= 8 (few shapes)."""
    n = max(8, 1 << max(0, (len(pairs) - 1).bit_length()))
    src = np.full(n, DUMMY_PAGE, np.int32)
    dst = np.full(n, DUMMY_PAGE, np.int32)
    for i, (s, d) in enumerate(pairs):
        src[i], dst[i] = s, d
    return src, dst


def part_arrays(batch: StepInput, index: int) -> tuple[np.ndarray, ...]:
    """Part ``index`` of a host batch in row form: (tokens [B, T], q_start [B], n_valid [B],
    block_tables [B, M]), for a draft model that mirrors the target's prefill."""
    part = batch.parts[index]
    off = sum(p.block_tables.shape[0] * p.t for p in batch.parts[:index])
    b, t = part.block_tables.shape[0], part.t
    tokens = np.asarray(batch.tokens[off:off + b * t]).reshape(b, t)
    return tokens, part.q_start, part.lengths - part.q_start, part.block_tables


def default_decode_buckets(max_slots: int, dtype: str,
                           native_bf16_matmul: bool = False) -> list[int]:
    """Decode batch buckets chosen by measurement (experiments/matmul.py, SmolLM2 on this CPU).

    XLA's bf16 weight matmuls cost about the same from 1 to 8 rows (25.8 / 23.4 / 25.4 / 27.1
    ms), so the smallest bf16 bucket is 8. fp32 at 1 row is a matrix-vector product (21 ms) and
    cheaper than 2-8 rows (29-44 ms), so fp32 also keeps a 1-row bucket for the last running
    request. The native bf16 matmul (``native_bf16_matmul``: the cpu backend on an AVX512_BF16
    or AVX2 CPU) is memory-bound up to 8 rows (9.1 ms at 2, 9.9 at 8) and has no slow one-row
    path, so bf16 then keeps the 1-row bucket too (attention and sampling scale with the rows). Then
    powers of two from 8 up to ``max_slots``, with 1.5x steps between them from 16 up (24, 48,
    96, ...): a draining batch of 17-31 rows otherwise pads to 32, and the matmuls grow about
    linearly there (native kernels, AMD Zen 4: 16 / 24 / 32 rows 49 / 64 / 82 ms fp32, 25 / 34 /
    44 ms bf16), while below 16 rows they are near their memory floor (8 / 12 / 16 rows bf16: 21
    / 25 / 25 ms).
    """
    smallest = 8 if "bfloat16" in str(dtype) and not native_bf16_matmul else 1
    powers = {1 << i for i in range(3, 12)}
    halves = {3 << i for i in range(3, 11)}  # 24, 48, 96, ...
    return sorted({min(max_slots, smallest), max_slots}
                  | {min(max_slots, b) for b in powers | halves})
