"""The engine side of speculation: proposers behind one protocol, called the same way for every
method. The engine calls them; the runner never imports them.

Per verify step the engine asks ``propose(seqs, room)`` how many drafts each row carries (and
their tokens when the host knows them: n-gram), builds the step's rows, then asks
``drafts(seqs, batch)`` for device drafts (a draft model's output, which enters the tokens
inside the jitted step and never visits the host), runs the ONE step, and reports the accepted
lengths back with ``accepted``. Prompt chunks and copy-on-write copies are mirrored with
``prefill`` and ``copy_pages`` so a draft model's cache follows the target's pages.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llmserve.batch import StepInput, padded_page_pairs, part_arrays
from llmserve.config import ModelConfig
from llmserve.kv_cache import PagedKVCache
from llmserve.ops import cpu_kernels
from llmserve.programs import owned_jit, programs_for
from llmserve.speculative.draft import draft_prefill, draft_propose
from llmserve.speculative.ngram import NgramProposer
from llmserve.step import copy_cache_pages

Array = jax.Array

TAIL = 2  # committed tokens a draft model reads before drafting (see DraftModelProposer)
CATCH_UP = 8  # chunk width that brings a stale draft cache up to date


@dataclasses.dataclass
class Proposal:
    """What a proposer decided on the host for B rows: how many drafts each carries, and the
    tokens themselves when the host knows them (None: they come from ``Proposer.drafts``)."""

    num_draft: np.ndarray  # [B] int32, each <= its room
    tokens: Optional[np.ndarray] = None  # [B, D] int32 (padding past num_draft)


class Proposer(Protocol):
    """A speculative proposer as the engine drives it (n-gram, draft model, EAGLE head)."""

    num_speculative_tokens: int  # D: drafts per verify row at most
    device_drafts: bool  # True: ``drafts`` returns device arrays for ``Runner.run``

    def propose(self, seqs: Sequence, room: np.ndarray) -> Proposal:
        """How many drafts each running sequence carries this step (at most ``room``)."""
        ...

    def drafts(self, seqs: Sequence, batch: StepInput) -> tuple[Optional[Array], Optional[Array]]:
        """(draft tokens [Bv, D], their distributions [Bv, D, V]) on the device, or (None, None)
        when ``propose`` gave the tokens."""
        ...

    def prefill(self, batch: StepInput, part: int, chunks: Sequence) -> None:
        """Mirrors the step's prompt chunks (``batch.parts[part]``; ``chunks``: the plan's)."""
        ...

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Mirrors the target cache's copy-on-write copies."""
        ...

    def accepted(self, seqs: Sequence, num_accepted: np.ndarray) -> None:
        """After a verify step: ``num_accepted[i]`` drafts of ``seqs[i]`` were kept."""
        ...

    def forget(self, seq_id: int) -> None:
        """Drops a finished sequence's state."""
        ...

    def warmup(self, runner) -> None:
        """Compiles the proposer's device calls for every verify shape of ``runner``."""
        ...

    def reset(self) -> None:
        """Fresh device state after a failed step (``Engine.recover``)."""
        ...


class _NoDeviceState:
    """Hooks of a proposer that keeps no device state of its own (all no-ops)."""

    device_drafts = False

    def drafts(self, seqs, batch):
        return None, None

    def prefill(self, batch, part, chunks) -> None:
        pass

    def copy_pages(self, pairs) -> None:
        pass

    def accepted(self, seqs, num_accepted) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass

    def warmup(self, runner) -> None:
        pass

    def reset(self) -> None:
        pass


class NgramLookup(_NoDeviceState):
    """Prompt lookup (``ngram.NgramProposer``) behind the protocol: host drafts only."""

    def __init__(self, n_max: int, n_min: int, num_speculative_tokens: int):
        self.lookup = NgramProposer(n_max, n_min, num_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, seqs: Sequence, room: np.ndarray) -> Proposal:
        tokens, num = self.lookup.propose_batch([s.all_ids for s in seqs],
                                                self.num_speculative_tokens)
        return Proposal(num_draft=np.minimum(num, room[: len(seqs)]).astype(np.int32),
                        tokens=tokens)


class EagleHeadProposer(_NoDeviceState):
    """An EAGLE head (``speculative/eagle.py``) behind the protocol. The head runs inside the
    runner's step (``Runner(eagle=...)``): it reads the target's hidden states there, keeps its
    own cache on the target's pages, and leaves each slot's next drafts on the device, where
    the slot's next verify step picks them up. So the host only says how many drafts each row
    carries, and a step is ONE device call whatever it holds."""

    device_drafts = False

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, seqs: Sequence, room: np.ndarray) -> Proposal:
        return Proposal(num_draft=np.asarray(room[: len(seqs)], np.int32))

    def drafts(self, seqs, batch):
        return None, None  # read from the runner's EagleState inside the step

    def prefill(self, batch, part, chunks) -> None:
        pass

    def copy_pages(self, pairs) -> None:
        pass  # the runner copies the head's pages with the target's

    def accepted(self, seqs, num_accepted) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass

    def warmup(self, runner) -> None:
        pass

    def reset(self) -> None:
        pass


def load_eagle_head(model, dtype: str):
    """(EagleConfig, head params, vocab_map) from a ``save_eagle`` folder or given as a tuple."""
    if isinstance(model, (tuple, list)):
        if len(model) != 3:
            raise ValueError("speculative_config.model for 'eagle': a folder, or "
                             "(EagleConfig, head params, vocab_map)")
        return tuple(model)
    import os

    from llmserve.speculative.eagle import load_eagle

    path = str(model)
    if not os.path.isfile(os.path.join(path, "eagle.json")) and os.path.isfile(
            os.path.join(path, "head", "eagle.json")):
        path = os.path.join(path, "head")  # a train_eagle.py workdir
    return load_eagle(path, dtype=dtype)


class DraftPrograms:
    """A draft model's jitted prefill, propose and page copy, owned by its proposer's engine
    (like the runner's StepPrograms: dropped engines free their executables)."""

    def __init__(self):
        # The module-level jits stay for direct callers; these are this engine's own.
        self.prefill = owned_jit(draft_prefill.__wrapped__, static_argnames=("cfg", "backend"),
                                 donate_argnames=("cache",))
        self.propose = owned_jit(draft_propose.__wrapped__,
                                 static_argnames=("cfg", "k", "backend"),
                                 donate_argnames=("cache",))
        self.copy_pages = owned_jit(copy_cache_pages, donate_argnames=("cache",))

    def num_compilations(self) -> int:
        return (self.prefill._cache_size() + self.propose._cache_size()
                + self.copy_pages._cache_size())


class DraftModelProposer:
    """A small llmserve model as the proposer; owns its paged KV cache (target's page ids).

    Its cache never goes stale: ``seen[seq]`` counts the positions whose draft K/V is right.
    Prompt chunks are mirrored as the target prefills them; a verify step leaves the accepted
    drafts right; tokens committed by plain decode steps (the never-slower policy may choose
    them) are caught up in [Bv, CATCH_UP] chunks before the next proposal. The last TAIL
    committed tokens are always re-read, so draft 0 follows the newest token.
    """

    device_drafts = True

    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 num_speculative_tokens: int, backend: str = "xla",
                 target_vocab: Optional[int] = None, shardings=None):
        if target_vocab is not None and target_vocab != cfg.vocab_size:
            raise ValueError(f"draft vocab {cfg.vocab_size} != target vocab {target_vocab}")
        self.cfg, self.backend = cfg, backend
        self.num_speculative_tokens = num_speculative_tokens
        params = cpu_kernels.device_weights(params, cfg.jnp_dtype, backend,  # as Runner's
                                            sharded=shardings is not None)
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.cache = PagedKVCache.create(cfg, num_pages, page_size)
        self.put = jax.device_put
        if shardings is not None:  # the (small) draft model: whole on every device
            self.params = shardings.replicate(self.params)
            self.cache = shardings.replicate(self.cache)
            self.put = shardings.replicate
        self.seen: dict[int, int] = {}
        self._pos0: list[int] = []  # per row of the last proposal: where draft 0 sat
        # Its own jitted programs (freed with the engine; see runner.StepPrograms).
        self.programs = programs_for((cfg, backend, num_speculative_tokens, num_pages,
                                      page_size, None if shardings is None else id(shardings)),
                                     DraftPrograms)

    def propose(self, seqs: Sequence, room: np.ndarray) -> Proposal:
        return Proposal(num_draft=np.asarray(room[: len(seqs)], np.int32))

    def _tails(self, seqs: Sequence, rows: int) -> tuple[np.ndarray, ...]:
        tail = np.zeros((rows, TAIL), np.int32)
        q_start = np.zeros(rows, np.int32)
        n_valid = np.zeros(rows, np.int32)
        for i, seq in enumerate(seqs):
            ids = seq.all_ids
            n = min(TAIL, len(ids))
            tail[i, :n] = ids[len(ids) - n:]
            q_start[i], n_valid[i] = len(ids) - n, n
        return tail, q_start, n_valid

    def _catch_up(self, seqs: Sequence, tables: np.ndarray) -> None:
        """Writes committed tokens the draft cache missed (plain decode steps), up to the
        tail, in [Bv, CATCH_UP] chunks: one compiled shape per verify bucket."""
        b = tables.shape[0]
        while True:
            chunk = np.zeros((b, CATCH_UP), np.int32)
            start = np.zeros(b, np.int32)
            n_valid = np.zeros(b, np.int32)
            for i, seq in enumerate(seqs):
                ids = seq.all_ids
                lo = self.seen.get(seq.seq_id, len(ids))
                hi = min(len(ids) - TAIL, lo + CATCH_UP)
                if hi > lo:
                    chunk[i, : hi - lo] = ids[lo:hi]
                    start[i], n_valid[i] = lo, hi - lo
                    self.seen[seq.seq_id] = hi
            if not n_valid.any():
                return
            self.cache = self.programs.prefill(self.params, self.cache,
                                               *self.put((chunk, start, n_valid, tables)),
                                               cfg=self.cfg, backend=self.backend)

    def drafts(self, seqs: Sequence, batch: StepInput):
        tables = batch.parts[0].block_tables
        self._catch_up(seqs, tables)
        tail, q_start, n_valid = self._tails(seqs, tables.shape[0])
        self._pos0 = [int(q + n) for q, n in zip(q_start[: len(seqs)], n_valid)]
        bv = tables.shape[0]
        arrays = jax.tree_util.tree_map(lambda x: x[:bv], batch.sampling)
        out, self.cache = self.programs.propose(
            self.params, self.cache, *self.put((tail, q_start, n_valid, tables, arrays)),
            cfg=self.cfg, k=self.num_speculative_tokens, backend=self.backend)
        return out.tokens, out.probs

    def prefill(self, batch: StepInput, part: int, chunks: Sequence) -> None:
        self.cache = self.programs.prefill(self.params, self.cache,
                                           *self.put(part_arrays(batch, part)),
                                           cfg=self.cfg, backend=self.backend)
        for c in chunks:
            self.seen[c.seq.seq_id] = c.start + c.length

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self.cache = self.programs.copy_pages(self.cache,
                                                  *self.put(padded_page_pairs(pairs)))

    def accepted(self, seqs: Sequence, num_accepted: np.ndarray) -> None:
        # Drafts 0..D-2 were written at pos0 + j; those accepted are right, the rest are not.
        d = self.num_speculative_tokens
        for seq, pos0, n in zip(seqs, self._pos0, num_accepted):
            self.seen[seq.seq_id] = pos0 + min(int(n), d - 1)

    def forget(self, seq_id: int) -> None:
        self.seen.pop(seq_id, None)

    def warmup(self, runner) -> None:
        for shape in runner.step_shapes():
            d, p, w = shape
            if p is not None and d == 0:
                self.prefill(runner.empty_batch(shape), 0, ())
        for b in runner.verify_buckets:
            tables = np.zeros((b, runner.pages_per_seq), np.int32)
            zeros = np.zeros((b, CATCH_UP), np.int32)
            self.cache = self.programs.prefill(
                self.params, self.cache, *self.put((zeros, zeros[:, 0], zeros[:, 0], tables)),
                cfg=self.cfg, backend=self.backend)
            self.drafts([], runner.empty_batch((b, None, w)))
        self.copy_pages([(0, 0)])

    def reset(self) -> None:
        self.cache = self.put(PagedKVCache.create(self.cfg, self.cache.num_pages,
                                                  self.cache.page_size))
        self.seen.clear()

    def num_compilations(self) -> int:
        return self.programs.num_compilations()
