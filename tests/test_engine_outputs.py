"""What the engine returns, field by field, against independent oracles: stop strings (several,
spanning tokens, ending inside a token), min_tokens, logprobs and cumulative_logprob (against
log_softmax of the reference model's logits), EOS from the model config, skip_special_tokens
(real tokenizer) and a KV cache sized by kv_cache_memory.

Every engine here has the same shapes (so the step compiles once per model); the model is the
soak's tiny peaked model over a character tokenizer (one token per character).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmserve.engine import Engine, EngineConfig
from llmserve.kv_cache import DenseKVCache
from llmserve.reference import decode_dense, forward_dense, prefill_dense
from llmserve.sampling_params import SamplingParams
from llmserve.testing.soak import soak_model

from .test_engine import run_all

SHAPES = dict(max_model_len=64, max_num_seqs=4, page_size=4, max_num_batched_tokens=32,
              prefill_buckets=((1, 16),), decode_buckets=(4,), max_logprobs=5)


@pytest.fixture(scope="module")
def model():
    return soak_model(seed=0)


def engine(cfg, params, tok, **kw):
    eng = Engine(cfg, params, tok, EngineConfig(**{**SHAPES, **kw}))
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def eng(model):
    return engine(*model)


def one(eng, prompt, sp):
    return run_all(eng, [prompt], [sp])[0].outputs[0]


def first_stop(text, stops):
    """Oracle: the stop string the engine must stop at, scanning text one character (= token)
    at a time: the one completed first; of two completed by the same character, the earlier."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    return min(found) if found else None


# ---------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("include", [False, True])
def test_several_stop_strings_first_completed_wins_across_tokens(model, eng, include):
    cfg, params, tok = model
    prompt = "the quick brown fox"
    free_sp = SamplingParams(temperature=1.0, seed=4, max_tokens=40, ignore_eos=True)
    free = one(eng, prompt, free_sp)
    text = free.text
    assert len(text) == len(free.token_ids) == 40  # one character per token
    # A 3-character stop (3 tokens) early on, a 2-character one later, one that never occurs.
    early, late = text[6:9], text[20:22]
    stops = [late, "\x01never", early]
    end, start, s = first_stop(text, stops)
    out = one(eng, prompt, SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                          ignore_eos=True, stop=stops,
                                          include_stop_str_in_output=include))
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == free.token_ids[:end]  # generation ends on the completing token
    assert out.text == text[:end if include else start]


def test_stop_string_ending_inside_a_token_with_the_real_tokenizer(tok_engine):
    """SmolLM2's tokens hold several characters: the stop string spans a token boundary and
    ends inside the next token; the text is cut there, not at a token edge."""
    eng, tok = tok_engine
    prompt = tok.encode("Once upon a time")
    sp = dict(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
    free = one(eng, prompt, SamplingParams(**sp))
    pieces = [tok.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # Token j's text is pieces[j+1][len(pieces[j]):]; pick a boundary between two tokens of
    # 2+ characters and a stop of the last character of one and the first of the next.
    j = next(j for j in range(2, len(free.token_ids) - 1)
             if len(pieces[j]) - len(pieces[j - 1]) >= 2
             and len(pieces[j + 1]) - len(pieces[j]) >= 2
             and pieces[-1].find(pieces[j][-1] + pieces[j + 1][len(pieces[j])]) == len(
                 pieces[j]) - 1)
    stop = pieces[j][-1] + pieces[j + 1][len(pieces[j])]
    out = one(eng, prompt, SamplingParams(**sp, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == pieces[-1][:len(pieces[j]) - 1]
    assert out.token_ids == free.token_ids[:j + 1]


# ---------------------------------------------------------------------------------- min_tokens
def ref_greedy(params, cfg, prompts, n, banned=(), until=0):
    """Oracle: the dense-cache reference model, greedy, ``banned`` ids masked for the first
    ``until`` tokens. Always a [16, 48] prefill and [16] decodes, so it compiles once."""
    rows, width = 16, 48
    tokens = np.zeros((rows, width), np.int32)
    lens = np.ones(rows, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)], lens[i] = p, len(p)
    cache = DenseKVCache.create(cfg, rows, width + n)
    logits, cache = prefill_dense(params, jnp.asarray(tokens), jnp.asarray(lens), cache,
                                  cfg=cfg)
    out = np.zeros((rows, n), np.int32)
    for i in range(n):
        lg = np.array(logits)
        if i < until:
            lg[:, list(banned)] = -np.inf
        out[:, i] = lg.argmax(-1)
        logits, cache = decode_dense(params, jnp.asarray(out[:, i]), jnp.asarray(lens + i),
                                     cache, cfg=cfg)
    return [out[i].tolist() for i in range(len(prompts))]


def test_min_tokens_bans_stop_ids_then_stops(model, eng):
    cfg, params, tok = model
    prompt = [5, 6, 7, 8, 9]
    free = one(eng, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ids = free.token_ids
    stops = sorted({ids[0], ids[2]})  # the model wants one of them at once
    min_tokens = 4
    want = ref_greedy(params, cfg, [prompt], 12, set(stops) | {cfg.eos_token_id}, min_tokens)[0]
    assert want[:1] != ids[:1]  # the ban changes the output
    cut = next((j for j in range(min_tokens, 12) if want[j] in stops + [cfg.eos_token_id]),
               None)
    out = one(eng, prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=min_tokens,
                                          stop_token_ids=stops))
    if cut is None:
        assert out.token_ids == want and out.finish_reason == "length"
    else:
        assert out.token_ids == want[:cut + 1] and out.finish_reason == "stop"
        assert out.stop_reason == want[cut]
    assert len(out.token_ids) >= min_tokens
    assert not set(out.token_ids[:min_tokens]) & (set(stops) | {cfg.eos_token_id})


# ---------------------------------------------------------------------------------- logprobs
def test_logprobs_and_cumulative_logprob_match_reference_log_softmax(model, eng):
    cfg, params, tok = model
    prompt = [10, 11, 12, 13, 14, 15, 16]
    k = 3
    # Temperature and top-k change what is sampled, not what is reported: the raw model's
    # log-probabilities (vLLM's default).
    out = one(eng, prompt, SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=10,
                                          ignore_eos=True, logprobs=k))
    ids = out.token_ids
    logits = forward_dense(params, np.asarray([prompt + ids]), cfg)[0, len(prompt) - 1:-1]
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))  # [T, V]
    assert len(out.logprobs) == len(ids) == 10
    for t, (tok_id, entry) in enumerate(zip(ids, out.logprobs)):
        top = np.argsort(-ref[t])[:k]
        assert set(entry) == set(top.tolist()) | {tok_id}
        for i, lp in entry.items():
            assert lp == pytest.approx(ref[t, i], abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(ref[np.arange(10), ids].sum(), abs=1e-3)
    # logprobs=0: only the sampled token; None: no logprobs, cumulative_logprob still reported.
    zero = one(eng, prompt, SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=10,
                                           ignore_eos=True, logprobs=0))
    assert zero.token_ids == ids and [list(e) for e in zero.logprobs] == [[i] for i in ids]
    none = one(eng, prompt, SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=10,
                                           ignore_eos=True))
    assert none.logprobs is None
    assert none.cumulative_logprob == pytest.approx(out.cumulative_logprob, abs=1e-5)


# ---------------------------------------------------------------------------------- EOS
def test_config_eos_stops_generation_unless_ignore_eos(model):
    cfg, params, _ = model
    eos = cfg.eos_token_id
    # A larger EOS embedding makes the tiny model say EOS now and then (same shapes: no compile).
    emb = params["embed"]["embedding"]
    params = {**params, "embed": {"embedding": emb.at[eos].multiply(2.5)}}
    prompts = np.random.default_rng(0).integers(0, eos, (16, 8)).tolist()
    free = ref_greedy(params, cfg, prompts, 16)
    i, at = next((i, f.index(eos)) for i, f in enumerate(free) if eos in f[2:])
    eng = engine(cfg, params, None)  # no tokenizer: only the config's eos_token_id
    stop = one(eng, prompts[i], SamplingParams(temperature=0, max_tokens=16))
    assert stop.token_ids == free[i][:at + 1]
    assert stop.finish_reason == "stop" and stop.stop_reason == eos
    cont = one(eng, prompts[i], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert cont.token_ids == free[i] and cont.finish_reason == "length"


# ---------------------------------------------------------------------------------- special tokens
@pytest.fixture(scope="module")
def tok_engine():
    """A tiny model over SmolLM2's vocabulary with its real GGUF tokenizer; <|im_start|> has a
    larger embedding so the model copies it, and a frequency penalty moves it on to text."""
    from llmserve.checkpoint.gguf import default_model_path
    from llmserve.config import preset
    from llmserve.model import init_params
    from llmserve.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = preset("tiny-9-3").replace(vocab_size=tok.vocab_size, eos_token_id=2)
    params = init_params(cfg, seed=2)
    emb = params["embed"]["embedding"]
    params = {**params, "embed": {"embedding": emb.at[tok.token_to_id("<|im_start|>")]
                                  .multiply(2.0)}}
    return engine(cfg, params, tok), tok


def test_skip_special_tokens_with_the_real_tokenizer(tok_engine):
    eng, tok = tok_engine
    special = tok.token_to_id("<|im_start|>")
    prompt = tok.encode("The cat sat on the mat<|im_start|>")
    sp = dict(temperature=0, max_tokens=12, frequency_penalty=0.5)
    shown = one(eng, prompt, SamplingParams(**sp, skip_special_tokens=False))
    hidden = one(eng, prompt, SamplingParams(**sp))  # skip_special_tokens=True by default
    ids = shown.token_ids
    assert hidden.token_ids == ids
    plain = [t for t in ids if t not in tok.special_token_ids]
    assert special in ids and plain  # the output mixes the special token and text
    assert "<|im_start|>" in shown.text and "<|im_start|>" not in hidden.text
    assert shown.text == "".join(tok.decode([t], skip_special_tokens=False) for t in ids)
    assert hidden.text == tok.decode(plain) != ""


# ---------------------------------------------------------------------------------- KV memory
def test_kv_cache_memory_sizes_the_page_pool(model, eng):
    cfg, params, tok = model
    itemsize = np.dtype(cfg.dtype).itemsize
    per_page = 2 * cfg.n_layers * cfg.n_kv_heads * SHAPES["page_size"] * cfg.head_dim * itemsize
    pages = eng.blocks.num_pages  # the same pool as the shared engine: nothing recompiles
    budget = pages * per_page + per_page // 2  # a partial page is not a page
    sized = engine(cfg, params, tok, kv_cache_memory=budget)
    assert sized.blocks.num_pages == budget // per_page == pages
    prompts = [[1, 2, 3, 4, 5], list(range(20, 50))]
    outs = run_all(sized, prompts, [SamplingParams(temperature=0, max_tokens=20,
                                                   ignore_eos=True)] * 2)
    want = ref_greedy(params, cfg, prompts, 20)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sized.blocks.all_free()
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        engine(cfg, params, tok, kv_cache_memory=4 * per_page)
