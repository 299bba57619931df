"""Host-side iteration-level scheduling over a fixed number of slots.

Each step the scheduler decides, from small Python state, which sequences decode (one token
each) and which prefill a chunk of their prompt under a per-step token budget, so a long prompt
never stalls decoding. It admits waiting sequences FCFS when a slot and pages are free, and when
pages run out it preempts the newest running sequence by recompute (its pages are freed and it
goes back to the front of the queue; nothing is ever dropped). The ``static`` policy admits a
new batch only when every slot is free, for ablations.

Prefill first (continuous policy, ``prefill_first=True``): once every waiting request fits the
free slots and the outstanding prompts need more than one step, steps carry prefill chunks only
until every prompt is computed, as static batching's would. Then no request needs a slot that
decoding could free sooner, so decode rows in those steps buy nothing for throughput: the batch
is done when its last-admitted request is, and prefill-only steps admit it soonest. When all
requests arrive at once and fit (the 32-prompt workload), the two policies run the same steps;
with a queue longer than the free slots, or a burst that fits one step, decode rows ride along.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from typing import Callable, Optional

from llmserve.block_manager import BlockManager, NoFreePages
from llmserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclasses.dataclass
class Sequence:
    """One completion being generated (a request with n > 1 has n sequences)."""

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    slot: Optional[int] = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens served by the prefix cache
    fork_from: Optional["Sequence"] = None  # n > 1: share this sequence's pages once it prefills
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: list = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    cache_salt: Optional[str] = None  # prefix-cache tenant: only equal salts share pages
    admitted: bool = False  # set when (re)admitted; the engine clears it once it has seen it
    # Async scheduling: tokens sampled by a step in flight, not yet in output_ids (their K/V
    # inputs are known to the device only). The scheduler counts them as tokens.
    pending: int = 0
    # Verify steps in flight whose drafts were looked up on the device: how many of their
    # tokens they keep is known once they land (the scheduler reserves for all of them).
    verifying: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """True while some K/V before the last token still has to be computed."""
        return (self.num_computed < self.num_tokens + self.pending - 1
                or not (self.output_ids or self.pending))

    def ends_with_pending(self, max_len: int | None) -> bool:
        """Whether the token in flight is the sequence's last by length (max_tokens or
        max_model_len): async scheduling then gives it no further step."""
        if not self.pending:
            return False
        n_out = len(self.output_ids) + self.pending
        return ((self.params.max_tokens is not None and n_out >= self.params.max_tokens)
                or (max_len is not None and self.num_tokens + self.pending >= max_len))

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclasses.dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def final(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


@dataclasses.dataclass
class Plan:
    """What one engine step runs: decode rows, prefill chunks, and page copies to do first."""

    decode: list[Sequence]
    prefill: list[PrefillChunk]
    copies: list[tuple[int, int]]
    preempted: list[Sequence]
    lookahead: int = 0  # > 0: decode rows verify this many drafts (speculative decoding)
    # seq_id -> a first n-gram draft its plain decode row's token is checked against
    # (``SpeculationController.shadow``)
    shadow: dict = dataclasses.field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Waiting/running queues, slots, admission, chunked prefill and preemption."""

    def __init__(self, blocks: BlockManager, *, max_slots: int, max_prefill_rows: int,
                 max_chunk: int, max_num_batched_tokens: int, policy: str = "continuous",
                 fit_chunk: Optional[Callable[[list[int], int], int]] = None,
                 prefill_first: bool = True):
        if policy not in ("continuous", "static"):
            raise ValueError(f"unknown scheduling policy {policy!r}; use continuous or static")
        self.blocks = blocks
        self.max_slots = max_slots
        self.max_prefill_rows = max_prefill_rows
        self.max_chunk = max_chunk
        self.budget = max_num_batched_tokens
        # fit_chunk(lengths so far, wanted) -> tokens the next chunk takes: the runner's
        # prefill buckets decide what packs into one step (None: up to max_chunk each).
        self.fit_chunk = fit_chunk
        self.policy = policy
        self.prefill_first = prefill_first
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.batch_open = True  # static policy: still admitting and prefilling the batch
        self.forming = False  # continuous, prefill_first: a batch is forming (prefill only)

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Ends a sequence: frees its pages and its slot the same step."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self.free_slots.append(seq.slot)
        seq.slot = None

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ planning
    def schedule(self, lookahead: int = 0, max_len: int | None = None) -> Plan:
        """Builds the next step's plan; decode rows reserve 1 + lookahead token slots
        (speculative verify), capped so no sequence reserves past ``max_len``."""
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        if self.policy == "static":
            plan = self._schedule_static_fill(copies)
            if plan is not None:
                return plan
        elif self.prefill_first and self._batch_forming():
            plan = self._prefill_only(copies)
            if plan is not None:
                return plan
            self.forming = False
        decode = self._reserve_decode(copies, preempted, lookahead, max_len)
        budget = self.budget - len(decode)
        prefill: list[PrefillChunk] = []
        for seq in self.running:
            if len(prefill) >= self.max_prefill_rows or budget <= 0:
                break
            if seq.in_prefill and seq not in decode:
                chunk = self._chunk(seq, budget, prefill)
                if chunk is None:
                    break
                prefill.append(chunk)
                budget -= chunk.length
        self._admit(prefill, budget, copies)
        return Plan(decode=decode, prefill=prefill, copies=copies, preempted=preempted)

    def _schedule_static_fill(self, copies) -> Plan | None:
        """Static batching: while a batch is forming, only admit and prefill (no decode).

        A batch forms when every slot is free; it closes (decoding starts, nothing more is
        admitted) once a step finds nothing left to admit or prefill.
        """
        if not self.running:
            self.batch_open = True
        if not self.batch_open:
            return None
        plan = self._prefill_only(copies)
        if plan is None:
            self.batch_open = False
        return plan

    def _batch_forming(self) -> bool:
        """The prefill-first rule. A batch starts forming when every waiting request fits the
        free slots and the prompts still to compute (waiting and partly prefilled) need more
        than one step (more tokens than the budget, more chunks than a step carries, or a
        prompt longer than ``max_chunk``); it
        keeps forming, as static batching's does, until a step finds nothing left to prefill,
        or until more requests wait than slots are free."""
        if self.waiting and len(self.waiting) > len(self.free_slots):
            self.forming = False
        elif not self.forming and self.waiting:
            todo = list(self.waiting) + [s for s in self.running if s.in_prefill]
            left = [s.num_tokens - s.num_computed for s in todo]
            # More than one step: more tokens than the budget, more chunks than a step
            # carries, or a prompt longer than one chunk may be.
            self.forming = (sum(left) > self.budget or len(todo) > self.max_prefill_rows
                            or max(left) > self.max_chunk)
        return self.forming

    def _prefill_only(self, copies) -> Plan | None:
        """A step of prompt chunks only: running prefills first, then admissions (None: none)."""
        prefill: list[PrefillChunk] = []
        budget = self.budget
        for seq in self.running:
            if len(prefill) >= self.max_prefill_rows or budget <= 0:
                break
            if seq.in_prefill:
                chunk = self._chunk(seq, budget, prefill)
                if chunk is None:
                    break
                prefill.append(chunk)
                budget -= chunk.length
        self._admit(prefill, budget, copies)
        if prefill:
            return Plan(decode=[], prefill=prefill, copies=copies, preempted=[])
        return None

    def _reserve_decode(self, copies, preempted, lookahead, max_len) -> list[Sequence]:
        decode: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.in_prefill or seq.ends_with_pending(max_len):
                continue
            extra = lookahead if max_len is None else min(lookahead, max_len - seq.num_tokens)
            while True:
                try:
                    copies.extend(self.blocks.append(seq.seq_id, 1 + max(extra, 0)))
                    decode.append(seq)
                    break
                except NoFreePages:
                    victim = self.running[-1]
                    if victim in decode:
                        decode.remove(victim)
                    self.preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
        return decode

    def _room(self, prefill: list[PrefillChunk], want: int) -> int:
        """Tokens a next chunk wanting ``want`` may take beside ``prefill`` (0: none)."""
        want = min(want, self.max_chunk)
        if self.fit_chunk is None:
            return want
        return self.fit_chunk([c.length for c in prefill], want)

    def _chunk(self, seq: Sequence, budget: int,
               prefill: list[PrefillChunk]) -> Optional[PrefillChunk]:
        length = self._room(prefill, min(seq.num_tokens - seq.num_computed, budget))
        if length <= 0:
            return None
        return PrefillChunk(seq, seq.num_computed, length)

    def _admit(self, prefill: list[PrefillChunk], budget: int, copies: list) -> None:
        if self.policy == "static" and not self.batch_open:
            return
        while (self.waiting and self.free_slots and budget > 0
               and len(prefill) < self.max_prefill_rows):
            seq = self.waiting[0]
            if seq.pending or seq.verifying:  # preempted with tokens in flight: readmitted
                # once they land
                break
            # A child that already has outputs (it was preempted) recomputes like any other.
            if seq.fork_from is not None and not seq.fork_from.finished and not seq.output_ids:
                if self._room(prefill, 1) < 1 or not self._try_fork(seq, copies):
                    break
                prefill.append(PrefillChunk(seq, seq.num_computed, 1))
                budget -= 1
                continue
            if not self.blocks.can_allocate(seq.all_ids, seq.cache_salt):
                break
            if self._room(prefill, min(seq.num_tokens, budget)) <= 0:
                break  # the step's prefill part is full: admit next step
            self.waiting.popleft()
            seq.num_computed = self.blocks.allocate(seq.seq_id, seq.all_ids, seq.cache_salt)
            if seq.num_preemptions == 0:
                seq.num_cached = seq.num_computed
            self._start(seq)
            chunk = self._chunk(seq, budget, prefill)
            if chunk is None:  # it waits, running, and prefills first next step
                break
            prefill.append(chunk)
            budget -= chunk.length

    def _try_fork(self, seq: Sequence, copies: list) -> bool:
        """n > 1: once the parent's prompt is computed, the child shares its pages (COW)."""
        parent = seq.fork_from
        if parent.status != Status.RUNNING or parent.num_computed < len(parent.prompt_ids):
            return False
        try:
            self.blocks.fork(parent.seq_id, seq.seq_id)
        except NoFreePages:  # contiguous reservation: no room for the child's reserved pages
            return False
        try:
            # Re-feed the last prompt token so the child samples its own first token; its write
            # into the shared last page is what copy-on-write protects.
            self.blocks.truncate(seq.seq_id, len(seq.prompt_ids) - 1)
            copies.extend(self.blocks.append(seq.seq_id, 1))
        except NoFreePages:
            self.blocks.free(seq.seq_id)
            return False
        self.waiting.popleft()
        seq.num_computed = len(seq.prompt_ids) - 1
        seq.num_cached = parent.num_cached
        self._start(seq)
        return True

    def _start(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.admitted = True
        seq.slot = self.free_slots.pop()
        self.running.append(seq)
