"""Async scheduling: step n + 1 is launched before step n's tokens reach the host (each decode
row takes its slot's last token on the device), and step n's outputs are processed while step
n + 1 runs. The oracle is the synchronous engine in the batch-invariant mode, where a request's
tokens and logprobs never depend on what shares its steps: both must agree bit for bit under
stop ids, min_tokens, penalties, seeded sampling, n > 1, logprobs, preemption and aborts."""

import numpy as np
import pytest

from llmserve.config import preset
from llmserve.engine import Engine, EngineConfig
from llmserve.model import init_params
from llmserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny-9-3")
    return cfg, init_params(cfg, seed=5)


def make(cfg, params, async_scheduling, **kw):
    base = dict(max_model_len=96, max_num_seqs=8, page_size=4, max_num_batched_tokens=32,
                prefill_buckets=((1, 8), (4, 16)), decode_buckets=(2, 4, 8), max_logprobs=2,
                batch_invariant=True, async_scheduling=async_scheduling)
    base.update(kw)
    eng = Engine(cfg, params, None, EngineConfig(**base))
    eng.warmup()
    assert eng.async_scheduling == async_scheduling
    return eng


def run(eng, requests, abort_at=None):
    """Runs every request to the end; ``abort_at`` = (step, request id) aborts one mid-run."""
    for rid, prompt, sp in requests:
        eng.add_request(rid, prompt, sp)
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        if abort_at is not None and steps == abort_at[0]:
            eng.abort(abort_at[1])
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
    return outs


def workload(cfg, stop_from=None, n=20, seed=0):
    """Mixed requests; ``stop_from`` (a first run's outputs) turns some outputs' tokens into
    stop ids, so those requests stop early."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        prompt = rng.integers(1, cfg.vocab_size, int(rng.integers(2, 30))).tolist()
        kw = dict(max_tokens=int(rng.integers(1, 24)), ignore_eos=True)
        if i % 4 == 1:
            kw.update(temperature=0.8, top_p=0.9, seed=100 + i, presence_penalty=0.5,
                      repetition_penalty=1.2)
        if i % 5 == 2:
            kw.update(temperature=1.0, seed=7 + i, n=2, logprobs=2)
        if i % 3 == 0:
            kw.update(logprobs=1)
        if stop_from is not None and i % 2 == 0:
            ids = stop_from[str(i)].outputs[0].token_ids
            if len(ids) > 3:
                kw.update(stop_token_ids=[ids[len(ids) // 2]], min_tokens=int(i % 3 == 0))
        reqs.append((str(i), prompt, SamplingParams(**kw)))
    return reqs


def same(a, b):
    assert sorted(a) == sorted(b)
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert x.token_ids == y.token_ids, rid
            assert x.logprobs == y.logprobs, rid
            assert x.finish_reason == y.finish_reason and x.stop_reason == y.stop_reason, rid
            assert x.cumulative_logprob == y.cumulative_logprob, rid


def test_async_equals_sync_bit_for_bit_and_overlaps(tiny, monkeypatch):
    cfg, params = tiny
    sync = make(cfg, params, False)
    first = run(sync, workload(cfg))
    reqs = workload(cfg, stop_from=first)
    want = run(sync, [(r, p, sp) for r, p, sp in reqs])
    stops = [o for o in want.values() if o.outputs[0].finish_reason == "stop"]
    assert len(stops) >= 3  # the stop ids end requests early (the lagged finish is exercised)

    eng = make(cfg, params, True)
    compiles = eng.runner.num_compilations()
    events = []
    import llmserve.engine as engine_mod

    real_run, real_fetch = eng.runner.run, engine_mod.fetch
    monkeypatch.setattr(eng.runner, "run", lambda *a: events.append("run") or real_run(*a))
    monkeypatch.setattr(engine_mod, "fetch", lambda t: events.append("fetch") or real_fetch(t))
    got = run(eng, reqs)
    same(want, got)
    assert eng.runner.num_compilations() == compiles  # nothing compiled after warm-up
    assert eng.stats["fed_rows"] > 50  # decode rows took their token on the device
    # Each step after the first was launched before the previous step's tokens were fetched.
    assert events[:2] == ["run", "run"] and events.count("run") == events.count("fetch")
    assert sum(events[i:i + 2] == ["run", "fetch"] for i in range(len(events))) >= 20
    assert eng.blocks.num_free_pages == sync.blocks.num_free_pages  # every page came back


def test_async_under_preemption_and_abort(tiny):
    cfg, params = tiny
    reqs = workload(cfg, n=16, seed=1)
    # 40 pages of 4 tokens for 8 slots of up to 96 tokens: sequences get preempted.
    sync = make(cfg, params, False, num_pages=40)
    eng = make(cfg, params, True, num_pages=40)
    want = run(sync, reqs)
    got = run(eng, reqs)
    assert eng.stats["preemptions"] > 0
    same(want, got)
    # An abort mid-run: the others are untouched, nothing is lost or leaked.
    free = eng.blocks.num_free_pages
    got = run(eng, reqs, abort_at=(6, "3"))
    assert got["3"].outputs[0].finish_reason == "abort"
    del got["3"], want["3"]
    same(want, got)
    assert eng.blocks.num_free_pages == free and not eng.scheduler.running


def test_speculation_runs_plain_steps_ahead_and_verifies_synchronously(tiny, monkeypatch):
    """An n-gram engine launches its plain decode steps ahead like a plain engine, and takes
    the step in flight before it verifies (the drafts are looked up in every token on the
    host): greedy output equals the synchronous plain engine's, no verify row is fed on the
    device, and plain steps overlap. The policy is forced to alternate (verify, then 3 plain
    steps) so both kinds of step meet; an EAGLE engine steps synchronously."""
    cfg, params = tiny
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(8):
        motif = rng.integers(1, cfg.vocab_size, int(rng.integers(2, 5))).tolist()
        reqs.append((str(i), (motif * 10)[:int(rng.integers(6, 30))],
                     SamplingParams(temperature=0, max_tokens=int(rng.integers(8, 40)),
                                    ignore_eos=True)))
    want = run(make(cfg, params, False, batch_invariant=False), reqs)
    eng = make(cfg, params, True, batch_invariant=False, verify_buckets=(8,), speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    turns = iter([True, False, False, False] * 1000)
    monkeypatch.setattr(eng.policy, "speculate",  # (True once the drafts are known)
                        lambda ids, td, tv, num_draft=None, room=None:
                        num_draft is not None or next(turns))
    compiles = eng.runner.num_compilations()
    kinds = []
    real_prepare = eng.runner.prepare

    def prepare(decode, prefill, verify=False, **kw):
        assert not (verify and any(r.feed for r in decode))  # verify rows: tokens on the host
        kinds.append("verify" if verify else "fed" if any(r.feed for r in decode) else "sync")
        return real_prepare(decode, prefill, verify=verify, **kw)

    monkeypatch.setattr(eng.runner, "prepare", prepare)
    got = run(eng, reqs)
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    assert eng.stats["spec_verify_rows"] > 0 and eng.stats["spec_accepted"] > 0
    assert kinds.count("verify") >= 5 and kinds.count("fed") >= 5
    assert eng.runner.num_compilations() == compiles
    assert eng.blocks.all_free()
    with pytest.raises(TypeError, match="async_scheduling"):
        EngineConfig(async_scheduling=1).validate()


def test_device_ngram_lookup_equals_the_host_proposer():
    """``ngram_device.lookup`` (inside the step) proposes exactly what the host's
    ``NgramProposer.lookup`` does: the same drafts and counts on random short-vocabulary rows
    (many repeats, ties between equally long matches, rows too short to match)."""
    import jax.numpy as jnp

    from llmserve.speculative.ngram import NgramProposer
    from llmserve.speculative.ngram_device import lookup

    rng = np.random.default_rng(0)
    m = 48
    for n_max, n_min, r in [(3, 1, 4), (4, 2, 3), (1, 1, 2), (5, 3, 4)]:
        rows = [rng.integers(0, int(rng.integers(2, 7)), int(rng.integers(1, m + 1)))
                for _ in range(120)]
        hist = np.zeros((len(rows), m), np.int32)
        for i, row in enumerate(rows):
            hist[i, :len(row)] = row
        drafts, count = lookup(jnp.asarray(hist), jnp.asarray([len(x) for x in rows]),
                               n_max, n_min, r)
        host = NgramProposer(n_max, n_min, r)
        found = 0
        for i, row in enumerate(rows):
            want, n = host.lookup(row.tolist())
            assert int(count[i]) == n and np.array_equal(np.asarray(drafts[i]), want), i
            found += n > 0
        assert 30 < found < len(rows)  # both outcomes are exercised


def test_device_lookup_verify_steps_run_ahead(tiny, monkeypatch):
    """``prompt_lookup_on_device``: n-gram drafts are looked up inside the step, and a verify
    step is launched while the step before it (which may accept any number of drafts) still
    runs, its rows placed on the device. Greedy output equals the synchronous plain engine's
    under preemption (40 pages), an abort, min_tokens, stop ids and logprobs, with the policy
    choosing verify or plain at random; nothing compiles after warm-up and every page comes
    back; seeded sampled requests finish too."""
    import random

    cfg, params = tiny
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(14):
        motif = rng.integers(1, cfg.vocab_size, int(rng.integers(2, 6))).tolist()
        kw = dict(temperature=0, max_tokens=int(rng.integers(1, 50)), ignore_eos=True)
        if i % 3 == 0:
            kw["min_tokens"] = min(kw["max_tokens"], 6)
        if i % 4 == 1:
            kw["logprobs"] = 2
        if i % 5 == 2:
            kw["stop_token_ids"] = [motif[0]]
        reqs.append((str(i), (motif * 12)[:int(rng.integers(4, 40))], SamplingParams(**kw)))
    want = run(make(cfg, params, False, batch_invariant=False, num_pages=40), reqs)
    eng = make(cfg, params, True, batch_invariant=False, num_pages=40, verify_buckets=(8,),
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_on_device": True})
    assert eng.speculation.device_lookup
    coin = random.Random(0)
    monkeypatch.setattr(eng.policy, "speculate",
                        lambda ids, td, tv, num_draft=None, room=None: coin.random() < 0.6)
    kinds = []
    real_prepare = eng.runner.prepare

    def prepare(decode, prefill, verify=False, **kw):
        kinds.append(("verify" if verify else "plain")
                     + ("-fed" if any(r.feed for r in decode) else ""))
        return real_prepare(decode, prefill, verify=verify, **kw)

    monkeypatch.setattr(eng.runner, "prepare", prepare)
    compiles = eng.runner.num_compilations()
    got = run(eng, reqs, abort_at=(9, "5"))
    assert got["5"].outputs[0].finish_reason == "abort"
    for rid in want:
        if rid != "5":
            a, b = want[rid].outputs[0], got[rid].outputs[0]
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, rid
            if a.logprobs:
                assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs], rid
    assert kinds.count("verify-fed") >= 8 and kinds.count("plain-fed") >= 2
    assert eng.stats["spec_accepted"] > 50 and eng.stats["preemptions"] > 0
    assert eng.runner.num_compilations() == compiles
    assert eng.blocks.all_free()
    sampled = [(rid, p, SamplingParams(temperature=0.9, top_p=0.9, seed=int(rid),
                                       presence_penalty=0.3, max_tokens=sp.max_tokens,
                                       ignore_eos=True)) for rid, p, sp in reqs]
    out = run(eng, sampled)
    assert all(len(out[rid].outputs[0].token_ids) == sp.max_tokens for rid, _, sp in sampled)
    assert eng.blocks.all_free() and eng.runner.num_compilations() == compiles
