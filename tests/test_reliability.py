"""Regression tests for wrong outputs the engine used to give (each failed before its fix)."""

import hashlib
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from llmserve.block_manager import page_hash, root_hash
from llmserve.config import preset
from llmserve.kv_cache import DenseKVCache
from llmserve.model import init_params
from llmserve.reference import decode_dense, generate_reference, prefill_dense
from llmserve.sampling_params import SamplingParams, child_seed, request_seed

from .conftest import tiny_over_smollm2_vocab
from .test_engine import make_engine, run_all


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny-9-3")
    return cfg, init_params(cfg, seed=5)


@pytest.fixture(scope="module")
def tok_model(smollm2_tokenizer):
    """A tiny random model over SmolLM2's real vocabulary, with its GGUF tokenizer."""
    cfg = tiny_over_smollm2_vocab(smollm2_tokenizer)
    return cfg, init_params(cfg, seed=2), smollm2_tokenizer


def penalized_greedy(params, cfg, prompt, n, *, presence=0.0, frequency=0.0, repetition=1.0):
    """Oracle: dense-cache greedy decoding with vLLM's penalties applied in numpy."""
    cache = DenseKVCache.create(cfg, 1, len(prompt) + n)
    logits, cache = prefill_dense(params, jnp.asarray([prompt], jnp.int32),
                                  jnp.asarray([len(prompt)], jnp.int32), cache, cfg=cfg)
    seen_prompt = np.zeros(cfg.vocab_size, bool)
    seen_prompt[prompt] = True
    counts = np.zeros(cfg.vocab_size, np.float32)
    out = []
    for i in range(n):
        lg = np.asarray(logits[0], np.float32)
        seen = seen_prompt | (counts > 0)
        lg = np.where(seen, np.where(lg > 0, lg / repetition, lg * repetition), lg)
        lg = lg - frequency * counts - presence * (counts > 0)
        tok = int(np.argmax(lg))
        out.append(tok)
        counts[tok] += 1
        logits, cache = decode_dense(params, jnp.asarray([tok], jnp.int32),
                                     jnp.asarray([len(prompt) + i], jnp.int32), cache, cfg=cfg)
    return out


def drain(eng):
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


# ---------------------------------------------------------------- 1. penalties + prefix cache
def test_penalties_equal_oracle_after_prefix_hit_and_on_a_reused_slot(tiny):
    cfg, params = tiny
    sp = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=0.5,
                        repetition_penalty=1.3, max_tokens=12, ignore_eos=True)
    prompt = list(range(3, 32))  # 29 tokens: 7 full pages of 4, served by the cache next time
    want = penalized_greedy(params, cfg, prompt, 12, presence=2.0, frequency=0.5,
                            repetition=1.3)
    eng = make_engine(cfg, params, max_num_seqs=1)
    first = run_all(eng, [prompt], [sp])[0].outputs[0].token_ids
    hits = eng.blocks.stats.prefix_hits
    eng.add_request("again", prompt, sp)  # same slot, its first chunk starts past the cache
    second = [o for o in drain(eng) if o.finished][0].outputs[0].token_ids
    assert eng.blocks.stats.prefix_hits > hits
    assert first == want and second == want


def test_penalties_survive_preemption_and_recompute(tiny):
    cfg, params = tiny
    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    sps = [SamplingParams(temperature=0, presence_penalty=1.5, repetition_penalty=1.2,
                          max_tokens=30, ignore_eos=True) for _ in prompts]
    eng = make_engine(cfg, params, num_pages=30, max_model_len=64)  # far too few for all 4
    outs = run_all(eng, prompts, sps)
    assert eng.stats["preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == penalized_greedy(params, cfg, p, 30, presence=1.5,
                                                          repetition=1.2)


# ---------------------------------------------------------------- 2. min_tokens
def test_min_tokens_bans_many_stop_ids_and_matches_under_speculation(tiny):
    cfg, params = tiny
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    free = generate_reference(params, cfg, [prompt], 12)[0]
    # Ban the 10 tokens the model likes most at the first step, and the token it emits 2nd.
    cache = DenseKVCache.create(cfg, 1, len(prompt))
    logits, _ = prefill_dense(params, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), cache,
                              cfg=cfg)
    top10 = np.argsort(-np.asarray(logits[0]))[:10].tolist()
    stops = sorted(set(top10) | {free[1]})
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=stops)
    plain = run_all(make_engine(cfg, params), [prompt], [sp])[0].outputs[0]
    assert len(plain.token_ids) >= 6
    assert not set(plain.token_ids[:6]) & set(stops)  # all 11 banned, not just the first 4
    assert plain.token_ids[0] == int(np.argmax(np.where(np.isin(np.arange(cfg.vocab_size),
                                                                 stops), -np.inf,
                                                        np.asarray(logits[0]))))
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                 {"method": "draft", "model": (cfg, params), "num_speculative_tokens": 4,
                  "adaptive": False}):
        # One request: two slots and one prefill bucket keep the compiled set small.
        eng = make_engine(cfg, params, max_num_seqs=2, decode_buckets=(2,), verify_buckets=(2,),
                          prefill_buckets=((2, 8),), speculative_config=spec)
        got = run_all(eng, [prompt], [sp])[0].outputs[0]
        assert got.token_ids == plain.token_ids and got.finish_reason == plain.finish_reason


def test_min_tokens_with_too_many_stop_ids_is_rejected(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    with pytest.raises(ValueError, match="min_tokens"):
        eng.add_request("x", [1, 2], SamplingParams(min_tokens=2, stop_token_ids=range(40)))
    assert not eng.requests


# ---------------------------------------------------------------- 3. stop strings
def _free_text(eng, prompt, n):
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=n, ignore_eos=True)
    out = run_all(eng, [prompt], [sp])[0].outputs[0]
    return out.text, out.token_ids


def test_stop_strings_never_cut_text_before_min_tokens(tok_model):
    cfg, params, tok = tok_model
    from llmserve.engine import Engine, EngineConfig

    eng = Engine(cfg, params, tok, EngineConfig(max_model_len=96, max_num_seqs=4, page_size=4,
                                                prefill_buckets=((1, 16),),
                                                decode_buckets=(4,)))
    eng.warmup()
    prompt = tok.encode("The list of words:")
    text, ids = _free_text(eng, prompt, 24)
    early = tok.decode(ids[:3])  # text of the first 3 tokens
    stop = next(early[i:i + 3] for i in range(len(early) - 2)
                if text.count(early[i:i + 3]) == 1 and early[i:i + 3].strip())
    # The stop string occurs only inside the first 3 tokens' text: with min_tokens past it,
    # the old 64-character scan cut the output retroactively once min_tokens was reached.
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=24, min_tokens=6, stop=[stop],
                        ignore_eos=True)
    out = run_all(eng, [prompt], [sp])[0].outputs[0]
    assert out.text == text and out.finish_reason == "length"
    # Without min_tokens it stops there; with include_stop_str_in_output it keeps the string.
    for include in (False, True):
        sp = SamplingParams(temperature=1.0, seed=3, max_tokens=24, stop=[stop],
                            ignore_eos=True, include_stop_str_in_output=include)
        out = run_all(eng, [prompt], [sp])[0].outputs[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert out.text == text[:cut] and out.finish_reason == "stop"
        assert out.stop_reason == stop


def test_stop_strings_without_tokenizer_are_rejected(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request("x", [1, 2], SamplingParams(stop=["\n"]))
    assert not eng.requests


# ---------------------------------------------------------------- 4. seeds
def test_n_children_equal_n1_runs_seeded_with_child_seed(tiny):
    cfg, params = tiny
    prompt = list(range(1, 11))
    sp = dict(temperature=1.0, top_k=20, max_tokens=10, ignore_eos=True)
    out = run_all(make_engine(cfg, params), [prompt], [SamplingParams(n=3, seed=7, **sp)])[0]
    solo = run_all(make_engine(cfg, params), [prompt] * 3,
                   [SamplingParams(seed=child_seed(7, i), **sp) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in solo]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert child_seed(7, 1) != 8 and child_seed(7, 0) == 7  # no collision with seed + 1


def test_unseeded_request_seed_is_stable_across_processes():
    code = ("from llmserve.sampling_params import request_seed, child_seed;"
            "print(request_seed(0, 'gen-0-3'), child_seed(5, 2))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(h)), check=True).stdout
            for h in (1, 2)}
    assert outs == {f"{request_seed(0, 'gen-0-3')} {child_seed(5, 2)}\n"}
    assert request_seed(0, "a") != request_seed(1, "a") != request_seed(0, "b")


def test_unseeded_sampling_reproducible_from_engine_seed(tiny):
    cfg, params = tiny
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [run_all(make_engine(cfg, params, seed=s), [[1, 2, 3]] * 2, [sp, sp])
            for s in (0, 0, 1)]
    ids = [[o.outputs[0].token_ids for o in r] for r in runs]
    assert ids[0] == ids[1] and ids[0] != ids[2]


# ---------------------------------------------------------------- 5. aborts
def test_abort_reports_final_output_and_spares_the_other_request(tiny):
    cfg, params = tiny
    sp_b = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = run_all(make_engine(cfg, params), [[6, 7]], [sp_b])[0].outputs[0].token_ids
    eng = make_engine(cfg, params)
    eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=50))
    eng.add_request("b", [6, 7], sp_b)
    for _ in range(3):
        eng.step()
    eng.abort("a")
    assert eng.has_unfinished_requests()
    first = eng.step()
    aborted = [o for o in first if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished
    assert aborted[0].outputs[0].finish_reason == "abort"
    rest = first + drain(eng)
    b = [o for o in rest if o.request_id == "b" and o.finished][0]
    assert b.outputs[0].token_ids == alone and b.outputs[0].finish_reason == "length"
    assert sum(o.request_id == "a" for o in rest) == 1  # reported once
    assert eng.blocks.all_free()


# ---------------------------------------------------------------- 6. leaks
def test_speculation_policy_forgets_finished_sequences(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params, decode_buckets=(8,), verify_buckets=(8,), speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    run_all(eng, [[1, 2, 1, 2, 1, 2]] * 3, [SamplingParams(temperature=0, max_tokens=8)] * 3)
    eng.add_request("x", [1, 2, 1, 2], SamplingParams(temperature=0, max_tokens=40))
    eng.step()
    eng.step()
    eng.abort("x")
    drain(eng)
    assert eng.stats["spec_verify_rows"] > 0
    assert not eng.policy.rate and not eng.policy.steps


# ---------------------------------------------------------------- 8. prefix-cache keys
def test_prefix_cache_keys_are_sha256_chains_separated_by_salt(tiny):
    cfg, params = tiny
    eng = make_engine(cfg, params)
    prompt = list(range(1, 30))
    sp = SamplingParams(temperature=0, max_tokens=3)
    want = run_all(eng, [prompt], [sp])[0].outputs[0].token_ids
    hits = eng.blocks.stats.prefix_hits
    eng.add_request("t1", {"prompt_token_ids": prompt, "cache_salt": "tenant-1"}, sp)
    got = [o for o in drain(eng) if o.finished][0].outputs[0].token_ids
    assert eng.blocks.stats.prefix_hits == hits  # another tenant's pages are never read
    eng.add_request("t1b", prompt, sp, cache_salt="tenant-1")
    assert [o for o in drain(eng) if o.finished][0].outputs[0].token_ids == got == want
    assert eng.blocks.stats.prefix_hits == hits + 7  # the same tenant hits its own pages
    digest = page_hash(root_hash(None), [1, 2, 3, 4])
    assert digest == hashlib.sha256(root_hash(None) + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0,
                                                             4, 0, 0, 0])).digest()
    assert root_hash("tenant-1") != root_hash(None) != root_hash("tenant-2")


# ---------------------------------------------------------------- 9. silently wrong models
def test_sliding_window_caps_max_model_len_with_a_warning(tiny, caplog):
    cfg, params = tiny
    cfg = cfg.replace(sliding_window=32, model_type="mistral")
    with caplog.at_level(logging.WARNING):
        eng = make_engine(cfg, params, max_model_len=96)
    assert eng.config.max_model_len == 32 and "sliding_window" in caplog.text
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("x", list(range(1, 40)), SamplingParams())
    with pytest.raises(ValueError, match="sliding_window"):
        generate_reference(params, cfg, [list(range(1, 30))], 8)


def test_every_eos_id_of_config_json_stops(hf_dir_factory, tmp_path):
    import json
    import shutil

    from llmserve.checkpoint import load_checkpoint
    from llmserve.engine import Engine, EngineConfig

    src, _ = hf_dir_factory("mistral", 4, 2)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    conf = json.loads((d / "config.json").read_text())
    cfg0, params = load_checkpoint(str(d))
    free = generate_reference(params, cfg0, [[5, 6, 7]], 8)[0]
    conf["eos_token_id"] = [255, free[3]]  # the second id is the one generated
    conf["sliding_window"] = 4096
    (d / "config.json").write_text(json.dumps(conf))
    cfg, params = load_checkpoint(str(d))
    assert cfg.eos_token_ids == (255, free[3]) and cfg.sliding_window == 4096
    eng = Engine(cfg, params, None, EngineConfig(max_model_len=64, max_num_seqs=2, page_size=4,
                                                 prefill_buckets=((1, 8),),
                                                 decode_buckets=(2,)))
    eng.warmup()
    out = run_all(eng, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=8)])[0]
    assert out.outputs[0].token_ids == free[:4] and out.outputs[0].finish_reason == "stop"


# ---------------------------------------------------------------- device step errors
def test_recover_after_a_failed_step_fails_only_that_step(tiny):
    cfg, params = tiny
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = run_all(make_engine(cfg, params), [[6, 7, 8]], [sp])[0].outputs[0].token_ids
    eng = make_engine(cfg, params)
    eng.add_request("old", [6, 7, 8], sp)
    for _ in range(3):
        eng.step()
    eng.add_request("queued", [6, 7, 8], sp)
    real_run = eng.runner.run

    def broken(batch, *drafts):  # consumes the donated buffers, then fails like a device error
        for x in (*eng.runner.cache.k, *eng.runner.cache.v):
            x.delete()
        raise RuntimeError("injected device failure")

    eng.runner.run = broken
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.runner.run = real_run
    failed = eng.recover()
    assert "old" in failed  # it was in the failed step
    outs = {o.request_id: o for o in drain(eng) if o.finished}
    assert outs["old"].outputs[0].finish_reason == "abort"
    if "queued" not in failed:  # not yet scheduled: it must complete normally
        assert outs["queued"].outputs[0].token_ids == alone
    eng.add_request("after", [6, 7, 8], sp)
    assert [o for o in drain(eng) if o.finished][0].outputs[0].token_ids == alone
    assert eng.blocks.all_free()
