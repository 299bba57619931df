"""Speculative decoding inside the engine: greedy output identical to plain decoding."""


import jax
import numpy as np
import pytest

from llmserve.config import preset
from llmserve.engine import Engine, EngineConfig
from llmserve.model import init_params
from llmserve.ops.attention import default_backend as eng_backend
from llmserve.sampling_params import SamplingParams

from .test_engine import make_engine as _make_engine
from .test_engine import run_all


def make_engine(cfg, params, **kw):
    """One decode bucket, one verify bucket and one block-packed prefill bucket (up to 4
    chunks, 32 tokens): verify and draft shapes compile once per K, and the compiled set stays
    small (5 step shapes; the default verify buckets 1, 2, 4, 8 made it 8). Verify rows carry
    all K drafts (``max_verify_tokens=0``) unless a test caps them."""
    kw.setdefault("prefill_buckets", ((4, 8),))
    kw.setdefault("verify_buckets", (8,))
    spec = kw.get("speculative_config")
    if isinstance(spec, dict):
        kw["speculative_config"] = {"max_verify_tokens": 0, **spec}
    return _make_engine(cfg, params, decode_buckets=(8,), **kw)


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny-9-3")
    return cfg, init_params(cfg, seed=5)


def repetitive_workload(cfg, n, seed=0):
    """Prompts with repeated n-grams so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        motif = rng.integers(1, cfg.vocab_size, rng.integers(2, 6)).tolist()
        prompts.append((motif * 8)[: rng.integers(6, 30)])
    lens = rng.integers(1, 24, n).tolist()
    return prompts, lens


def test_verify_buckets_choose_the_verify_step_shapes(tiny):
    """``EngineConfig.verify_buckets`` sets the verify shapes compiled at warm-up, and a verify
    step pads its rows to the smallest of them (default: 1, 2, 4 and the decode buckets)."""
    cfg, params = tiny

    def verify_shapes(**kw):
        eng = Engine(cfg, params, None, EngineConfig(
            max_model_len=96, max_num_seqs=8, page_size=4, max_num_batched_tokens=32,
            prefill_buckets=((4, 8),), decode_buckets=(8,),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw))
        return ([s for s in eng.runner.step_shapes() if s[2] > 1],
                eng.runner.batches.decode_bucket(1, verify=True))

    # The "cpu" backend caps a verify step at 16 tokens: 8 rows carry 1 draft each.
    width8 = 2 if eng_backend() == "cpu" else 3
    assert verify_shapes() == ([(1, None, 3), (2, None, 3), (4, None, 3), (8, None, width8),
                                (8, (4, 8), width8)], 1)
    assert verify_shapes(verify_buckets=(2, 8)) == ([(2, None, 3), (8, None, width8),
                                                     (8, (4, 8), width8)], 2)


# The extremes of K per method (ngram 3 and draft 2 added 70 s of CI and no other path).
@pytest.mark.parametrize("method,k", [("ngram", 1), ("draft", 6)])
def test_greedy_identical_with_speculation(tiny, method, k):
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 16, seed=k)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if method == "draft":
        spec["model"] = (cfg, params)  # draft == target: every draft is accepted
    eng = make_engine(cfg, params, speculative_config=spec)
    compiles = eng.runner.num_compilations()
    got = run_all(eng, prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert eng.runner.num_compilations() == compiles  # no recompilation with speculation
    assert eng.stats["spec_proposed"] > 0
    m = eng.spec_metrics()
    if method == "draft":
        assert eng.stats["spec_accepted"] == eng.stats["spec_proposed"]
        assert m["acceptance_rate"] == 1.0 and m["acceptance_per_position"][0] == 1.0
    assert 0 <= m["acceptance_rate"] <= 1 and m["verify_time_s"] > 0
    assert len(m["acceptance_per_position"]) == k
    assert eng.blocks.all_free()


def test_rejected_drafts_leak_no_pages_and_stop_inside_run(tiny):
    cfg, params = tiny
    other = init_params(cfg, seed=99)  # an unrelated draft: nearly everything is rejected
    eng = make_engine(cfg, params, num_pages=40, speculative_config={
        "method": "draft", "model": (cfg, other), "num_speculative_tokens": 4,
        "adaptive": False})
    prompts = [list(range(1, 4 * k + 1)) for k in range(1, 6)]  # prompts end on page boundaries
    sps = [SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)] * len(prompts)
    got = run_all(eng, prompts, sps)
    assert eng.stats["spec_accepted"] < eng.stats["spec_proposed"]
    assert eng.blocks.all_free()
    plain = run_all(make_engine(cfg, params), prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    # A stop token inside an accepted run ends the request exactly there.
    full = plain[2].outputs[0].token_ids
    stop = full[5]
    first = full.index(stop)
    # The same page count as ``eng``: its step programs come from the compilation cache.
    eng2 = make_engine(cfg, params, num_pages=40, speculative_config={
        "method": "draft", "model": (cfg, params), "num_speculative_tokens": 4,
        "adaptive": False})
    out = run_all(eng2, [prompts[2]], [SamplingParams(temperature=0, max_tokens=17,
                                                      stop_token_ids=[stop])])[0]
    assert out.outputs[0].token_ids == full[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert eng2.blocks.all_free()


def test_sampled_speculation_runs_and_metrics(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params, speculative_config={
        "method": "draft", "model": (cfg, params), "num_speculative_tokens": 3,
        "adaptive": False})
    out = run_all(eng, [[1, 2, 3, 1, 2, 3]], [SamplingParams(temperature=0.8, seed=1,
                                                             max_tokens=12, ignore_eos=True)])[0]
    assert len(out.outputs[0].token_ids) == 12
    assert out.metrics.spec_proposed > 0 and out.metrics.spec_accepted > 0
    # Draft == target: q == p, so min(1, p/q) accepts every draft (up to rounding).
    prompts, _ = repetitive_workload(cfg, 6, seed=5)
    sps = [SamplingParams(temperature=t, seed=i, max_tokens=16, ignore_eos=True, **kw)
           for i, (t, kw) in enumerate([(0.8, {}), (1.0, {}), (1.2, dict(top_k=20)),
                                        (1.0, dict(top_p=0.8)), (0.7, dict(min_p=0.05)),
                                        (1.0, dict(n=2))])]
    eng.stats.update(spec_proposed=0, spec_accepted=0)
    outs = run_all(eng, prompts, sps)
    assert all(len(c.token_ids) == 16 for o in outs for c in o.outputs)
    assert eng.stats["spec_proposed"] > 60
    assert eng.stats["spec_accepted"] >= 0.99 * eng.stats["spec_proposed"]


def test_bad_speculative_config(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match="method"):
        Engine(cfg, params, None, EngineConfig(max_model_len=64, max_num_seqs=2, page_size=4,
                                               speculative_config={"method": "magic"}))
    for cap in (1, -3, "16", True, 2.5):
        with pytest.raises(ValueError, match="max_verify_tokens"):
            Engine(cfg, params, None, EngineConfig(
                max_model_len=64, max_num_seqs=2, page_size=4,
                speculative_config={"method": "ngram", "max_verify_tokens": cap}))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_capped_verify_buckets_carry_fewer_drafts_and_greedy_output_is_identical(tiny, method):
    """``max_verify_tokens=8`` with D = 4: a verify step of 4 rows carries 1 draft a row, of 2
    rows 3, of 1 row 4 (n-gram lookups are cut to the room; a draft model's D device drafts
    enter the step cut to its width). The steps keep their compiled shapes, and the tokens
    equal plain decoding's."""
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 10, seed=7)
    sps = [SamplingParams(temperature=0, max_tokens=n + 4, ignore_eos=True) for n in lens]
    kw = dict(max_num_seqs=4, decode_buckets=(4,), verify_buckets=(1, 2, 4),
              prefill_buckets=((4, 8),))
    want = run_all(_make_engine(cfg, params, **kw), prompts, sps)
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False,
            "max_verify_tokens": 8}
    if method == "draft":
        spec["model"] = (cfg, params)  # draft == target: every draft it makes is accepted
    eng = _make_engine(cfg, params, speculative_config=spec, **kw)
    assert sorted(s for s in eng.runner.step_shapes() if s[2] > 1 and s[1] is None) == [
        (1, None, 5), (2, None, 4), (4, None, 2)]
    widths = []  # (verify bucket, tokens per row) of every verify step
    prepare = eng.runner.prepare

    def spy(decode, prefill=(), verify=False, head_drafts=True):
        batch = prepare(decode, prefill, verify, head_drafts)
        if batch.verify:
            widths.append((batch.parts[0].block_tables.shape[0], batch.parts[0].t))
        return batch

    eng.runner.prepare = spy
    compiles = eng.runner.num_compilations()
    got = run_all(eng, prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert eng.runner.num_compilations() == compiles
    assert all(w == {1: 5, 2: 4, 4: 2}[b] for b, w in widths)
    assert {2, 4} <= {b for b, _ in widths}  # narrowed buckets ran, each at its own width
    assert eng.stats["spec_accepted"] > 0
    if method == "draft":
        assert eng.stats["spec_accepted"] == eng.stats["spec_proposed"]


def test_never_slower_policy():
    from llmserve.speculative import SpeculationPolicy

    pol = SpeculationPolicy(4, prior=0.6, prior_after=0.6)
    pol.time("decode", 8, 0.010)
    pol.time("verify", 8, 0.015)  # 1.5x a decode step: 2.3 expected tokens wins
    assert pol.speculate([1, 2], 8, 8)
    pol.time("verify", 8, 1.0)  # verify became very slow: EMA moves above the break-even
    pol.time("verify", 8, 1.0)
    assert not pol.speculate([1, 2], 8, 8)
    for _ in range(10):  # request 1 rejects everything: it stops proposing
        pol.record(1, 4, 0)
    assert not pol.proposes(1) and pol.expected_tokens(1) == 1.0
    assert pol.proposes(2)
    # A pause is not final: after probe_every steps the request proposes once more, and a
    # single miss pauses it again, while a hit keeps it proposing.
    for _ in range(pol.probe_every - 1):
        pol.tick([1, 2])
        assert not pol.proposes(1)
    pol.tick([1, 2])
    assert pol.proposes(1)
    pol.record(1, 4, 0)
    assert not pol.proposes(1)
    for _ in range(pol.probe_every):
        pol.tick([1])
    pol.record(1, 4, 4)
    assert pol.proposes(1)


def test_policy_learns_correlated_acceptance_engine_wide():
    """Per-position acceptance given the earlier drafts: a row that copies keeps copying, so
    after such rows a new request expects more than one per-token rate would predict, and a
    verify step that emitted ~2.5 tokens per row at 1.9x a decode step is chosen."""
    from llmserve.speculative import SpeculationPolicy

    pol = SpeculationPolicy(4)
    pol.time("decode", 16, 0.055)
    pol.time("verify", 16, 0.105)  # 1.9x: the measured SmolLM2 bf16 ratio at batch 16
    fresh = pol.expected_tokens(99)
    for step in range(12):  # rows that accept all 4 drafts half the time, else none
        for seq in range(16):
            pol.record(seq, 4, 4 if (seq + step) % 2 else 0)
    # p_0 ~ 0.5 (0.57: its last outcome was a hit, and recent outcomes weigh more), later
    # positions ~ 1: about 1 + .5 + .5 + .5 + .5 = 3 tokens; a per-token rate of 0.5 with
    # independent positions would say 1.94.
    assert 2.6 < pol.expected_tokens(0) <= 3.2
    assert pol.expected_tokens(100) > fresh  # a new request starts from what the engine learned
    assert pol.speculate(list(range(100, 116)), 16, 16)
    for seq in range(16):
        pol.forget(seq)
    assert not pol.rate and not pol.steps


def test_speculation_with_preemption_and_prefix_cache(tiny):
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 10, seed=9)
    system = list(range(40, 52))  # a shared 3-page prefix
    prompts = [system + p for p in prompts]
    sps = [SamplingParams(temperature=0, max_tokens=n + 8, ignore_eos=True) for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    eng = make_engine(cfg, params, num_pages=32, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    got = run_all(eng, prompts, sps)
    assert eng.stats["preemptions"] > 0 and eng.blocks.stats.prefix_hits > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert eng.blocks.all_free()


def run_counting_steps(eng, prompts, sps):
    """run_all, recording for every call of the jitted step whether it verified."""
    programs = eng.runner.programs
    calls, real = [], programs.step

    def counted(*args, **kw):
        treedef = kw["layout"][0]  # the packed StepInput's structure (runner.pack_inputs)
        calls.append(jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves).verify)
        return real(*args, **kw)

    programs.step = counted
    try:
        return run_all(eng, prompts, sps), calls
    finally:
        programs.step = real


def test_verify_rows_share_one_step_with_prefill(tiny):
    """Verify rows [Bv, 1 + D] and prompt chunks run in ONE jitted call per engine step (the
    drafts enter inside it); greedy output equals plain decoding and nothing recompiles."""
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 12, seed=3)
    sps = [SamplingParams(temperature=0, max_tokens=n + 6, ignore_eos=True) for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    eng = make_engine(cfg, params, speculative_config={
        "method": "draft", "model": (cfg, params), "num_speculative_tokens": 3,
        "adaptive": False})
    compiles = eng.runner.num_compilations() + eng.proposer.num_compilations()
    got, calls = run_counting_steps(eng, prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(calls) == eng.stats["steps"]  # one target call per engine step
    assert eng.stats.get("mixed_steps", 0) > 0 and any(calls)  # verify beside prefill ran
    assert eng.runner.num_compilations() + eng.proposer.num_compilations() == compiles


def test_draft_cache_caught_up_after_plain_decode_steps(tiny):
    """Plain decode steps (the adaptive policy's choice) leave the draft cache behind; it is
    caught up before the next proposal, so a draft equal to the target is always accepted."""
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 6, seed=4)
    sps = [SamplingParams(temperature=0, max_tokens=n + 30, ignore_eos=True) for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    eng = make_engine(cfg, params, speculative_config={
        "method": "draft", "model": (cfg, params), "num_speculative_tokens": 3})
    turns = iter([True, False, False, False] * 1000)  # verify, then 3 plain steps (> TAIL)
    eng.policy.speculate = lambda *a, **kw: next(turns)
    got = run_all(eng, prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert eng.stats["spec_proposed"] > 0 and eng.stats.get("spec_decode_time_s", 0) > 0
    assert eng.stats["spec_accepted"] == eng.stats["spec_proposed"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_top_logprobs_under_speculation_equal_plain(tiny, method):
    """``logprobs=N`` under speculation returns the same top-N as plain decoding at every
    position (ids equal, values within 1e-5: the rows are computed in other batch shapes)."""
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 6, seed=6)
    sps = [SamplingParams(temperature=0, max_tokens=n + 4, ignore_eos=True, logprobs=2)
           for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft":
        spec["model"] = (cfg, params)
    eng = make_engine(cfg, params, speculative_config=spec)
    got = run_all(eng, prompts, sps)
    assert eng.stats["spec_accepted"] > 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs)
        for pg, pw in zip(g.logprobs, w.logprobs):
            assert len(pg) >= 2 and set(pg) == set(pw)
            for tok in pw:
                assert pg[tok] == pw[tok]  # bitwise: every row alone, whatever the step's shape


def _random_head(cfg, vd=None, seed=0):
    from llmserve.speculative import eagle

    ecfg = eagle.EagleConfig.from_target(cfg, vd or cfg.vocab_size)
    vocab_map = np.sort(np.random.default_rng(seed).choice(cfg.vocab_size, ecfg.draft_vocab_size,
                                                           replace=False)).astype(np.int32)
    return ecfg, eagle.init_head_params(ecfg, seed=seed), vocab_map


@pytest.mark.parametrize("adaptive", [False, True])
def test_eagle_head_in_the_step_greedy_identical(tiny, adaptive):
    """An EAGLE head runs inside the one jitted step (one call per engine step, nothing
    recompiles): greedy output equals plain decoding, with prefill beside verify rows."""
    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 10, seed=11)
    sps = [SamplingParams(temperature=0, max_tokens=n + 6, ignore_eos=True) for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    eng = make_engine(cfg, params, speculative_config={
        "method": "eagle", "model": _random_head(cfg, vd=cfg.vocab_size // 2),
        "num_speculative_tokens": 3, "adaptive": adaptive})
    assert eng.config.async_scheduling and not eng.async_scheduling  # the head needs each step
    compiles = eng.runner.num_compilations()
    got, calls = run_counting_steps(eng, prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(calls) == eng.stats["steps"]
    assert eng.runner.num_compilations() == compiles
    if not adaptive:
        assert eng.stats["spec_proposed"] > 0 and any(calls)
    assert eng.blocks.all_free()


def test_eagle_head_drafts_follow_the_head():
    """The drafts the step leaves for a slot are the head's own chain: a head whose draft
    vocabulary is one token always proposes that token."""
    cfg = preset("tiny-9-3")
    params = init_params(cfg, seed=5)
    ecfg, head, _ = _random_head(cfg, vd=1)
    tok = 7
    eng = make_engine(cfg, params, speculative_config={
        "method": "eagle", "model": (ecfg, head, np.asarray([tok], np.int32)),
        "num_speculative_tokens": 2, "adaptive": False})
    eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    drafts = np.asarray(eng.runner.eagle.drafts)  # [slots + 1, D]
    assert (drafts == tok).all(axis=1).any()  # the request's slot holds the head's chain
    assert set(np.unique(drafts)) <= {0, tok}  # unused slots were never written
    assert eng.stats["spec_proposed"] > 0


def test_eagle_drafts_in_the_engine_equal_the_training_forward(tiny):
    """After every step, a slot's drafts are the head's chain from the sequence's newest
    token, as the training-time (dense, whole-sequence) forward computes it from the target's
    features: the head's cache and the carried features follow the sequence exactly, through
    prompt chunks, plain decode steps and verify steps."""
    import jax.numpy as jnp

    from llmserve.kv_cache import AttentionMetadata, DenseKVCache
    from llmserve.model import Transformer
    from llmserve.speculative import eagle

    cfg, params = tiny
    ecfg, head, vocab_map = _random_head(cfg, vd=cfg.vocab_size // 4, seed=3)
    eng = make_engine(cfg, params, max_num_batched_tokens=8, speculative_config={
        "method": "eagle", "model": (ecfg, head, vocab_map), "num_speculative_tokens": 2,
        "adaptive": False})
    turns = iter([True, False] * 1000)  # verify steps and plain decode steps alternate
    policy = eng.speculation.lookahead
    eng.speculation.lookahead = lambda ahead=False: policy(ahead) if ahead or next(turns) else 0
    prompt = (np.arange(3, 22) * 7 % cfg.vocab_size).tolist()  # 19 tokens: 3 chunks of <= 8
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seen = []  # (tokens so far, the slot's draft 0) after each step that emitted
    while eng.has_unfinished_requests():
        eng.step()
        seq = next(iter(eng.requests.values())).seqs[0] if eng.requests else None
        if seq is not None and seq.output_ids:
            seen.append((list(seq.all_ids), np.asarray(eng.runner.eagle.drafts)[seq.slot]))
    tokens = seen[-1][0]
    t = len(tokens)
    meta = AttentionMetadata.for_dense(jnp.arange(t, dtype=jnp.int32)[None],
                                       jnp.full((1,), t, jnp.int32))
    _, _, hidden = Transformer(cfg).apply({"params": params}, jnp.asarray([tokens]), meta,
                                          DenseKVCache.create(cfg, 1, t), backend="reference",
                                          return_hidden="all")
    feats = jnp.concatenate([jnp.zeros((1, 1, cfg.d_model)), hidden[:, :-1]], axis=1)
    _, logits = eagle.eagle_forward_dense(head, params["embed"], params["final_norm"],
                                          vocab_map, feats, jnp.asarray([tokens]), ecfg=ecfg)
    want = vocab_map[np.asarray(jnp.argmax(logits[0], -1))]  # draft after x_q, at q
    matches = [d[0] == want[len(ids) - 1] for ids, d in seen]
    assert len(matches) >= 10 and sum(matches) >= 0.9 * len(matches), matches
    assert eng.stats["spec_verify_rows"] >= 3  # verify steps were among them

    # The whole chain: the head's own propose over the true prefix, on a fresh cache.
    from llmserve.sampling import SamplingArrays

    pages = -(-(t + 4) // eng.config.page_size)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    greedy = SamplingArrays.from_lists([dict(temperature=0.0)])
    chains = []
    feats_host = np.asarray(feats)
    for ids, d in seen:  # prefixes built on the host: one shape, no eager op per length
        n = len(ids)
        f = np.zeros((1, t, cfg.d_model), feats_host.dtype)
        f[:, :n] = feats_host[:, :n]
        x = np.zeros((1, t), np.int32)
        x[0, :n] = ids
        out, _ = eagle.eagle_propose(head, params["embed"], params["final_norm"], vocab_map,
                                     eagle.create_cache(ecfg, pages + 1, eng.config.page_size),
                                     f, x, jnp.zeros(1, jnp.int32), jnp.full(1, n, jnp.int32),
                                     table, greedy, ecfg=ecfg, num_draft=2, with_probs=False)
        chains.append(np.array_equal(np.asarray(out.tokens[0]), d))
    assert sum(chains) >= 0.9 * len(chains), chains


def test_dropped_draft_engine_frees_the_draft_programs(tiny):
    """A draft model's jitted programs belong to its engine, like the target's: once the
    engine is dropped and other shapes are built, they are freed."""
    import gc
    import weakref

    from llmserve.programs import KEEP_RECENT

    cfg, params = tiny

    def build(r):
        return Engine(cfg, params, None, EngineConfig(
            max_model_len=96, max_num_seqs=4, page_size=4, max_num_batched_tokens=32,
            prefill_buckets=((1, 8),), decode_buckets=(4,), speculative_config={
                "method": "draft", "model": (cfg, params), "num_speculative_tokens": r}))

    eng = build(2)
    assert build(2).proposer.programs is eng.proposer.programs  # same shape: shared
    ref = weakref.ref(eng.proposer.programs)
    del eng
    for r in range(KEEP_RECENT):
        build(3 + r)
    gc.collect()
    assert ref() is None


def test_policy_calibration_metric_is_its_expectation_at_the_first_verify_step(tiny):
    """spec_metrics' predicted_tokens_per_row: at the first verify step every row still has the
    policy's starting rates (0.4 at the first draft, 0.7 after), so the expectation it records
    is rows + sum_j (rows carrying draft j) * 0.4 * 0.7^j, recomputed here from the step's
    per-position counts; the realized tokens per row are 1 + the mean accepted length."""
    cfg, params = tiny
    prompts, _ = repetitive_workload(cfg, 2, seed=3)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    eng = make_engine(cfg, params, speculative_config=spec, max_num_seqs=2)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True))
    while not eng.stats.get("spec_verify_rows"):
        eng.step()
    rows, at = eng.stats["spec_verify_rows"], eng.stats["spec_proposed_per_pos"]
    want = rows + sum(n * 0.4 * 0.7 ** j for j, n in enumerate(at))
    assert sum(at) > 0
    assert eng.stats["spec_predicted_tokens"] == pytest.approx(want, rel=1e-9)
    m = eng.spec_metrics()
    assert m["predicted_tokens_per_row"] == pytest.approx(want / rows, rel=1e-9)
    while eng.has_unfinished_requests():
        eng.step()


def test_adaptive_ngram_checks_drafts_on_plain_steps(tiny):
    """While the never-slower rule decodes plainly (here: verify made to look 1000x a decode
    step), each plain step still checks every row's first n-gram draft against the token it
    emits and feeds the outcome to the policy, so a low acceptance estimate can recover. The
    counts equal an independent replay: prompt lookup on each output prefix vs the next token."""
    from llmserve.speculative.ngram import NgramProposer

    cfg, params = tiny
    prompts, lens = repetitive_workload(cfg, 2, seed=3)
    sps = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": True}
    eng = make_engine(cfg, params, speculative_config=spec, max_num_seqs=2)
    pol = eng.speculation.policy
    pol.t_verify = {b: 1000 * max(pol.t_decode.values()) for b in pol.t_verify}
    before = list(pol.prior)
    outs = run_all(eng, prompts, sps)
    assert eng.stats.get("spec_verify_rows", 0) == 0  # every step was plain
    lookup, checks, hits = NgramProposer(3, 1, 2), 0, 0
    for prompt, out in zip(prompts, outs):
        ids = list(prompt) + list(out.outputs[0].token_ids)
        for pos in range(len(prompt) + 1, len(ids)):  # tokens of decode steps (not the first)
            draft, n = lookup.lookup(ids[:pos], 1)
            if n:
                checks += 1
                hits += int(draft[0] == ids[pos])
    assert checks > 0
    assert eng.stats["spec_shadow_rows"] == checks and eng.stats["spec_shadow_hits"] == hits
    m = eng.spec_metrics()
    assert m["shadow_checks"] == checks and m["shadow_acceptance"] == hits / checks
    assert pol.prior[0] != before[0] and pol.prior[1:] == before[1:]  # position 0 only


def test_trim_verify_tokens_ends_the_live_tokens_after_the_last_real_rows_drafts(tiny):
    """A verify-only step's live tokens (what the native matmuls and the vocabulary projection
    compute) end after the last real row's drafts, not after its room; a batch with no real
    row (the policy's warm-up timing) keeps its count."""
    import jax.numpy as jnp

    from llmserve.step import trim_verify_tokens

    cfg, params = tiny
    eng = make_engine(cfg, params, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    d, _, w = next(s for s in eng.runner.step_shapes() if s[1] is None and s[2] > 1)
    assert d >= 2 and w == 4
    batch = eng.runner.empty_batch((d, None, w))
    lengths = np.zeros(d, np.int32)
    lengths[:2] = [10, 7]
    num_draft = np.zeros(batch.num_draft.shape, np.int32)
    num_draft[:2] = [3, 1]  # row 0 fills its room, row 1 (the last real one) carries 1 draft
    part = batch.parts[0].replace(lengths=lengths)
    real = batch.replace(parts=(part,) + batch.parts[1:], num_draft=num_draft,
                         live=np.array([d * w, d], np.int32))
    out = trim_verify_tokens(jax.tree_util.tree_map(jnp.asarray, real), d, w)
    assert out.live.tolist() == [w + 1 + 1, d]
    timing = batch.replace(live=np.array([d * w, d], np.int32))  # no real row: unchanged
    assert trim_verify_tokens(jax.tree_util.tree_map(jnp.asarray, timing), d, w).live.tolist() \
        == [d * w, d]


@pytest.mark.parametrize("on_device", [False, True], ids=["host_lookup", "device_lookup"])
def test_short_verify_rows_on_native_kernels_equal_plain(on_device):
    """tiny-gqa in bf16 (blocked native matmuls, the native attention kernel): verify rows
    carrying fewer drafts than their room compute only their real tokens (trimmed live
    tokens, padding tokens' attention skipped), and the tokens and top-2 logprobs equal plain
    decoding's."""
    cfg = preset("tiny-gqa").replace(dtype="bfloat16")
    params = init_params(cfg, seed=3)
    prompts, lens = repetitive_workload(cfg, 6, seed=11)
    sps = [SamplingParams(temperature=0, max_tokens=n + 6, ignore_eos=True, logprobs=2)
           for n in lens]
    want = run_all(make_engine(cfg, params), prompts, sps)
    eng = make_engine(cfg, params, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
        "prompt_lookup_on_device": on_device})
    got = run_all(eng, prompts, sps)
    assert eng.stats["spec_accepted"] > 0
    # Some verify rows carried fewer than 3 drafts: the trimmed case.
    assert eng.stats["spec_proposed"] < 3 * eng.stats["spec_verify_rows"]
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        for pg, pw in zip(g.logprobs, w.logprobs):
            assert set(pg) == set(pw)
            for tok in pw:
                assert pg[tok] == pw[tok]  # bitwise: every row alone, whatever the step's shape


@pytest.mark.parametrize("dtype,batch", [("bfloat16", 4), ("float32", 2)])
def test_speculation_at_batch_2_4_is_bitwise_plain_decoding(dtype, batch):
    """SmolLM2's widths (d_model 576, 9 / 3 heads of 64, ffn 1536; 2 layers, a small vocabulary)
    with ``batch`` sequences at once: every position's top-2 logprobs under speculation are
    bitwise plain decoding's, not just close. Before RMSNorm summed in a fixed order, a verify
    step's 2 x 6 rows rounded apart from the 2-row decode step's (logprobs 0.03-0.1 apart in
    bf16 on SmolLM2 itself), and greedy output split on the input-grounded workload."""
    cfg = preset("smollm2-135m").replace(vocab_size=512, n_layers=2, dtype=dtype)
    params = init_params(cfg, seed=7)
    prompts, lens = repetitive_workload(cfg, 2 * batch, seed=13)
    sps = [SamplingParams(temperature=0, max_tokens=n + 6, ignore_eos=True, logprobs=2)
           for n in lens]
    kw = dict(max_num_seqs=batch, decode_buckets=(batch,), verify_buckets=(batch,),
              prefill_buckets=((4, 8),))
    want = run_all(_make_engine(cfg, params, **kw), prompts, sps)
    eng = _make_engine(cfg, params, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
        "max_verify_tokens": 0}, **kw)
    got = run_all(eng, prompts, sps)
    assert eng.stats["spec_accepted"] > 0 and eng.stats["spec_verify_rows"] > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs  # bitwise, every position
