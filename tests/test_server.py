"""The OpenAI-compatible server, through the real ``openai`` client and raw HTTP.

A tiny random model (SmolLM2's tokenizer and chat template, so text and chat are real) serves
on 127.0.0.1 from a background uvicorn thread. Oracles: the dense reference generate loop and
the dense model's log_softmax (independent of the paged engine), and n=1 runs with the seed.
"""

import asyncio
import json

import jax
import numpy as np
import pytest

from llmserve.config import preset
from llmserve.engine import Engine, EngineConfig
from llmserve.model import init_params
from llmserve.reference import forward_dense, generate_reference
from llmserve.sampling_params import child_seed
from llmserve.scoring import PromptScorer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from llmserve.server import BackgroundServer, create_app  # noqa: E402

KEY = "sk-test"
MODEL = "tiny"
MAX_LEN = 256


@pytest.fixture(scope="module")
def setup(gguf_path):
    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path)
    cfg = preset("tiny-9-3").replace(vocab_size=tok.vocab_size, max_position_embeddings=512)
    params = init_params(cfg, seed=3)
    # Spread the tied embedding (0.02 -> 1) so logits differ by whole units: greedy picks are
    # far from ties and do not depend on which rows share a batch.
    params = dict(params, embed={"embedding": params["embed"]["embedding"] * 50.0})
    engine = Engine(cfg, params, tok, EngineConfig(
        max_model_len=MAX_LEN, max_num_seqs=32, page_size=8, max_num_batched_tokens=128,
        prefill_buckets=((1, 32), (4, 128)), decode_buckets=(8, 32), max_logprobs=5))
    engine.warmup()
    scorer = PromptScorer(cfg, params, max_len=MAX_LEN, num_top=5, buckets=(64, MAX_LEN))
    scorer.warmup()
    app = create_app(engine, model_name=MODEL, api_key=KEY, scorer=scorer)
    compiles = engine.runner.num_compilations() + scorer.num_compilations()
    with BackgroundServer(app) as srv:
        yield dict(url=srv.url, tok=tok, cfg=cfg, params=params, engine=engine, app=app)
    # Nothing compiled while serving, and every page came back.
    assert engine.runner.num_compilations() + scorer.num_compilations() == compiles
    assert engine.blocks.all_free()


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup["url"] + "/v1", api_key=KEY, max_retries=0)


def reference_text(setup, prompt_ids, n):
    ids = generate_reference(setup["params"], setup["cfg"], [prompt_ids], n)[0]
    return setup["tok"].decode(ids), ids


def dense_logprobs(setup, ids):
    logits = np.asarray(forward_dense(setup["params"], np.array([ids]), setup["cfg"]))[0]
    return np.asarray(jax.nn.log_softmax(logits, -1))  # [T, V]


def stream_text(chunks, field="text"):
    parts = {}
    for c in chunks:
        for ch in c.choices:
            piece = ch.text if field == "text" else (ch.delta.content or "")
            parts[ch.index] = parts.get(ch.index, "") + piece
    return parts


PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def test_models_health_metrics(setup, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(setup["url"] + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    text = httpx.get(setup["url"] + "/metrics").text
    for name in ("llmserve_num_requests_running", "llmserve_num_requests_waiting",
                 "llmserve_kv_pages_used", "llmserve_prefix_cache_hit_rate",
                 "llmserve_spec_decode_acceptance_rate", "llmserve_preemptions_total",
                 "llmserve_time_to_first_token_seconds_bucket",
                 "llmserve_inter_token_latency_seconds_bucket",
                 "llmserve_generation_tokens_total"):
        assert name in text, name
    assert "llmserve_time_to_first_token_seconds_count 0.0" not in text


def test_completion_matches_reference(setup, client):
    ids = setup["tok"].encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    want, _ = reference_text(setup, ids, 12)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    # token ids as the prompt, several prompts in one request
    r2 = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=12,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[0].text == want
    assert r2.choices[1].text == reference_text(setup, ids[:5], 12)[0]
    # max_tokens null: generate until the context is full.
    r3 = client.completions.create(model=MODEL, prompt=ids[:5], max_tokens=None,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert r3.usage.total_tokens == MAX_LEN and r3.choices[0].finish_reason == "length"


def test_streamed_text_equals_non_streamed(setup, client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # A stop string from the middle of the text: the stream must never leak part of it.
    stop = full[8:11]
    chunks = list(client.completions.create(stream=True, **kw))
    assert stream_text(chunks)[0] == full
    assert chunks[-1].choices[0].finish_reason == "length"
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    chunks = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert stream_text(chunks)[0] == cut.text

    msgs = [{"role": "user", "content": "Tell me a story."}]
    ckw = dict(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
               extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**ckw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **ckw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_text(chunks, "delta")[0] == full


def test_chat_applies_template(setup, client):
    tok = setup["tok"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference_text(setup, ids, 10)[0]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_and_seed(client):
    # The tiny model repeats its last token with near certainty; a high temperature makes the
    # samples depend on the seed.
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=20.0)
    two = client.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    # Child i of an n-request samples with child_seed(seed, i): equal to n=1 runs.
    one = [client.completions.create(seed=child_seed(7, i), **kw).choices[0].text
           for i in (0, 1)]
    assert [c.text for c in two.choices] == one
    assert one[0] != one[1]
    streamed = stream_text(client.completions.create(n=2, seed=7, stream=True, **kw))
    assert [streamed[0], streamed[1]] == one


def test_logprobs_match_dense_model(setup, client):
    tok = setup["tok"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    prompt_ids = tok.encode(PROMPT)
    _, out_ids = reference_text(setup, prompt_ids, 6)
    want = dense_logprobs(setup, prompt_ids + out_ids)
    for k, tid in enumerate(out_ids):
        row = want[len(prompt_ids) - 1 + k]
        assert lp.tokens[k] == tok.decode([tid], skip_special_tokens=False)
        np.testing.assert_allclose(lp.token_logprobs[k], row[tid], atol=1e-3)
        assert len(lp.top_logprobs[k]) <= 3  # greedy token is the top one: counted among the 3
        best = max(lp.top_logprobs[k].values())
        np.testing.assert_allclose(best, row.max(), atol=1e-3)
    # chat: logprobs=true, top_logprobs
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == max(a.logprob for a in t.top_logprobs) for t in content)


def test_echo_and_prompt_logprobs(setup, client):
    tok = setup["tok"]
    ids = tok.encode(PROMPT)
    # max_tokens=0 + echo: pure scoring, what log-likelihood evaluation sends.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=2)
    ch = r.choices[0]
    assert ch.text == PROMPT and r.usage.completion_tokens == 0
    want = dense_logprobs(setup, ids)
    assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) == len(ids)
    got = np.array(ch.logprobs.token_logprobs[1:])
    np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=1e-3)
    assert ch.logprobs.text_offset[:2] == [0, len(tok.decode([ids[0]]))]
    # echo with generation: prompt text, then the completion; logprobs cover both.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True,
                                  logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    want_text, _ = reference_text(setup, ids, 5)
    assert r.choices[0].text == PROMPT + want_text
    assert len(r.choices[0].logprobs.tokens) == len(ids) + 5
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                            echo=True, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert stream_text(chunks)[0] == PROMPT + want_text


def post(setup, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(setup["url"] + path, content=content, headers=headers, timeout=60)


BAD = [  # (body, raw body, status, param, message fragment)
    (None, b"{not json", 400, None, "malformed JSON"),
    (None, b"[1, 2]", 400, None, "JSON object"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, None, 400, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": 5}, None, 400, "prompt", "invalid value"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, None, 400, "stream", "boolean"),
    (None, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature",
     "finite"),
    ({"model": MODEL, "prompt": "x", "temperature": -1.0}, None, 400, "temperature", ">= 0"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, None, 400, "top_p", "(0, 1]"),
    ({"model": MODEL, "prompt": "x", "n": 0}, None, 400, "n", ">= 1"),
    ({"model": MODEL, "prompt": "x", "logprobs": 9}, None, 400, "logprobs", "max_logprobs"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, None, 400, "max_tokens", "echo"),
    ({"model": "gpt-4", "prompt": "x"}, None, 404, "model", "does not exist"),
    ({"model": MODEL, "prompt": "word " * 300}, None, 400, "prompt", "context length"),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN}, None, 400, "max_tokens",
     "context length"),
    ({"model": MODEL, "prompt": ""}, None, 400, "prompt", "empty"),
    ({"model": MODEL, "prompt": [10 ** 9]}, None, 400, "prompt", "out of range"),
    ({"model": MODEL, "prompt": "x", "tools": []}, None, 400, "tools", "not supported"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"1": 2}}, None, 400, "logit_bias",
     "not supported"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, None, 400, "frobnicate", "unknown"),
]
BAD_CHAT = [
    ({"model": MODEL, "messages": []}, 400, "messages", "at least one"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_object"}}, 400, "response_format", "not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     400, "tool_choice", "not supported"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.role",
     "invalid value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs", "logprobs=true"),
]


def test_bad_requests_get_openai_errors(setup, client):
    for body, raw, status, param, fragment in BAD:
        r = post(setup, "/v1/completions", body, raw=raw)
        err = r.json()["error"]
        assert r.status_code == status, (body, raw, r.text)
        assert err["param"] == param and fragment in err["message"], (body, err)
        assert set(err) == {"message", "type", "param", "code"}
    for body, status, param, fragment in BAD_CHAT:
        r = post(setup, "/v1/chat/completions", body)
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param, (body, r.text)
        assert fragment in err["message"], (body, err)
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "someone"}  # user: ignored
    for key in (None, "wrong"):
        r = post(setup, "/v1/completions", ok, key=key)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=setup["url"] + "/v1", api_key="nope", max_retries=0
                      ).models.list()
    # Overload: with the waiting limit at 0 every new request is refused with a 429.
    loop = setup["app"].state.loop
    loop.max_waiting, limit = 0, loop.max_waiting
    try:
        r = post(setup, "/v1/completions", ok)
        assert r.status_code == 429 and "waiting" in r.json()["error"]["message"]
    finally:
        loop.max_waiting = limit
    assert post(setup, "/v1/completions", ok).status_code == 200  # still serving


def test_concurrent_streams_with_disconnects(setup):
    """64 streaming clients; every 4th hangs up after 3 chunks. Completed ones equal the
    reference; the others are aborted; every page is free afterwards."""
    cfg, engine = setup["cfg"], setup["engine"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, rng.integers(4, 40)).tolist() for _ in range(64)]
    lens = rng.integers(4, 24, 64).tolist()
    quit_early = [i % 4 == 1 for i in range(64)]
    loop = setup["app"].state.loop

    def aborted():
        return loop.metrics.finished.labels("abort")._value.get()

    before = aborted()

    async def one(aclient, i):
        max_tokens = 200 if quit_early[i] else lens[i]
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        text, n = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text
            n += 1
            if quit_early[i] and n == 3:
                await stream.close()
                return None
        return text

    async def run_all():
        async with openai.AsyncOpenAI(base_url=setup["url"] + "/v1", api_key=KEY,
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    texts = asyncio.run(run_all())
    want = generate_reference(setup["params"], cfg, prompts, max(lens))
    for i, text in enumerate(texts):
        if quit_early[i]:
            assert text is None
        else:
            assert text == setup["tok"].decode(want[i][: lens[i]]), i
    for _ in range(100):  # aborts land within a step or two
        if loop.num_running == loop.num_waiting == 0 and not engine.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert aborted() - before == sum(quit_early)
    assert engine.blocks.all_free()


def test_step_failure_fails_its_requests_and_serving_continues(setup, client, monkeypatch):
    engine = setup["engine"]
    real_run = engine.runner.run
    calls = {"n": 0}

    def failing_run(batch, *drafts):
        calls["n"] += 1
        if calls["n"] == 1:  # a device failure that also consumed the donated cache
            for x in jax.tree_util.tree_leaves(engine.runner.cache):
                x.delete()
            raise RuntimeError("injected device failure")
        return real_run(batch, *drafts)

    monkeypatch.setattr(engine.runner, "run", failing_run)
    with pytest.raises(openai.InternalServerError, match="injected device failure"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert setup["app"].state.loop.step_errors == 1
    ids = setup["tok"].encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == reference_text(setup, ids, 8)[0]
