"""A seeded soak with faults: many random requests through the engine, then every invariant.

``run_soak(SoakConfig(...))`` returns a ``SoakReport`` (figures + failures). Each *run* is one
engine, "plain" or with speculation ("ngram", or "draft" with draft == target), over a tiny
random model with a character-level tokenizer (so stop strings match often). Requests arrive
at random steps with random prompts (text or ids; some share a prefix, some repeat a motif),
lengths and sampling parameters (n > 1, stop strings and ids, seeds, penalties, min_tokens,
logprobs, ...). Faults: a page pool far too small for all requests at once (preemption),
aborts at random moments (of waiting, running, finished and unknown requests, some twice), and
bad requests that must be rejected without touching the engine's state.

Afterwards (failures are collected, not raised, so one run reports all of them):
- every request reports exactly one final output, and nothing after it;
- every request that was not aborted finished each completion with "stop" or "length", and the
  reason agrees with its tokens (stop id, stop string, max_tokens, max_model_len), its text
  and its logprobs (each holds the sampled token; ``cumulative_logprob`` is their sum);
- every aborted request reports "abort";
- each completion equals the same request run alone (one request at a time, on an engine of
  the same shapes; an n > 1 child runs as n = 1 seeded ``child_seed(seed, i)``): greedy ones in
  every run, sampled ones too without speculation (with speculation seeded sampling keeps its
  distribution, not its bits); an aborted one's tokens are a prefix of its lone run's;
- zero pages are referenced, the block manager's invariants hold, and nothing compiled after
  warm-up.
"""

from __future__ import annotations

import dataclasses
import math
import string
import time
from typing import Optional, Union

import numpy as np

from llmserve.engine import Engine, EngineConfig
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams, child_seed, request_seed

RUNS = ("plain", "ngram", "draft")
_TEXT_CHARS = string.ascii_lowercase + "     ,.\n"  # prompts: word-like text
_STOP_CHARS = string.ascii_letters + string.digits + " "


@dataclasses.dataclass
class SoakConfig:
    """The soak's size and the engine it stresses (the defaults are the full run's)."""

    requests: int = 1000  # in all, split evenly over ``runs``
    runs: tuple = RUNS
    seed: int = 0
    max_model_len: int = 64
    max_num_seqs: int = 8
    page_size: int = 4
    num_pages: int = 33  # 32 usable pages of 4 tokens: two max-length sequences
    max_num_batched_tokens: int = 32
    prefill_buckets: tuple = ((4, 16),)
    decode_buckets: tuple = (8,)
    max_logprobs: int = 3
    num_speculative_tokens: int = 3
    max_prompt: int = 40  # prompt tokens (some prompts go up to max_model_len - 1)
    max_new: int = 24
    arrivals_per_step: float = 1.5  # mean requests added per engine step (Poisson)
    abort_fraction: float = 0.1  # requests aborted at a random later step
    bad_request_rate: float = 0.02  # chance per step of a bad request (must be rejected)


@dataclasses.dataclass
class Job:
    """One request of the workload, with when it arrives and when (if ever) it is aborted."""

    request_id: str
    prompt: Union[str, list]
    params: SamplingParams
    arrive: int  # engine step before which it is added
    abort_at: Optional[int] = None  # engine step before which abort() is called


@dataclasses.dataclass
class SoakReport:
    """Figures per run and in total, every failed check (empty when the soak passed), and a
    per-step timeline (running, waiting, free pages) for plots."""

    figures: dict
    failures: list
    timeline: dict

    @property
    def ok(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------------------------- model
def char_tokenizer():
    """A character-level tokenizer: printable ASCII and newline (ids 0-95), then the special
    tokens ``<|endoftext|>`` (96, EOS) and ``<|im_start|>`` (97). Byte-level BPE without merges,
    so any ASCII text encodes one token per character and decodes back exactly."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from llmserve.tokenizer import Tokenizer

    # GPT-2's byte-to-symbol map: printable ASCII is itself; space and newline are shifted.
    chars = {b: chr(b) for b in range(33, 127)} | {32: "\u0120", 10: "\u010a"}
    vocab = {chars[b]: i for i, b in enumerate(list(range(32, 127)) + [10])}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
    return Tokenizer(hf, eos_token="<|endoftext|>")


def soak_model(seed: int = 0, logit_scale: float = 0.25):
    """(cfg, params, tokenizer): the tiny-9-3 preset over ``char_tokenizer``'s 98 ids.

    The weights are spread (kernels to std 1/sqrt(fan_in), the tied embedding to std
    ``logit_scale``) so the next-token distribution is peaked as in a trained model (entropy
    well below log V) rather than nearly uniform: outputs repeat, stop strings match, and
    greedy picks are not coin flips between near-equal logits.
    """
    import jax

    from llmserve.config import preset
    from llmserve.model import init_params

    tok = char_tokenizer()
    cfg = preset("tiny-9-3").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)

    def spread(path, x):
        name = jax.tree_util.keystr(path)
        if "embedding" in name:
            return x * (logit_scale / x.std())
        if "kernel" in name:
            return x * (x.shape[0] ** -0.5 / x.std())
        return x

    params = jax.tree_util.tree_map_with_path(spread, init_params(cfg, seed=seed))
    return cfg, params, tok


# ---------------------------------------------------------------------------------- workload
def random_params(rng: np.random.Generator, soak: SoakConfig, vocab: int) -> SamplingParams:
    """Random sampling parameters: greedy or sampled, n > 1, seeds, truncation, penalties,
    min/max tokens, stop strings (``aim_stop_strings`` aims some at the output) and ids,
    logprobs and the output switches."""
    def maybe(p):
        return rng.random() < p

    greedy = maybe(0.4)
    kw: dict = dict(temperature=0.0 if greedy else float(rng.choice([0.5, 0.8, 1.0, 1.3])))
    kw["n"] = 1 if maybe(0.8) else int(rng.integers(2, 4))
    if not greedy:
        kw["seed"] = int(rng.integers(0, 2**31)) if maybe(0.6) else None
        kw["top_k"] = int(rng.integers(1, 40)) if maybe(0.3) else -1
        kw["top_p"] = float(rng.uniform(0.5, 1.0)) if maybe(0.3) else 1.0
        kw["min_p"] = float(rng.uniform(0.02, 0.2)) if maybe(0.15) else 0.0
    if maybe(0.25):
        kw["presence_penalty"] = float(rng.uniform(-1.0, 2.0))
    if maybe(0.2):
        kw["frequency_penalty"] = float(rng.uniform(-0.5, 1.0))
    if maybe(0.2):
        kw["repetition_penalty"] = float(rng.uniform(0.8, 1.4))
    kw["max_tokens"] = None if maybe(0.05) else int(rng.integers(1, soak.max_new + 1))
    if maybe(0.2):
        kw["min_tokens"] = int(rng.integers(1, min(kw["max_tokens"] or 8, 8) + 1))
    if maybe(0.35):  # 1-3 stop strings of 1-3 characters
        kw["stop"] = ["".join(rng.choice(list(_STOP_CHARS), int(rng.integers(1, 4))))
                      for _ in range(int(rng.integers(1, 4)))]
        kw["include_stop_str_in_output"] = maybe(0.4)
    if maybe(0.1):
        kw["stop_token_ids"] = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 3)))]
    kw["ignore_eos"] = maybe(0.5)
    if maybe(0.3):
        kw["logprobs"] = int(rng.integers(0, soak.max_logprobs + 1))
    kw["skip_special_tokens"] = maybe(0.8)
    return SamplingParams(**kw)


def random_prompt(rng: np.random.Generator, soak: SoakConfig, vocab: int, prefix: list):
    """Text or token ids; some share ``prefix`` (prefix-cache hits), some repeat a motif
    (n-gram matches), a few reach max_model_len - 1 (room for one token)."""
    if rng.random() < 0.04:
        length = soak.max_model_len - 1
    else:
        length = int(rng.integers(1, soak.max_prompt + 1))
    if rng.random() < 0.4:
        return "".join(rng.choice(list(_TEXT_CHARS), length))
    kind = rng.random()
    if kind < 0.3:
        ids = prefix + rng.integers(0, vocab, max(1, length - len(prefix))).tolist()
    elif kind < 0.6:
        motif = rng.integers(0, vocab, int(rng.integers(2, 6))).tolist()
        ids = (motif * length)[:length]
    else:
        ids = rng.integers(0, vocab, length).tolist()
    return ids[: soak.max_model_len - 1]


def make_jobs(soak: SoakConfig, n: int, vocab: int, seed: int) -> list[Job]:
    """``n`` random requests with Poisson arrivals and ``abort_fraction`` of them aborted."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, 3 * soak.page_size).tolist()
    jobs, step = [], 0
    for i in range(n):
        step += int(rng.poisson(1.0 / soak.arrivals_per_step))
        job = Job(f"r{i}", random_prompt(rng, soak, vocab, prefix),
                  random_params(rng, soak, vocab), arrive=step)
        if rng.random() < soak.abort_fraction:
            job.abort_at = step + int(rng.integers(0, 25))
        jobs.append(job)
    return jobs


def aim_stop_strings(jobs: list[Job], model, seed: int, probe_tokens: int = 8) -> None:
    """Replaces one stop string of most requests that have some with 1-3 characters of their
    prompt's greedy continuation (one reference batch), so stop strings do match, often across
    token boundaries; random strings alone would rarely match the model's text."""
    from llmserve.reference import generate_reference

    cfg, params, tok = model
    rng = np.random.default_rng(seed)
    aimed = [j for j in jobs if j.params.stop and rng.random() < 0.8]
    if not aimed:
        return
    prompts = [tok.encode(j.prompt) if isinstance(j.prompt, str) else j.prompt for j in aimed]
    for job, cont in zip(aimed, generate_reference(params, cfg, prompts, probe_tokens)):
        text = tok.decode(cont)
        if text:
            start = int(rng.integers(len(text)))
            job.params.stop[int(rng.integers(len(job.params.stop)))] = \
                text[start:start + int(rng.integers(1, 4))]


# ---------------------------------------------------------------------------------- faults
def bad_requests(engine: Engine, live_id: Optional[str]) -> list:
    """(name, prompt, params, request id) of requests ``add_request`` must reject."""
    nan_temp = SamplingParams()
    nan_temp.temperature = math.nan  # set after construction: only add_request can catch it
    limit, vocab = engine.config.max_model_len, engine.cfg.vocab_size
    cases = [("empty prompt", [], SamplingParams(), None),
             ("too long", [1] * limit, SamplingParams(), None),
             ("token out of range", [1, vocab], SamplingParams(), None),
             ("NaN temperature", [1, 2], nan_temp, None),
             ("logprobs above max_logprobs", [1, 2],
              SamplingParams(logprobs=engine.config.max_logprobs + 1), None),
             ("stop id out of range", [1, 2], SamplingParams(stop_token_ids=[vocab]), None)]
    if live_id is not None:
        cases.append(("duplicate request id", [1, 2], SamplingParams(), live_id))
    return cases


def _engine_state(engine: Engine) -> tuple:
    return (sorted(engine.requests), len(engine.scheduler.waiting),
            len(engine.scheduler.running), engine.blocks.num_free_pages)


def inject_bad_request(engine: Engine, rng: np.random.Generator, live: list,
                       failures: list) -> None:
    """Sends one bad request; it must raise ValueError/TypeError and change nothing."""
    cases = bad_requests(engine, live[int(rng.integers(len(live)))] if live else None)
    name, prompt, params, rid = cases[int(rng.integers(len(cases)))]
    before = _engine_state(engine)
    try:
        engine.add_request(rid or "bad-request", prompt, params)
        failures.append(f"bad request ({name}) was accepted")
        engine.abort(rid or "bad-request")
    except (ValueError, TypeError):
        pass
    if _engine_state(engine) != before:
        failures.append(f"bad request ({name}) changed the engine's state")


# ---------------------------------------------------------------------------------- checks
def _stop_ids(engine: Engine, p: SamplingParams) -> set:
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:
        ids |= set(engine.cfg.eos_token_ids) | set(engine.tokenizer.stop_token_ids)
    return ids


def check_completion(engine: Engine, where: str, c: CompletionOutput, p: SamplingParams,
                     prompt_len: int, aborted: bool) -> list[str]:
    """Everything one completion's fields must agree on; returns the failures."""
    bad = []
    ids, n, limit = c.token_ids, len(c.token_ids), engine.config.max_model_len
    reasons = ("stop", "length", "abort") if aborted else ("stop", "length")
    if c.finish_reason not in reasons:
        return [f"{where}: finish_reason {c.finish_reason!r}"]
    stops = _stop_ids(engine, p)
    floor = min(p.min_tokens, limit - prompt_len)
    early = [j for j, t in enumerate(ids[:-1]) if j + 1 >= p.min_tokens and t in stops]
    if early:
        bad.append(f"{where}: stop id {ids[early[0]]} at {early[0]} did not stop it")
    if p.max_tokens is not None and n > p.max_tokens or prompt_len + n > limit:
        bad.append(f"{where}: {n} tokens exceed max_tokens={p.max_tokens} or max_model_len")
    if c.finish_reason == "length":
        if n != p.max_tokens and prompt_len + n != limit:
            bad.append(f"{where}: 'length' after {n} tokens (max_tokens={p.max_tokens})")
    elif c.finish_reason == "stop":
        if n < floor:
            bad.append(f"{where}: stopped after {n} < min_tokens={p.min_tokens}")
        if isinstance(c.stop_reason, str):
            if c.stop_reason not in p.stop:
                bad.append(f"{where}: stop_reason {c.stop_reason!r} not in stop={p.stop}")
            elif p.include_stop_str_in_output and not c.text.endswith(c.stop_reason):
                bad.append(f"{where}: text {c.text!r} does not end with {c.stop_reason!r}")
        elif not ids or c.stop_reason != ids[-1] or ids[-1] not in stops:
            bad.append(f"{where}: 'stop' with stop_reason {c.stop_reason!r}, last token "
                       f"{ids[-1:]}")
    if c.finish_reason != "abort" and not isinstance(c.stop_reason, str):
        want = engine.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if c.text != want:
            bad.append(f"{where}: text {c.text!r} != decode(token_ids) {want!r}")
    if p.logprobs is None:
        if c.logprobs is not None:
            bad.append(f"{where}: logprobs without being asked")
    elif len(c.logprobs or []) != n:
        bad.append(f"{where}: {len(c.logprobs or [])} logprob entries for {n} tokens")
    else:
        for t, entry in zip(ids, c.logprobs):
            if t not in entry or len(entry) > p.logprobs + 1 or max(entry.values()) > 1e-5:
                bad.append(f"{where}: logprob entry {entry} for token {t}")
                break
        else:
            total = sum(e[t] for t, e in zip(ids, c.logprobs))
            if not math.isclose(total, c.cumulative_logprob, rel_tol=1e-5, abs_tol=1e-3):
                bad.append(f"{where}: cumulative_logprob {c.cumulative_logprob} != {total}")
    return bad


def child_params(engine: Engine, job: Job, index: int) -> SamplingParams:
    """The n = 1 request equal to completion ``index`` of ``job`` (seeded ``child_seed``)."""
    p = job.params
    base = p.seed if p.seed is not None else request_seed(engine.config.seed, job.request_id)
    return dataclasses.replace(p, n=1, seed=child_seed(base, index))


def run_alone(engine: Engine, requests: list) -> list[CompletionOutput]:
    """Runs each (prompt ids, params) by itself on ``engine``: nothing else is in its batch
    and a lone request always has pages enough (the pool holds one max_model_len sequence)."""
    outs = []
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"alone-{i}", list(prompt), params)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        outs.append(final.outputs[0])
    return outs


def _same(a: CompletionOutput, b: CompletionOutput, prefix_only: bool) -> Optional[str]:
    if prefix_only:
        return None if b.token_ids[:len(a.token_ids)] == a.token_ids else "not a prefix"
    if a.token_ids != b.token_ids:
        return "token ids differ"
    if (a.text, a.finish_reason, a.stop_reason) != (b.text, b.finish_reason, b.stop_reason):
        return (f"(text, finish, stop) {(a.text, a.finish_reason, a.stop_reason)!r} != "
                f"{(b.text, b.finish_reason, b.stop_reason)!r}")
    if a.logprobs is not None and not np.allclose(
            [e[t] for t, e in zip(a.token_ids, a.logprobs)],
            [e[t] for t, e in zip(b.token_ids, b.logprobs)], atol=1e-4):
        return "logprobs differ"
    return None


# ---------------------------------------------------------------------------------- runs
def engine_config(soak: SoakConfig, run: str, model) -> EngineConfig:
    """The soak's engine for one run ("plain", "ngram" or "draft" with draft == target)."""
    spec = None
    if run != "plain":
        spec = {"method": run, "num_speculative_tokens": soak.num_speculative_tokens,
                "adaptive": False}
        if run == "draft":
            spec["model"] = model
    return EngineConfig(max_model_len=soak.max_model_len, max_num_seqs=soak.max_num_seqs,
                        page_size=soak.page_size, num_pages=soak.num_pages,
                        max_num_batched_tokens=soak.max_num_batched_tokens,
                        prefill_buckets=tuple(tuple(b) for b in soak.prefill_buckets),
                        decode_buckets=tuple(soak.decode_buckets),
                        max_logprobs=soak.max_logprobs, seed=soak.seed,
                        speculative_config=spec)


def compilations(engine: Engine) -> int:
    """Executables of the engine's jitted steps (and the draft model's), process-wide."""
    n = engine.runner.num_compilations()
    if engine.spec is not None and hasattr(engine.proposer, "num_compilations"):
        n += engine.proposer.num_compilations()
    return n


def serve(engine: Engine, jobs: list[Job], rng: np.random.Generator, soak: SoakConfig,
          failures: list, timeline: list, counts: dict) -> tuple[dict, set]:
    """Feeds ``jobs`` to the engine step by step with aborts and bad requests; returns the final
    output of every request and the ids aborted while unfinished (``counts`` gets the faults)."""
    pending = sorted(jobs, key=lambda j: j.arrive)
    aborts: dict[int, list] = {}
    for j in jobs:
        if j.abort_at is not None:
            aborts.setdefault(j.abort_at, []).append(j.request_id)
    finals: dict[str, RequestOutput] = {}
    added: list[str] = []
    aborted_live: set = set()
    step, max_steps = 0, 50 * len(jobs) + 1000
    while pending or engine.has_unfinished_requests() or any(s >= step for s in aborts):
        while pending and pending[0].arrive <= step:
            job = pending.pop(0)
            engine.add_request(job.request_id, job.prompt, job.params)
            added.append(job.request_id)
        for rid in aborts.pop(step, []):
            if rid not in finals and rid in added:
                aborted_live.add(rid)
            else:
                counts["aborts_ignored"] += 1
            engine.abort(rid)  # finished or not yet added: ignored
            if rng.random() < 0.2:
                engine.abort(rid)  # twice: still one final output
                counts["aborts_twice"] += 1
        if rng.random() < soak.bad_request_rate:
            live = [r for r in added if r not in finals]
            inject_bad_request(engine, rng, live, failures)
            counts["bad_requests"] += 1
        if rng.random() < 0.01:
            engine.abort("no-such-request")
        for out in engine.step():
            if out.request_id in finals:
                failures.append(f"{out.request_id}: output after its final one")
            elif out.finished:
                finals[out.request_id] = out
        timeline.append((len(engine.scheduler.running), len(engine.scheduler.waiting),
                         engine.blocks.num_free_pages))
        step += 1
        if step > max_steps:
            failures.append(f"the engine did not drain in {max_steps} steps")
            break
    return finals, aborted_live


def soak_run(run: str, jobs: list[Job], model, soak: SoakConfig, seed: int) -> tuple:
    """One engine over ``jobs``; returns (figures, failures, timeline)."""
    cfg, params, tok = model
    failures: list[str] = []
    timeline: list = []
    engine = Engine(cfg, params, tok, engine_config(soak, run, (cfg, params)))
    engine.warmup()
    compiled = compilations(engine)
    t0 = time.perf_counter()
    counts = {"bad_requests": 0, "aborts_ignored": 0, "aborts_twice": 0}
    finals, aborted = serve(engine, jobs, np.random.default_rng(seed), soak, failures,
                            timeline, counts)
    wall = time.perf_counter() - t0
    if compilations(engine) != compiled:
        failures.append(f"{compilations(engine) - compiled} compilations after warm-up")
    if not engine.blocks.all_free():
        failures.append(f"{engine.blocks.num_pages - 1 - engine.blocks.num_free_pages} pages "
                        "still referenced")
    try:
        engine.blocks.check_invariants()
    except AssertionError as e:
        failures.append(f"block manager invariant: {e}")
    if engine.requests or engine.scheduler.has_work():
        failures.append("requests left in the engine")
    if engine.spec is not None and (engine.policy.rate or engine.policy.steps):
        failures.append("speculation policy state left behind")

    # Every request's final output, and its checks; then its lone runs.
    lone_engine = Engine(cfg, params, tok, dataclasses.replace(
        engine_config(soak, "plain", None), enable_prefix_caching=False))
    lone_compiled = compilations(lone_engine)
    wanted, keys, compared = [], {}, []
    for job in jobs:
        out = finals.get(job.request_id)
        if out is None:
            failures.append(f"{job.request_id}: no final output")
            continue
        ab = job.request_id in aborted
        if ab and not any(c.finish_reason == "abort" for c in out.outputs):
            failures.append(f"{job.request_id}: aborted but reports "
                            f"{[c.finish_reason for c in out.outputs]}")
        if len(out.outputs) != job.params.n:
            failures.append(f"{job.request_id}: {len(out.outputs)} completions, n="
                            f"{job.params.n}")
        for i, c in enumerate(out.outputs):
            where = f"{run}/{job.request_id}[{i}]"
            failures += check_completion(engine, where, c, job.params,
                                         len(out.prompt_token_ids), ab)
            if run != "plain" and not job.params.greedy:
                continue  # speculation keeps sampled outputs' distribution, not their bits
            p = child_params(engine, job, i)
            key = (tuple(out.prompt_token_ids), repr(p))
            if key not in keys:
                keys[key] = len(wanted)
                wanted.append((out.prompt_token_ids, p))
            compared.append((where, c, keys[key], c.finish_reason == "abort"))
    t1 = time.perf_counter()
    lone = run_alone(lone_engine, wanted)
    lone_wall = time.perf_counter() - t1
    mismatches = 0
    for where, c, k, prefix_only in compared:
        why = _same(c, lone[k], prefix_only)
        if why is not None:
            mismatches += 1
            failures.append(f"{where}: differs from its lone run: {why}")
    completions = [c for o in finals.values() for c in o.outputs]
    figures = {
        "requests": len(jobs), "completions": len(completions),
        "aborted_requests": len(aborted),
        "aborted_completions": sum(c.finish_reason == "abort" for c in completions),
        **counts,
        "finish_stop": sum(c.finish_reason == "stop" for c in completions),
        "finish_length": sum(c.finish_reason == "length" for c in completions),
        "stop_strings_hit": sum(isinstance(c.stop_reason, str) for c in completions),
        "generated_tokens": engine.stats["generated_tokens"], "steps": engine.stats["steps"],
        "preemptions": engine.stats["preemptions"],
        "prefix_hit_pages": engine.blocks.stats.prefix_hits,
        "cow_copies": engine.blocks.stats.cow_copies,
        "compared_with_lone_run": len(compared), "lone_runs": len(wanted),
        "mismatches": mismatches, "failures": len(failures),
        "lone_engine_compilations": compilations(lone_engine) - lone_compiled,
        "wall_s": round(wall, 2), "lone_wall_s": round(lone_wall, 2)}
    if engine.spec is not None:
        figures["spec_acceptance_rate"] = engine.spec_metrics()["acceptance_rate"]
    return figures, failures, timeline


def run_soak(soak: SoakConfig, log=None) -> SoakReport:
    """Runs every run of ``soak`` (requests split evenly) and collects figures and failures."""
    model = soak_model(soak.seed)
    figures, failures, timeline = {}, [], {}
    t0 = time.perf_counter()
    share = -(-soak.requests // len(soak.runs))
    workloads = [make_jobs(soak, min(share, soak.requests - r * share), model[0].vocab_size,
                           soak.seed * 1000 + r) for r in range(len(soak.runs))]
    aim_stop_strings([j for jobs in workloads for j in jobs], model, soak.seed)  # one batch
    for r, (run, jobs) in enumerate(zip(soak.runs, workloads)):
        figs, fails, steps = soak_run(run, jobs, model, soak, seed=soak.seed * 1000 + r)
        figures[run] = figs
        failures += [f"{run}: {f}" for f in fails]
        timeline[run] = steps
        if log is not None:
            log(f"soak {run}: {figs}")
    total = {k: sum(f[k] for f in figures.values()) for k in next(iter(figures.values()))
             if k != "spec_acceptance_rate"}
    total["wall_s"] = round(time.perf_counter() - t0, 2)
    figures["total"] = total
    return SoakReport(figures=figures, failures=failures, timeline=timeline)
