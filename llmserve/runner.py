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

import jax
import jax.numpy as jnp
import numpy as np

from llmserve import host_memory
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
from llmserve.ops import cpu_kernels
from llmserve.packed import pack_inputs, unpack_inputs  # noqa: F401  (re-exported)
from llmserve.programs import owned_jit, programs_for
from llmserve.step import (
    EagleState,
    SamplerState,
    _init_sampler_rows,
    _packed_step,
    copy_cache_pages,
    invariant_min_rows,
)

Array = jax.Array


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
                 ngram: Optional[tuple] = None, max_verify_tokens: Optional[int] = None):
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
        if jax.default_backend() == "cpu":
            host_memory.log_hugepage_hint_once()
        if shardings is None:
            # The native matmuls stream a [K, N] kernel's 64-column blocks contiguously from the
            # blocked layout (2-3x the bandwidth at a decode step's few rows).
            params = cpu_kernels.device_weights(params, cfg.jnp_dtype, backend)
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
            max_prefill_seqs=max_prefill_seqs, max_verify_tokens=max_verify_tokens)
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

    def verify_drafts(self, n: int, mixed: bool = False) -> int:
        """Drafts each row of a verify step of n rows (``mixed``: beside prefill chunks) may
        carry: see ``BatchBuilder.verify_drafts``."""
        return self.batches.verify_drafts(self.decode_bucket(n, mixed, verify=True))

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

    def empty_batch(self, shape: tuple, full: bool = False) -> StepInput:
        """See ``BatchBuilder.empty_batch``."""
        return self.batches.empty_batch(shape, full)

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
