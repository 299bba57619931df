"""Engine: continuous batching over a paged cache equals the reference generate."""

import numpy as np
import pytest

from llmserve.config import preset
from llmserve.engine import Engine, EngineConfig
from llmserve.model import init_params
from llmserve.reference import generate_reference
from llmserve.sampling_params import SamplingParams, child_seed


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny-9-3")
    return cfg, init_params(cfg, seed=5)


def make_engine(cfg, params, **kw):
    base = dict(max_model_len=96, max_num_seqs=8, page_size=4, max_num_batched_tokens=32,
                prefill_buckets=((1, 8), (4, 16)), decode_buckets=(2, 4, 8), max_logprobs=2)
    base.update(kw)
    eng = Engine(cfg, params, None, EngineConfig(**base))
    eng.warmup()
    return eng


def run_all(eng, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[str(i)] for i in range(len(prompts))]


def random_workload(cfg, n, seed=0, max_prompt=30, max_new=20):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, cfg.vocab_size, rng.integers(1, max_prompt)).tolist()
               for _ in range(n)]
    lens = rng.integers(1, max_new, n).tolist()
    return prompts, lens


def test_greedy_matches_reference_under_continuous_batching(tiny):
    cfg, params = tiny
    prompts, lens = random_workload(cfg, 32)
    eng = make_engine(cfg, params)
    compiles = eng.runner.num_compilations()
    outs = run_all(eng, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                  for n in lens])
    assert eng.runner.num_compilations() == compiles  # nothing compiled after warm-up
    # Decode rows and prefill chunks shared steps: one device call each, weights read once.
    assert eng.stats["mixed_steps"] > 5
    want = generate_reference(params, cfg, prompts, max(lens))  # one padded batch
    for n, w, o in zip(lens, want, outs):
        assert o.outputs[0].token_ids == w[:n]
        assert o.outputs[0].finish_reason == "length"
    assert eng.blocks.all_free()


def test_a_burst_that_fits_the_slots_runs_static_batchings_steps(tiny):
    """Every request at once and all fitting the slots: continuous (prefill first) runs the
    very steps static batching runs, so it is never slower there; the tokens are the
    reference's either way (and mixing decode into the prompt steps is the ablation)."""
    cfg, params = tiny
    prompts, lens = random_workload(cfg, 8, seed=4)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    runs = {}
    for name, kw in [("continuous", {}), ("static", {"scheduling": "static"}),
                     ("mixed", {"prefill_first": False})]:
        eng = make_engine(cfg, params, **kw)
        outs = run_all(eng, prompts, sps)
        runs[name] = ([o.outputs[0].token_ids for o in outs], dict(eng.stats))
    want = generate_reference(params, cfg, prompts, max(lens))
    assert runs["continuous"][0] == [w[:n] for n, w in zip(lens, want)]
    assert runs["continuous"] == runs["static"]
    assert runs["continuous"][1].get("mixed_steps", 0) == 0
    assert runs["mixed"][0] == runs["continuous"][0] and runs["mixed"][1]["mixed_steps"] > 0


def test_block_packed_prefill_matches_reference(tiny):
    """Prefill parts of 4-token blocks: a chunk spans several rows and chunks of different
    lengths pack into one part beside decode rows; greedy tokens equal the reference loop's
    and nothing compiles after warm-up (the Pallas and reference backends: the next test)."""
    cfg, params = tiny
    prompts, lens = random_workload(cfg, 24, seed=3)
    eng = make_engine(cfg, params, prefill_buckets=((2, 4), (4, 4), (8, 4)), max_prefill_seqs=3)
    seen = []
    prepare = eng.runner.batches.prepare

    def spy(decode, prefill=(), *args):
        seen.append([len(r.tokens) for r in prefill])
        return prepare(decode, prefill, *args)

    eng.runner.batches.prepare = spy
    compiles = eng.runner.num_compilations()
    outs = run_all(eng, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                  for n in lens])
    assert eng.runner.num_compilations() == compiles
    assert max(max(x, default=0) for x in seen) > 4  # chunks longer than a block
    assert max(len(x) for x in seen) > 1 and eng.stats["mixed_steps"] > 5
    want = generate_reference(params, cfg, prompts, max(lens))
    for n, w, o in zip(lens, want, outs):
        assert o.outputs[0].token_ids == w[:n]


def test_warmup_compiles_every_step_shape_once(tiny):
    """The compiled shapes are exactly ``step_shapes()``: each decode bucket alone, each
    prefill bucket alone and beside the largest decode bucket; a second engine of the same
    shapes compiles nothing."""
    cfg, params = tiny
    eng = make_engine(cfg, params)
    shapes = eng.runner.step_shapes()
    assert sorted(shapes, key=str) == sorted(
        [(2, None, 1), (4, None, 1), (8, None, 1), (0, (1, 8), 1), (0, (4, 16), 1),
         (8, (1, 8), 1), (8, (4, 16), 1)],
        key=str)
    before = eng.runner.num_compilations()
    make_engine(cfg, params)
    assert eng.runner.num_compilations() == before


def test_preemption_completes_everything_identically(tiny):
    cfg, params = tiny
    prompts, lens = random_workload(cfg, 12, seed=1, max_new=40)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    small = make_engine(cfg, params, num_pages=30)  # 29 usable pages of 4 tokens
    outs = run_all(small, prompts, sps)
    assert small.stats["preemptions"] > 0
    big = make_engine(cfg, params)
    want = run_all(big, prompts, sps)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert small.blocks.all_free()


def test_static_policy_same_outputs(tiny):
    cfg, params = tiny
    prompts, lens = random_workload(cfg, 10, seed=2)
    sps = [SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True) for n in lens]
    static = make_engine(cfg, params, scheduling="static")
    a = run_all(static, prompts, sps)
    assert static.stats["max_decode_rows"] == 8  # the first batch fills all 8 slots
    b = run_all(make_engine(cfg, params), prompts, sps)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_prefix_cache_hits_and_unchanged_outputs(tiny):
    cfg, params = tiny
    system = list(range(10, 30))  # 20 tokens = 5 full pages of 4
    prompts = [system + [40 + i, 50 + i, 60 + i] for i in range(4)]
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 4
    eng = make_engine(cfg, params)
    first = run_all(eng, prompts[:1], sps[:1])
    hits0 = eng.blocks.stats.prefix_hits
    rest = run_all(eng, prompts[1:], sps[1:])
    assert eng.blocks.stats.prefix_hits - hits0 == 5 * 3  # each later prompt reuses 5 pages
    off = make_engine(cfg, params, enable_prefix_caching=False)
    want = run_all(off, prompts, sps)
    got = first + rest
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_n_greater_than_one_shares_pages_copy_on_write(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    prompt = list(range(1, 11))  # 10 tokens: the last page (2 of 4 slots) is shared
    out = run_all(eng, [prompt], [SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                                                 ignore_eos=True)])[0]
    assert len(out.outputs) == 3
    assert eng.blocks.stats.cow_copies == 2  # two of the three writers copy the shared page
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert eng.blocks.all_free()
    # Oracle: each child equals the n = 1 request seeded child_seed(3, i), run alone.
    solo = [run_all(eng, [prompt], [SamplingParams(temperature=1.0, seed=child_seed(3, i),
                                                   max_tokens=8, ignore_eos=True)])[0]
            for i in range(3)]
    for child, alone in zip(out.outputs, solo):
        assert child.token_ids == alone.outputs[0].token_ids
        assert child.cumulative_logprob == pytest.approx(alone.outputs[0].cumulative_logprob,
                                                         abs=1e-4)


def test_seeded_sampling_is_batch_independent(tiny):
    cfg, params = tiny
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    alone = run_all(make_engine(cfg, params), [[5, 6, 7]], [sp])[0].outputs[0].token_ids
    prompts, lens = random_workload(cfg, 7, seed=3)
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=n) for i, n in enumerate(lens)]
    mixed = run_all(make_engine(cfg, params), prompts[:3] + [[5, 6, 7]] + prompts[3:],
                    others[:3] + [sp] + others[3:])
    assert mixed[3].outputs[0].token_ids == alone


@pytest.mark.parametrize("bad,match", [
    (dict(prompt=[]), "empty prompt"),
    (dict(prompt=list(range(1, 100))), "max_model_len"),
    (dict(prompt=[1, 2, 10_000]), "out of range"),
    (dict(params=dict(temperature=-1.0)), "temperature"),
    (dict(params=dict(top_p=0.0)), "top_p"),
    (dict(params=dict(max_tokens=0)), "max_tokens"),
    (dict(params=dict(n=0)), "n="),
])
def test_bad_input_rejected_before_queueing(tiny, bad, match):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    eng.add_request("ok", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    sp = SamplingParams()
    for field, value in bad.get("params", {}).items():
        with pytest.raises(ValueError, match=match):  # the constructor rejects it ...
            SamplingParams(**{field: value})
        setattr(sp, field, value)  # ... and so must add_request, when set afterwards
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", bad.get("prompt", [1, 2]), sp)
    assert "bad" not in eng.requests
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(done[0].outputs[0].token_ids) == 5


def test_abort_frees_pages(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=50))
    eng.add_request("b", [6, 7], SamplingParams(temperature=0, max_tokens=3))
    for _ in range(3):
        eng.step()
    eng.abort("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.blocks.all_free()


def test_cache_is_donated_and_updated_in_place(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    before = eng.runner.cache.k[0]
    ptr = before.unsafe_buffer_pointer()
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    eng.step()
    assert before.is_deleted()  # donated to the step
    assert eng.runner.cache.k[0].unsafe_buffer_pointer() == ptr  # same buffer, written in place


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_paged_engine_matches_reference_with_other_backends(backend):
    """The paged prefill/decode path through the Pallas kernel (interpret) and the reference,
    prompt chunks packed in 8-token blocks (a 24-token prompt spans 3 rows of its part)."""
    cfg = preset("tiny-gqa")  # head_dim 16: Triton tiles need powers of two >= 16
    params = init_params(cfg, seed=6)
    prompts, lens = random_workload(cfg, 5, seed=7, max_prompt=24, max_new=12)
    # Triton needs pages of >= 16 tokens; prompts up to 24 tokens still cross a page boundary.
    eng = make_engine(cfg, params, backend=backend, decode_buckets=(8,), page_size=16,
                      prefill_buckets=((2, 8), (6, 8)))
    outs = run_all(eng, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                  for n in lens])
    want = generate_reference(params, cfg, prompts, max(lens))
    assert [o.outputs[0].token_ids for o in outs] == [w[:n] for w, n in zip(want, lens)]


def test_contiguous_reservation_same_outputs_more_waste(tiny):
    cfg, params = tiny
    prompts, lens = random_workload(cfg, 12, seed=3)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    paged = make_engine(cfg, params, num_pages=60)
    contiguous = make_engine(cfg, params, num_pages=60, kv_reservation="contiguous")
    want = run_all(paged, prompts, sps)
    got = run_all(contiguous, prompts, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # 59 pages of 4 hold two 96-token reservations (24 pages each) at a time.
    assert contiguous.stats["max_decode_rows"] <= 2 < paged.stats["max_decode_rows"]
    # n > 1: children share the written pages copy-on-write and reserve the rest privately.
    sp = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    want = run_all(paged, [list(range(1, 11))], [sp])[0]
    got = run_all(contiguous, [list(range(1, 11))], [sp])[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert contiguous.blocks.all_free()


def test_bfloat16_engine_matches_the_bfloat16_reference_until_a_near_tie():
    """bf16 weights and KV cache, f32 accumulation: the engine's greedy tokens equal the bf16
    reference loop's, except after a step where the reference's top-2 logit gap is below
    TOL (a tie either side may break differently: paged vs dense cache, flat vs padded batch)."""
    from llmserve.reference import forward_dense

    tol = 0.05
    cfg = preset("tiny-9-3").replace(dtype="bfloat16")
    params = init_params(cfg, seed=5)
    prompts, lens = random_workload(cfg, 12, seed=4)
    eng = make_engine(cfg, params, decode_buckets=(8,))
    assert eng.runner.cache.k[0].dtype.itemsize == 2  # bf16 pages (stored as uint16 on CPU)
    outs = run_all(eng, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                  for n in lens])
    want = generate_reference(params, cfg, prompts, max(lens))
    diverged = 0
    for p, n, w, o in zip(prompts, lens, want, outs):
        got = o.outputs[0].token_ids
        if got == w[:n]:
            continue
        i = next(j for j in range(n) if got[j] != w[j])
        logits = np.asarray(forward_dense(params, np.asarray([p + w[:i]]), cfg)[0, -1],
                            np.float32)
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < tol, f"diverged at {i} with a top-2 gap {top2[1] - top2[0]}"
        diverged += 1
    assert diverged <= 2


def test_dropped_engines_free_their_compiled_programs(tiny):
    """An engine owns its compiled programs: after it is dropped and other shapes are built,
    its executables are freed (XLA:CPU maps each one's code into the process; a sweep building
    engine after engine once crashed on the kernel's memory-map limit). Engines of the same
    shape share programs while either lives."""
    import gc
    import weakref

    from llmserve.programs import KEEP_RECENT

    cfg, params = tiny
    first = make_engine(cfg, params, max_num_seqs=3, decode_buckets=(3,))
    assert first.runner.num_compilations() > 0
    twin = Engine(cfg, params, None, EngineConfig(
        max_model_len=96, max_num_seqs=3, page_size=4, max_num_batched_tokens=32,
        prefill_buckets=((1, 8), (4, 16)), decode_buckets=(3,), max_logprobs=2))
    assert twin.runner.programs is first.runner.programs  # same shape: compiled once
    ref = weakref.ref(first.runner.programs)
    del first, twin
    for n in range(KEEP_RECENT):  # other shapes push it out of the recent set
        Engine(cfg, params, None, EngineConfig(
            max_model_len=96, max_num_seqs=5 + n, page_size=4, max_num_batched_tokens=32,
            prefill_buckets=((1, 8),), decode_buckets=(5 + n,)))
    gc.collect()
    assert ref() is None
