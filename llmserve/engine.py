"""Engine: add_request / step / abort. Ties the scheduler, block manager and runner together.

``step()`` is three moves: the scheduler plans (which sequences decode, which prefill a chunk),
the runner runs ONE jitted device step over all of it (copy-on-write copies first), and the
output processor turns the sampled tokens into ``RequestOutput``s (detokenization, stop checks).
Bad input is rejected in ``add_request`` with a ``ValueError``/``TypeError`` before anything is
queued, so the engine keeps serving everyone else.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from typing import Optional, Sequence, Union

from llmserve.batch import MAX_SUPPRESS_IDS, ScheduledRow
from llmserve.block_manager import BlockManager
from llmserve.config import ModelConfig
from llmserve.engine_config import EngineConfig
from llmserve.outputs import OutputProcessor, RequestOutput, RequestState
from llmserve.runner import Runner, fetch, tree_bytes, wait
from llmserve.sampling_params import SamplingParams, child_seed, request_seed
from llmserve.scheduler import Plan, Scheduler, Status
from llmserve.scheduler import Sequence as Seq
from llmserve.speculative.controller import (
    SpeculationController,
    device_ngram,
    load_eagle,
    max_verify_tokens,
    num_speculative_tokens,
)


class Engine:
    """The serving loop over one model: requests join and leave at every step."""

    def __init__(self, cfg: ModelConfig, params, tokenizer=None,
                 config: Optional[EngineConfig] = None, shardings=None):
        """``shardings``: this engine's mesh (one data-parallel replica); by default built from
        ``config.tensor_parallel_size`` (None: one device)."""
        from llmserve.ops.attention import check_backend, default_backend

        self.cfg = cfg
        self.config = config = config or EngineConfig()
        config.validate()
        if cfg.sliding_window is not None and config.max_model_len > cfg.sliding_window:
            logging.warning("max_model_len capped from %d to the model's sliding_window=%d: "
                            "sliding-window attention is not implemented, and attention "
                            "past the window would be wrong", config.max_model_len,
                            cfg.sliding_window)
            config = self.config = dataclasses.replace(config,
                                                       max_model_len=cfg.sliding_window)
        self.tokenizer = tokenizer
        backend = check_backend(config.backend or default_backend())
        if shardings is None and config.data_parallel_size > 1:
            raise ValueError("Engine is one replica; data_parallel_size > 1 needs "
                             "llmserve.data_parallel.DataParallelEngine (LLM builds it)")
        if shardings is None and config.tensor_parallel_size > 1:
            from llmserve.sharding import engine_shardings, kv_head_plan

            kv_head_plan(cfg, config.tensor_parallel_size)  # a clear error before any work
            shardings = engine_shardings(config.tensor_parallel_size)[0]
        num_pages = config.resolve_num_pages(cfg, tree_bytes(params))
        pages_per_seq = -(-config.max_model_len // config.page_size)
        if num_pages < pages_per_seq + 1:
            raise ValueError(
                f"KV cache of {num_pages} pages cannot hold one sequence of max_model_len="
                f"{config.max_model_len} ({pages_per_seq} pages of {config.page_size} + 1 dummy)")
        prefill_buckets = tuple((b, min(c, config.max_num_batched_tokens))
                                for b, c in config.prefill_buckets)
        eagle = load_eagle(config.speculative_config, cfg)  # runs inside the runner's step
        runner_cls = Runner
        if shardings is not None and shardings.multi_process:
            from llmserve.multihost import LeaderRunner as runner_cls  # broadcasts each call
        ngram = device_ngram(config, shardings)
        self.runner = runner_cls(
            cfg, params, num_pages=num_pages, page_size=config.page_size,
            max_slots=config.max_num_seqs, max_model_len=config.max_model_len, backend=backend,
            num_logprobs=config.max_logprobs, decode_buckets=config.decode_buckets,
            prefill_buckets=prefill_buckets, mixed_decode_buckets=config.mixed_decode_buckets,
            num_speculative_tokens=num_speculative_tokens(config.speculative_config),
            verify_buckets=config.verify_buckets, eagle=eagle,
            batch_invariant=config.batch_invariant, shardings=shardings,
            max_prefill_seqs=config.max_prefill_seqs, ngram=ngram,
            max_verify_tokens=max_verify_tokens(config.speculative_config, backend))
        self.blocks = BlockManager(num_pages, config.page_size,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   reservation=config.kv_reservation,
                                   max_model_len=config.max_model_len)
        self.scheduler = Scheduler(
            self.blocks, max_slots=config.max_num_seqs,
            max_prefill_rows=self.runner.max_prefill_rows, max_chunk=self.runner.max_chunk,
            max_num_batched_tokens=config.max_num_batched_tokens, policy=config.scheduling,
            fit_chunk=self.runner.fit_chunk, prefill_first=config.prefill_first)
        self.stats = {"steps": 0, "decode_rows": 0, "decode_slots": 0, "prefill_tokens": 0,
                      "prefill_slots": 0, "preemptions": 0, "generated_tokens": 0}
        self._eos = set(cfg.eos_token_ids)
        if tokenizer is not None:
            self._eos |= set(getattr(tokenizer, "stop_token_ids", None) or [])
        self.outputs = OutputProcessor(tokenizer, self._eos, config.max_model_len, self._finish,
                                       self.stats)
        self.requests = self.outputs.requests  # request_id -> RequestState, while in flight
        self._counter = 0
        self._aborted: list[RequestOutput] = []  # final outputs the next step() reports
        self._inflight: list[Plan] = []  # launched, outputs not yet processed (``recover``)
        self._ahead: Optional[_Launched] = None  # async scheduling: the step in flight
        self._called = 0.0  # when the current step() call began (perf_counter)
        self._verify_next = 0  # the drafts the next step verifies (decided before a drain)
        # Speculation's hooks (each does nothing when speculative_config is None).
        self.speculation = SpeculationController(
            config.speculative_config, cfg=cfg, runner=self.runner, scheduler=self.scheduler,
            stats=self.stats, requests=self.requests, num_pages=num_pages,
            page_size=config.page_size, max_model_len=config.max_model_len, backend=backend)
        # An EAGLE head drafts inside every step from the step's features: its engine steps
        # synchronously (as a multi-host leader does); n-gram and draft-model engines run
        # their plain decode steps ahead; a draft-model engine (and an n-gram one looking its
        # drafts up on the host) verifies synchronously, while device n-gram lookup lets
        # verify steps run ahead too.
        self.async_scheduling = (config.async_scheduling and runner_cls is Runner
                                 and (self.spec is None or self.spec.method != "eagle"))

    @property
    def spec(self):
        """The ``SpeculativeConfig`` in use, or None without speculation."""
        return self.speculation.spec

    @property
    def policy(self):
        """The never-slower ``SpeculationPolicy`` (None without speculation)."""
        return self.speculation.policy

    @property
    def proposer(self):
        """The ``Proposer`` that drafts (None without speculation)."""
        return self.speculation.proposer

    # ------------------------------------------------------------------ requests
    def warmup(self) -> None:
        """Compiles every step shape once; no compilation happens while serving afterwards.

        With speculation on, it also compiles the proposer's calls and times decode against
        verify per bucket, seeding the never-slower policy.
        """
        self.runner.warmup(device_drafts=self.speculation.device_drafts)
        self.speculation.warmup()

    def _tokenize(self, prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("a prompt dict needs exactly one of 'prompt' or "
                                 f"'prompt_token_ids' (and optionally 'cache_salt'); got keys "
                                 f"{sorted(prompt)}")
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise TypeError("prompt['prompt'] must be a string")
                return self._tokenize(prompt["prompt"])
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, (bytes, float, int)) or prompt is None:
            raise TypeError(f"prompt must be a string or a list of token ids, got "
                            f"{type(prompt).__name__}")
        prompt = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in prompt):
            raise TypeError("prompt token ids must be ints")
        return None, [int(t) for t in prompt]

    def check_request(self, prompt, params: SamplingParams, cache_salt: Optional[str] = None
                      ) -> tuple[Optional[str], list[int], Optional[str]]:
        """Validates a request without queuing it; returns (text, token ids, cache salt).

        Raises TypeError/ValueError naming the problem; ``add_request`` runs exactly this.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range "
                             f"[0, {self.cfg.vocab_size})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit "
                             f"max_model_len={limit} (at least one new token is needed)")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the engine's "
                             f"max_logprobs={self.config.max_logprobs}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad_stop:
            raise ValueError(f"SamplingParams.stop_token_ids: {bad_stop[0]} is out of range")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={params.stop!r}: stop strings need a "
                             "tokenizer, and this engine has none (use stop_token_ids)")
        n_stop_ids = len(set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos))
        if params.min_tokens > 0 and n_stop_ids > MAX_SUPPRESS_IDS:
            raise ValueError(f"SamplingParams.min_tokens needs to ban {n_stop_ids} stop ids; "
                             f"at most {MAX_SUPPRESS_IDS} are supported")
        return text, ids, cache_salt

    def add_request(self, request_id: Optional[str], prompt: Union[str, Sequence[int], dict],
                    params: Optional[SamplingParams] = None,
                    cache_salt: Optional[str] = None) -> str:
        """Validates and queues a request; raises ValueError (nothing queued) on bad input.

        ``prompt`` is a string, a list of token ids, or vLLM's dict form (``{"prompt": ...}``
        or ``{"prompt_token_ids": ...}``, optionally with ``"cache_salt"``). Requests with
        different ``cache_salt`` never share prefix-cache pages (tenant isolation).
        """
        params = params or SamplingParams()
        request_id = str(self._counter) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, cache_salt = self.check_request(prompt, params, cache_salt)
        self._counter += 1
        base_seed = params.seed if params.seed is not None else request_seed(
            self.config.seed, request_id)
        seqs = []
        for i in range(params.n):
            seq = Seq(request_id=request_id, index=i, prompt_ids=list(ids), params=params,
                      seed=child_seed(base_seed, i), cache_salt=cache_salt)
            if i > 0:
                seq.fork_from = seqs[0]
            seqs.append(seq)
        self.outputs.add(request_id, text, ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request; its pages and slot are freed now, and the next ``step()`` returns
        its final output with ``finish_reason="abort"`` (unknown or finished ids are ignored)."""
        req = self.requests.get(str(request_id))
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, "abort")
        self._aborted.append(self.outputs.output(req))

    def recover(self) -> list[str]:
        """Makes the engine serve again after ``step()`` raised (a device error).

        The requests of the failed step are aborted (their final outputs come with the next
        step) and returned; every other running sequence is preempted and recomputes later,
        so no other accepted request is lost. The cache and sampler state are rebuilt (the
        failed step may have consumed the donated buffers) and the prefix cache is dropped.
        """
        plans, self._inflight, self._ahead = self._inflight, [], None
        self._verify_next = 0
        failed = set()
        for plan in plans:
            failed |= ({s.request_id for s in plan.decode}
                       | {c.seq.request_id for c in plan.prefill})
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            seq.pending = seq.verifying = 0  # a failed step's tokens never arrive
        for rid in sorted(failed):
            self.abort(rid)
        for seq in list(self.scheduler.running):
            self.scheduler.preempt(seq)
        self.runner.reset()
        self.speculation.reset()
        self.blocks.drop_prefix_cache()
        return sorted(failed)

    def _finish(self, seq: Seq, reason: str, stop_reason=None) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        self.speculation.forget(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        """True while some request is queued or running, or an abort is still to be reported."""
        return self.scheduler.has_work() or bool(self._aborted)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run one device step, turn its tokens into outputs.

        Returns every request that progressed (and those aborted since the last step). With
        async scheduling the step launched here is processed by the next call, and this call
        returns the outputs of the step launched before it (while this one runs).
        """
        self._called = time.perf_counter()
        lookahead, self._verify_next = self._verify_next or self.speculation.lookahead(), 0
        if not self.async_scheduling:
            return self._process(self._collect(self._launch(self._schedule(lookahead))))
        if self._ahead is not None and self._must_drain(lookahead):
            # This call takes the step in flight; the next one launches (a verify step with
            # host drafts then runs synchronously).
            done, self._ahead, self._verify_next = self._ahead, None, lookahead
            return self._process(self._collect(done), optimistic=True)
        plan = self._schedule(lookahead)
        if plan.lookahead and not self.speculation.device_lookup:
            return self._process(self._collect(self._launch(plan)))
        launched = self._launch(plan, optimistic=True)
        done, self._ahead = self._ahead, launched
        outputs = self._process(self._collect(done), optimistic=True)
        if launched is not None and launched.fed:
            # The fed rows' input tokens are on the host now: an adaptive n-gram engine looks
            # up the first draft of some of them, checked when the step in flight lands.
            launched.plan.shadow.update(self.speculation.shadow(
                [s for s in launched.fed if not s.finished]))
        return outputs

    def _must_drain(self, lookahead: int) -> bool:
        """Whether the next step needs the step in flight on the host first: a verify step
        looks its drafts up in every token there (host lookup); with device lookup, a plain
        row's place is unknown after a verify in flight, and a verify row is not fed past
        what its sequence may still hold (max_model_len) or while min_tokens bans stop tokens
        (its count of tokens would be stale)."""
        if not self.speculation.device_lookup:
            return bool(lookahead)
        if not lookahead:
            return self._ahead.verify
        step = 1 + self.spec.num_speculative_tokens
        return any(seq.verifying and (
            seq.params.min_tokens > len(seq.output_ids)
            or seq.num_tokens + step * (seq.verifying + 1) > self.config.max_model_len)
            for seq in self.scheduler.running)

    def wait_device(self) -> None:
        """Blocks until the step in flight (async scheduling) has finished on the device; its
        outputs still come with the next ``step()``. For benchmarks that take turns between
        engines on one machine (``experiments/speculative.py``)."""
        if self._ahead is not None:
            wait(self._ahead.result)

    def _schedule(self, lookahead: int) -> Plan:
        plan = self.scheduler.schedule(self.speculation.reserve(lookahead),
                                       self.config.max_model_len)
        plan.lookahead = lookahead
        self.stats["preemptions"] += len(plan.preempted)
        return plan

    def _launch(self, plan: Plan, optimistic: bool = False) -> Optional["_Launched"]:
        """Dispatches the plan as ONE device step (decode or verify rows beside prefill
        chunks) without waiting for it (None: nothing to run).

        ``optimistic`` (async scheduling): a decode row whose last token is still in flight
        takes it on the device (``ScheduledRow.feed``), and the sequences' state moves on now
        as if the step had returned: K/V counted computed, each emitted token ``pending``."""
        if plan.empty:
            return None
        self._inflight.append(plan)  # until its outputs are processed (see ``recover``)
        self.runner.copy_pages(plan.copies)
        self.speculation.copy_pages(plan.copies)
        fresh = self._init_penalty_rows(plan)
        prefill = [self._row(c.seq, c.start, c.seq.all_ids[c.start:c.start + c.length],
                             c.final) for c in plan.prefill]
        for c, row in zip(plan.prefill, prefill):
            # An EAGLE head carries each slot's last feature from step to step: a sequence's
            # later chunks continue from it, its first chunk after admission does not.
            row.carry_feature = c.start > 0 and c.seq.seq_id not in fresh
        self._note_prefill(plan)
        verify = bool(plan.decode and plan.lookahead)
        decode = (self.speculation.verify_rows(plan.decode, self._row, bool(plan.prefill))
                  if verify else [])
        if verify and not self.speculation.worth_verifying(plan.decode, decode):
            verify = False  # too few drafts (n-gram found few or none): plain is cheaper
        fed = []  # sequences whose row takes its input token on the device
        if not verify:  # (fed rows are looked up once their input token lands: ``step``)
            fed = [seq for seq in plan.decode if seq.pending]
            plan.shadow = self.speculation.shadow([s for s in plan.decode if not s.pending],
                                                  decode or None)
            decode = [self._decode_row(seq) for seq in plan.decode]
        self.speculation.tick(plan.decode)
        for row in decode:
            row.carry_feature = True  # a running sequence's last feature is in its slot
        t0 = time.perf_counter()
        batch = self.runner.prepare(decode, prefill, verify=verify,
                                    head_drafts=self.speculation.head_drafts())
        self._count(batch, decode, prefill)
        drafts, probs = self.speculation.drafts(plan, batch, verify)
        result = self.runner.run(batch, drafts, probs)  # dispatched; the device runs on
        if fed:
            self.stats["fed_rows"] = self.stats.get("fed_rows", 0) + len(fed)
        if optimistic:
            for c in plan.prefill:
                c.seq.num_computed += c.length
                c.seq.pending += c.final
            for seq in plan.decode:
                if verify:  # (device lookup) how many tokens it keeps is known when it lands
                    seq.verifying += 1
                    continue
                seq.num_computed += 1
                seq.pending += 1
        return _Launched(plan, batch, result, verify, t0,
                         batch.parts[0].block_tables.shape[0] if decode else 0, optimistic,
                         fed)

    def _decode_row(self, seq: Seq) -> ScheduledRow:
        """A plain decode row: the sequence's last token (on the device when still pending)."""
        if seq.pending:
            row = self._row(seq, seq.num_tokens + seq.pending - 1, [0], True)
            row.feed = True
            return row
        return self._row(seq, seq.num_tokens - 1, [seq.all_ids[-1]], True)

    def _collect(self, launched: Optional["_Launched"]) -> list[tuple]:
        """Waits for a launched step and gives speculation its outcome (acceptance, shadow
        checks, the step's time); returns (kind, rows, row offset, host result) per kind of
        row, fetched in one transfer."""
        if launched is None:
            return []
        plan, batch, verify = launched.plan, launched.batch, launched.verify
        result = fetch(launched.result)  # one transfer for the step
        # The step's cost: from its launch, or, when it was launched by an earlier call (async
        # scheduling), from this call's start: its share of the pipelined steps' period, idle
        # time between calls (a server waiting, another engine's turn) left out.
        now = time.perf_counter()
        start = max(launched.t0, self._called) if launched.optimistic else launched.t0
        self.speculation.timed(plan, batch, verify, now - start)
        if verify:
            self.speculation.note_verified(plan.decode, result)
        elif plan.decode:
            self.speculation.note_decoded(plan.decode, result, plan.shadow)
        self.stats["steps"] += 1
        self._inflight.remove(plan)
        return [("verify" if verify else "decode", plan.decode, 0, result),
                ("prefill", plan.prefill, launched.offset, result)]

    def _process(self, results: list[tuple], optimistic: bool = False) -> list[RequestOutput]:
        """Commits computed tokens, appends sampled ones (stop checks), builds the outputs.

        ``optimistic``: the step was launched by ``_launch(optimistic=True)``, which already
        counted its K/V; each emitted token stops being pending here, and a sequence that
        finished or was preempted since keeps its token only if it was still being generated
        (the row of a finished sequence is discarded)."""
        aborted, self._aborted = self._aborted, []
        touched: dict[str, RequestState] = {}
        for kind, rows, offset, res in results:
            for i, row in enumerate(rows):
                seq = row.seq if kind == "prefill" else row
                touched[seq.request_id] = self.requests.get(seq.request_id)
                j = offset + i
                if kind == "verify" and seq.verifying:  # launched ahead (device lookup)
                    seq.verifying -= 1
                if optimistic and kind != "verify":
                    emits = kind == "decode" or row.final
                    seq.pending -= emits
                    if seq.finished:
                        continue
                    if seq.status == Status.RUNNING:  # (not preempted since)
                        self.blocks.commit(seq.seq_id, seq.all_ids,
                                           min(seq.num_computed, seq.num_tokens))
                    if not emits:
                        continue
                    self._emit(seq, res, j, 0)
                    continue
                if kind == "prefill":
                    seq.num_computed += row.length
                    self.blocks.commit(seq.seq_id, seq.all_ids, seq.num_computed)
                    if not row.final or seq.finished:
                        continue
                n = int(res.num_accepted[j])  # drafts kept (0 unless verified)
                if kind != "prefill" and not seq.finished and seq.status == Status.RUNNING:
                    # The row's K/V is right for its last token and the n accepted drafts.
                    seq.num_computed += n + 1
                    ids = seq.all_ids + [int(t) for t in res.tokens[j, :n]]
                    if self.spec is not None:  # slots reserved for drafts: give back the rest
                        # (but those of a verify step still in flight: after these tokens)
                        keep = seq.num_computed + seq.verifying * (
                            1 + self.spec.num_speculative_tokens)
                        self.blocks.truncate(seq.seq_id,
                                             min(keep, self.blocks.num_tokens(seq.seq_id)))
                    self.blocks.commit(seq.seq_id, ids, seq.num_computed)
                for t in range(n + 1):
                    if seq.finished:
                        break
                    self._emit(seq, res, j, t)
        return aborted + [self.outputs.output(r) for r in touched.values() if r is not None]

    def _emit(self, seq: Seq, res, j: int, t: int) -> None:
        """Appends the token of sampled row ``j``, position ``t``, with its logprobs."""
        self.outputs.append(seq, int(res.tokens[j, t]), float(res.logprobs[j, t]),
                            zip(res.top_ids[j, t], res.top_logprobs[j, t]))

    def _init_penalty_rows(self, plan: Plan) -> set:
        """Fills the penalty statistics of sequences (re)admitted this step from their whole
        token lists (prefix-cache hits and recomputes included), before their first step.
        Returns the ids of the sequences (re)admitted this step."""
        rows = []
        fresh = set()
        for c in plan.prefill:
            seq = c.seq
            if seq.admitted:
                seq.admitted = False
                fresh.add(seq.seq_id)
                p = seq.params
                # (device n-gram lookup: every slot's token history starts here)
                if (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                        or self.speculation.device_lookup):
                    rows.append((seq.slot, seq.all_ids, len(seq.prompt_ids)))
        self.runner.init_sampler_rows(rows)
        return fresh

    def _row(self, seq: Seq, start: int, tokens: list[int], emit: bool) -> ScheduledRow:
        """A sequence's row of this step, in the runner's terms."""
        p = seq.params
        row = ScheduledRow(
            tokens=tokens, start=start, block_table=self.blocks.block_table(seq.seq_id),
            slot=seq.slot, emit=emit, sampling=dict(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty, seed=seq.seed),
            top_logprobs=bool(p.logprobs))
        n_out = len(seq.output_ids) + seq.pending
        if n_out < p.min_tokens:
            row.suppress_ids = sorted(self.outputs.stop_ids(seq))
            row.suppress_until = p.min_tokens - n_out
        return row

    def _count(self, batch, decode: list[ScheduledRow], prefill: list[ScheduledRow]) -> None:
        if decode:
            self.stats["decode_rows"] += len(decode)
            self.stats["decode_slots"] += batch.parts[0].block_tables.shape[0]
            self.stats["max_decode_rows"] = max(self.stats.get("max_decode_rows", 0),
                                                len(decode))
        if decode and prefill:
            self.stats["mixed_steps"] = self.stats.get("mixed_steps", 0) + 1
        if prefill:
            part = batch.parts[-1]
            self.stats["prefill_tokens"] += sum(len(r.tokens) for r in prefill)
            self.stats["prefill_slots"] += part.block_tables.shape[0] * part.t

    def _note_prefill(self, plan: Plan) -> None:
        now = time.time()
        for c in plan.prefill:
            req = self.requests.get(c.seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now

    def spec_metrics(self) -> dict:
        """Speculative decoding so far (``speculative.controller.spec_metrics``)."""
        return self.speculation.metrics()

    def page_usage(self) -> dict:
        """Pages reserved vs token slots used by running sequences (KV waste)."""
        reserved = used = 0
        for seq in self.scheduler.running:
            reserved += len(self.blocks.block_table(seq.seq_id)) * self.config.page_size
            used += seq.num_tokens
        return {"reserved_slots": reserved, "used_slots": used}


@dataclasses.dataclass
class _Launched:
    """A step dispatched to the device whose outputs the host has not taken yet."""

    plan: Plan
    batch: object  # its host StepInput
    result: object  # its device StepOutput
    verify: bool
    t0: float  # when its host work began
    offset: int  # the prefill rows' first sampled row
    optimistic: bool = False  # launched while the previous step ran (async scheduling)
    fed: list = dataclasses.field(default_factory=list)  # its rows' sequences fed on device
