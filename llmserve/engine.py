"""Engine: add_request / step / abort. Ties the scheduler, block manager and runner together.

Each ``step()`` asks the scheduler for a plan, copies pages for copy-on-write, fills the fixed
shape host arrays, runs the jitted decode and prefill steps, fetches the sampled tokens in one
transfer per step, and applies stop conditions. Bad input is rejected in ``add_request`` with a
``ValueError`` before anything is queued, so the engine keeps serving everyone else.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import jax
import numpy as np

from llmserve.block_manager import BlockManager
from llmserve.config import ModelConfig
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.runner import Runner
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Plan, Scheduler
from llmserve.scheduler import Sequence as Seq


@dataclasses.dataclass
class EngineConfig:
    """Serving knobs (vLLM names where they exist)."""

    max_model_len: int = 2048
    max_num_seqs: int = 32
    page_size: int = 16
    num_pages: Optional[int] = None  # default: every slot can hold max_model_len tokens
    kv_cache_memory: Optional[int] = None  # bytes; alternative to num_pages
    max_num_batched_tokens: int = 512
    prefill_buckets: tuple = ((1, 32), (1, 128), (4, 128))
    decode_buckets: Optional[tuple] = None
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"  # or "static"
    # "paged": pages as a sequence grows; "contiguous": max_model_len reserved at admission
    # (the pre-PagedAttention baseline, for ablations; see block_manager.py)
    kv_reservation: str = "paged"
    backend: Optional[str] = None  # "xla" | "pallas" | "pallas_interpret" | "reference"
    max_logprobs: int = 5
    seed: int = 0
    speculative_config: Optional[dict] = None  # {"method": "ngram"|"draft", "model": ..., K}

    def resolve_num_pages(self, cfg: ModelConfig) -> int:
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise ValueError("EngineConfig: give num_pages or kv_cache_memory, not both")
        if self.num_pages is not None:
            return int(self.num_pages)
        if self.kv_cache_memory is not None:
            itemsize = np.dtype(cfg.jnp_dtype).itemsize
            per_page = 2 * cfg.n_layers * cfg.n_kv_heads * self.page_size * cfg.head_dim * itemsize
            return int(self.kv_cache_memory // per_page)
        return self.max_num_seqs * -(-self.max_model_len // self.page_size) + 1


class _VerifyRow:
    """Adapts row i, position j of a verify result to the fields ``_append_token`` reads."""

    def __init__(self, res, i: int, j: int):
        self.tokens = [int(res.out_tokens[i][j])]
        self.logprobs = [float(res.logprobs[i][j])]
        self.top_ids = [[]]
        self.top_logprobs = [[]]


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Seq]
    metrics: RequestMetrics
    detok: list
    texts: list[str]


class Engine:
    """The serving loop over one model: requests join and leave at every step."""

    def __init__(self, cfg: ModelConfig, params, tokenizer=None,
                 config: Optional[EngineConfig] = None):
        from llmserve.ops.attention import check_backend, default_backend

        self.cfg = cfg
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        backend = check_backend(config.backend or default_backend())
        num_pages = config.resolve_num_pages(cfg)
        pages_per_seq = -(-config.max_model_len // config.page_size)
        if num_pages < pages_per_seq + 1:
            raise ValueError(
                f"KV cache of {num_pages} pages cannot hold one sequence of max_model_len="
                f"{config.max_model_len} ({pages_per_seq} pages of {config.page_size} + 1 dummy)")
        prefill_buckets = tuple((b, min(c, config.max_num_batched_tokens))
                                for b, c in config.prefill_buckets)
        self.runner = Runner(cfg, params, num_pages=num_pages, page_size=config.page_size,
                             max_slots=config.max_num_seqs, max_model_len=config.max_model_len,
                             backend=backend, num_logprobs=config.max_logprobs,
                             decode_buckets=config.decode_buckets,
                             prefill_buckets=prefill_buckets)
        self.blocks = BlockManager(num_pages, config.page_size,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   reservation=config.kv_reservation,
                                   max_model_len=config.max_model_len)
        self.scheduler = Scheduler(
            self.blocks, max_slots=config.max_num_seqs,
            max_prefill_rows=self.runner.max_prefill_rows, max_chunk=self.runner.max_chunk,
            max_num_batched_tokens=config.max_num_batched_tokens, policy=config.scheduling)
        self.requests: dict[str, _Request] = {}
        self.stats = {"steps": 0, "decode_rows": 0, "decode_slots": 0, "prefill_tokens": 0,
                      "prefill_slots": 0, "preemptions": 0, "generated_tokens": 0}
        self._eos = set()
        if tokenizer is not None:
            self._eos = set(getattr(tokenizer, "stop_token_ids", None) or [])
        elif cfg.eos_token_id is not None:
            self._eos = {cfg.eos_token_id}
        self._counter = 0
        self.spec = None
        if config.speculative_config is not None:
            self._init_speculation(config.speculative_config, num_pages, backend)

    def _init_speculation(self, spec_cfg, num_pages: int, backend: str) -> None:
        from llmserve import speculative as sp

        self.spec = spec = sp.SpeculativeConfig.from_dict(spec_cfg)
        k = spec.num_speculative_tokens
        self.policy = sp.SpeculationPolicy(k, adaptive=spec.adaptive)
        if spec.method == "ngram":
            self.proposer = sp.NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min, k)
            return
        if isinstance(spec.model, (tuple, list)):
            dcfg, dparams = spec.model
        else:
            from llmserve.checkpoint import load_checkpoint

            dcfg, dparams = load_checkpoint(spec.model, dtype=self.cfg.dtype)
        self.proposer = sp.DraftModelProposer(dcfg, dparams, num_pages=num_pages,
                                              page_size=self.config.page_size, k=k,
                                              backend=backend, target_vocab=self.cfg.vocab_size)
        self.spec_stats = None

    # ------------------------------------------------------------------ requests
    def warmup(self) -> None:
        """Compiles every step shape once; no compilation happens while serving afterwards.

        With speculation on, it also compiles the verify (and draft) shapes and times decode
        against verify per bucket, seeding the never-slower policy.
        """
        self.runner.warmup()
        if self.spec is None:
            return
        k = self.spec.num_speculative_tokens
        for b in self.runner.decode_buckets:
            for attempt in range(2):  # only the second run is timed: the first compiles
                t0 = time.perf_counter()
                jax.block_until_ready(self.runner.run(self.runner.empty_input(b, 1)).tokens)
                t_decode = time.perf_counter() - t0
                t0 = time.perf_counter()
                host = self.runner.empty_input(b, k + 1)
                out = self._verify_rows(host, [], b)
                jax.block_until_ready(out.out_tokens)
                if attempt == 1:
                    self.policy.time("decode", b, t_decode)
                    self.policy.time("verify", b, time.perf_counter() - t0)
        if hasattr(self.proposer, "prefill"):
            for b, c in self.runner.prefill_buckets:
                host = self.runner.empty_input(b, c)
                self.proposer.prefill(*self._draft_prefill_args(host))

    def _tokenize(self, prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError) as e:
            raise ValueError(f"prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}") from e
        return None, ids

    def add_request(self, request_id: Optional[str], prompt: Union[str, Sequence[int], dict],
                    params: Optional[SamplingParams] = None) -> str:
        """Validates and queues a request; raises ValueError (nothing queued) on bad input."""
        params = params or SamplingParams()
        params.validate()
        if request_id is None:
            request_id = str(self._counter)
        request_id = str(request_id)
        self._counter += 1
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError(f"request {request_id}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token id {bad[0]} is out of range "
                             f"[0, {self.cfg.vocab_size})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"request {request_id}: prompt of {len(ids)} tokens does not fit "
                             f"max_model_len={limit} (at least one new token is needed)")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the engine's "
                             f"max_logprobs={self.config.max_logprobs}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad_stop:
            raise ValueError(f"SamplingParams.stop_token_ids: {bad_stop[0]} is out of range")
        base_seed = params.seed if params.seed is not None else (
            hash((self.config.seed, request_id)) & 0x7FFFFFFF)
        seqs = []
        for i in range(params.n):
            seq = Seq(request_id=request_id, index=i, prompt_ids=list(ids), params=params,
                      seed=(base_seed + i) & 0x7FFFFFFF)
            if i > 0:
                seq.fork_from = seqs[0]
            seqs.append(seq)
        detok = []
        if self.tokenizer is not None:
            from llmserve.tokenizer import IncrementalDetokenizer

            detok = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                     for _ in seqs]
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs,
                                             RequestMetrics(arrival_time=time.time()), detok,
                                             ["" for _ in seqs])
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stops a request; its pages and slot are freed now."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling iteration; returns the requests that progressed."""
        lookahead = self._lookahead()
        plan = self.scheduler.schedule(lookahead, self.config.max_model_len)
        self.stats["preemptions"] += len(plan.preempted)
        if plan.empty:
            return []
        self.runner.copy_pages(plan.copies)
        self.runner.copy_sampler_rows([
            (c.seq.fork_from.slot, c.seq.slot) for c in plan.prefill
            if c.seq.fork_from is not None and not c.seq.output_ids and c.start > 0
            and c.seq.fork_from.slot is not None])
        if self.spec is not None and plan.copies and hasattr(self.proposer, "copy_pages"):
            src, dst = zip(*plan.copies)
            self.proposer.copy_pages(jax.numpy.asarray(src), jax.numpy.asarray(dst))
        outs = []
        t0 = time.perf_counter()
        if plan.decode and lookahead:
            outs.append(("verify", plan.decode, self._run_verify(plan)))
        elif plan.decode:
            outs.append(("decode", plan.decode, self._run_decode(plan)))
        if plan.prefill:
            outs.append(("prefill", plan.prefill, self._run_prefill(plan)))
        fetched = jax.device_get([o[2] for o in outs])  # one transfer for the whole step
        if self.spec is not None and plan.decode:
            elapsed = time.perf_counter() - t0
            key = "spec_verify_time_s" if lookahead else "spec_decode_time_s"
            self.stats[key] = self.stats.get(key, 0.0) + elapsed  # draft + verify, or decode
            if not plan.prefill:
                self.policy.time("verify" if lookahead else "decode",
                                 self.runner.decode_bucket(len(plan.decode)), elapsed)
        touched: dict[str, _Request] = {}
        for (kind, rows, _), res in zip(outs, fetched):
            if kind == "verify":
                for i, seq in enumerate(rows):
                    self._accept_verified(seq, res, i)
                    touched[seq.request_id] = self.requests.get(seq.request_id)
                continue
            for i, row in enumerate(rows):
                if kind == "decode":
                    seq = row
                    seq.num_computed += 1
                    emit = True
                else:
                    seq = row.seq
                    seq.num_computed += row.length
                    emit = row.final
                self.blocks.commit(seq.seq_id, seq.all_ids, seq.num_computed)
                if emit and not seq.finished:
                    self._append_token(seq, res, i)
                touched[seq.request_id] = self.requests.get(seq.request_id)
        self.stats["steps"] += 1
        return [self._output(r) for r in touched.values() if r is not None]

    def _fill_row(self, host: dict, i: int, seq: Seq, start: int, tokens: list[int],
                  emit: bool) -> None:
        n = len(tokens)
        host["tokens"][i, :n] = tokens
        host["q_start"][i] = start
        host["n_valid"][i] = n
        host["prompt_len"][i] = len(seq.prompt_ids)
        table = self.blocks.block_table(seq.seq_id)
        host["block_tables"][i, : len(table)] = table
        host["slot_ids"][i] = seq.slot
        host["reset"][i] = start == 0
        host["emit"][i] = emit
        p = seq.params
        host["sampling"][i] = dict(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, seed=seq.seed)
        if len(seq.output_ids) < p.min_tokens:
            banned = sorted(self._stop_ids(seq))[: host["suppress_ids"].shape[1]]
            host["suppress_ids"][i, : len(banned)] = banned

    def _run_decode(self, plan: Plan):
        b = self.runner.decode_bucket(len(plan.decode))
        host = self.runner.empty_input(b, 1)
        for i, seq in enumerate(plan.decode):
            self._fill_row(host, i, seq, seq.num_tokens - 1, [seq.all_ids[-1]], True)
        self.stats["decode_rows"] += len(plan.decode)
        self.stats["decode_slots"] += b
        self.stats["max_decode_rows"] = max(self.stats.get("max_decode_rows", 0), len(plan.decode))
        return self.runner.run(host)

    def _lookahead(self) -> int:
        """K when this step should verify drafts (see SpeculationPolicy), else 0."""
        if self.spec is None:
            return 0
        rows = [s for s in self.scheduler.running if not s.in_prefill]
        if not rows:
            return 0
        if not any(self.policy.proposes(s.seq_id) for s in rows):
            return 0
        bucket = self.runner.decode_bucket(len(rows))
        return self.spec.num_speculative_tokens if self.policy.speculate(
            [s.seq_id for s in rows], bucket) else 0

    def _run_verify(self, plan: Plan):
        k = self.spec.num_speculative_tokens
        b = self.runner.decode_bucket(len(plan.decode))
        host = self.runner.empty_input(b, k + 1)
        for i, seq in enumerate(plan.decode):
            self._fill_row(host, i, seq, seq.num_tokens - 1, [seq.all_ids[-1]], True)
        self.stats["decode_rows"] += len(plan.decode)
        self.stats["decode_slots"] += b
        return self._verify_rows(host, plan.decode, b)

    def _verify_rows(self, host: dict, seqs: list, b: int):
        """Proposes drafts for the rows of ``host`` (tokens [b, K+1]) and runs verify."""
        from llmserve.speculative import ProposeInput

        k = self.spec.num_speculative_tokens
        room = np.zeros(b, np.int32)  # drafts each row may carry (max_model_len, policy)
        for i, seq in enumerate(seqs):
            if self.policy.proposes(seq.seq_id):
                room[i] = max(0, min(k, self.config.max_model_len - seq.num_tokens))
        if self.spec.method == "ngram":
            drafts, num = self.proposer.propose_batch([s.all_ids for s in seqs] or [[0]], k)
            drafts = np.pad(drafts, ((0, b - len(drafts)), (0, 0)))[:b]
            num = np.minimum(np.pad(num, (0, b - len(num)))[:b], room)
            probs = None
        else:
            tail = np.zeros((b, 2), np.int32)
            q_start = np.zeros(b, np.int32)
            n_valid = np.zeros(b, np.int32)
            for i, seq in enumerate(seqs):
                ids = seq.all_ids
                n = min(2, len(ids))
                tail[i, :n] = ids[len(ids) - n:]
                q_start[i] = len(ids) - n
                n_valid[i] = n
            sampling_arrays = self.runner._device_input(host).sampling
            proposal = self.proposer.propose(ProposeInput(
                token_ids=[], tail=jax.numpy.asarray(tail), q_start=jax.numpy.asarray(q_start),
                n_valid=jax.numpy.asarray(n_valid),
                block_tables=jax.numpy.asarray(host["block_tables"]), sampling=sampling_arrays))
            drafts, probs = proposal.tokens, proposal.probs
            num = room
        self._num_draft = num  # host copy: how many drafts each row carried this step
        host["tokens"][:, 1:] = np.asarray(drafts) if self.spec.method == "ngram" else 0
        host["n_valid"][: len(seqs)] = 1 + num[: len(seqs)]
        if self.spec.method == "draft":
            tokens = jax.numpy.asarray(host["tokens"]).at[:, 1:].set(drafts)
            host = dict(host, tokens=tokens)
        return self.runner.run_verify(host, drafts, num, probs)

    def _accept_verified(self, seq: Seq, res, i: int) -> None:
        """Appends the accepted drafts and the target's token; rolls back the rest."""
        n = int(res.num_accepted[i])
        proposed = int(np.count_nonzero(res.out_tokens[i] >= 0)) - 1
        req = self.requests.get(seq.request_id)
        drafted = self._last_num_draft(seq, res, i)
        self.policy.record(seq.seq_id, drafted, n)
        if req is not None:
            req.metrics.spec_proposed += drafted
            req.metrics.spec_accepted += n
        self.stats["spec_proposed"] = self.stats.get("spec_proposed", 0) + drafted
        self.stats["spec_accepted"] = self.stats.get("spec_accepted", 0) + n
        self.stats["spec_verify_rows"] = self.stats.get("spec_verify_rows", 0) + 1
        k = self.spec.num_speculative_tokens
        proposed_at = self.stats.setdefault("spec_proposed_per_pos", [0] * k)
        accepted_at = self.stats.setdefault("spec_accepted_per_pos", [0] * k)
        for j in range(drafted):
            proposed_at[j] += 1
        for j in range(n):
            accepted_at[j] += 1
        seq.num_computed += n + 1
        for j in range(proposed + 1):
            if seq.finished:
                break
            self._append_token(seq, _VerifyRow(res, i, j), 0)
        if not seq.finished:
            self.blocks.truncate(seq.seq_id, seq.num_computed)
            self.blocks.commit(seq.seq_id, seq.all_ids, seq.num_computed)

    def _last_num_draft(self, seq: Seq, res, i: int) -> int:
        return int(self._num_draft[i])

    def _draft_prefill_args(self, host: dict):
        jnp_ = jax.numpy
        return (jnp_.asarray(host["tokens"]), jnp_.asarray(host["q_start"]),
                jnp_.asarray(host["n_valid"]), jnp_.asarray(host["block_tables"]))

    def _run_prefill(self, plan: Plan):
        longest = max(c.length for c in plan.prefill)
        b, t = self.runner.prefill_bucket(len(plan.prefill), longest)
        host = self.runner.empty_input(b, t)
        for i, c in enumerate(plan.prefill):
            ids = c.seq.all_ids[c.start: c.start + c.length]
            self._fill_row(host, i, c.seq, c.start, ids, c.final)
            now = time.time()
            req = self.requests.get(c.seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        self.stats["prefill_tokens"] += sum(c.length for c in plan.prefill)
        self.stats["prefill_slots"] += b * t
        if self.spec is not None and hasattr(self.proposer, "prefill"):
            self.proposer.prefill(*self._draft_prefill_args(host))  # mirror into the draft
        return self.runner.run(host)

    def _stop_ids(self, seq: Seq) -> set:
        ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids |= self._eos
        return ids

    def _append_token(self, seq: Seq, res, i: int) -> None:
        token = int(res.tokens[i])
        p = seq.params
        seq.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if p.logprobs is not None:
            entry = {token: float(res.logprobs[i])}
            for tid, lp in zip(res.top_ids[i][: p.logprobs], res.top_logprobs[i][: p.logprobs]):
                entry.setdefault(int(tid), float(lp))
            seq.logprobs.append(entry)
        seq.cumulative_logprob += float(res.logprobs[i])
        req = self.requests.get(seq.request_id)
        if req is not None and req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        if req is not None and req.detok:
            req.texts[seq.index] += req.detok[seq.index].add(token)
        n_out = len(seq.output_ids)
        if n_out >= p.min_tokens and token in self._stop_ids(seq):
            self.scheduler.finish(seq, "stop", token)
        elif req is not None and p.stop and n_out >= p.min_tokens and self._hit_stop_str(req, seq):
            pass
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or \
                seq.num_tokens >= self.config.max_model_len:
            self.scheduler.finish(seq, "length")

    def _hit_stop_str(self, req: _Request, seq: Seq) -> bool:
        text = req.texts[seq.index]
        for s in seq.params.stop:
            pos = text.find(s, max(0, len(text) - 64 - len(s)))
            if pos >= 0:
                keep = pos + len(s) if seq.params.include_stop_str_in_output else pos
                req.texts[seq.index] = text[:keep]
                self.scheduler.finish(seq, "stop", s)
                return True
        return False

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            if req.detok:
                text = req.texts[seq.index]
            elif self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_ids,
                                             skip_special_tokens=seq.params.skip_special_tokens)
            else:
                text = ""
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_ids),
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cumulative_logprob))
        finished = all(s.finished for s in req.seqs)
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        req.metrics.num_cached_tokens = req.seqs[0].num_cached
        if finished:
            for seq in req.seqs:  # emit text held back for an incomplete character
                if req.detok and not isinstance(seq.stop_reason, str):
                    outs[seq.index].text += req.detok[seq.index].flush()
            req.metrics.finished_time = req.metrics.finished_time or time.time()
            self.requests.pop(req.request_id, None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=list(req.prompt_ids), outputs=outs,
                             finished=finished, metrics=req.metrics)

    def spec_metrics(self) -> dict:
        """Speculative decoding so far: acceptance rate, mean accepted length per verify row,
        acceptance per draft position, and the time spent in verify (draft + verify) and in
        plain decode steps."""
        st = self.stats
        proposed, rows = st.get("spec_proposed", 0), st.get("spec_verify_rows", 0)
        per_pos = [a / p if p else None for a, p in zip(st.get("spec_accepted_per_pos", []),
                                                        st.get("spec_proposed_per_pos", []))]
        return {"acceptance_rate": st.get("spec_accepted", 0) / proposed if proposed else None,
                "mean_accepted_length": st.get("spec_accepted", 0) / rows if rows else None,
                "acceptance_per_position": per_pos,
                "verify_time_s": st.get("spec_verify_time_s", 0.0),
                "decode_time_s": st.get("spec_decode_time_s", 0.0)}

    def page_usage(self) -> dict:
        """Pages reserved vs token slots used by running sequences (KV waste)."""
        reserved = used = 0
        for seq in self.scheduler.running:
            reserved += len(self.blocks.block_table(seq.seq_id)) * self.config.page_size
            used += seq.num_tokens
        return {"reserved_slots": reserved, "used_slots": used}

