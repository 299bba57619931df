"""An OpenAI-compatible HTTP server over the engine: completions, chat, streaming, metrics.

One thread owns the engine (``EngineLoop``): it adds and aborts requests, runs side calls
(prompt scoring) and ``engine.step()``, and hands each ``RequestOutput`` to the asyncio queue of
the HTTP request that asked for it. HTTP handlers never touch the engine: they validate, enqueue
and stream. So the engine needs no locks and the event loop never blocks on a device step.

Endpoints (vLLM's conventions): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
with ``stream: true`` as server-sent events ending in ``[DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text). ``create_app`` builds the app;
``llmserve.serve`` runs it with uvicorn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import queue
import re
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

# OpenAI parameters we know and do not implement: rejected by name rather than ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "parallel_tool_calls", "suffix", "best_of", "audio", "modalities",
               "prediction", "web_search_options")


# ---------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as OpenAI's JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    """A 400 naming the offending parameter."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def _params_error(e: ValueError) -> APIError:
    """Maps SamplingParams' ``ValueError("SamplingParams.<field>=...")`` to a 400 on the field."""
    m = re.search(r"SamplingParams\.(\w+)", str(e))
    return bad_request(str(e), m.group(1) if m else None)


# ---------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    # Unknown fields, NaN/inf and type coercions ("5" for an int) are all 400s.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share; vLLM's extensions (top_k, min_p, ...) included."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]
                        ) -> SamplingParams:
        """SamplingParams for these fields; a bad value raises APIError(400, param=field)."""
        kw = {k: getattr(self, k) for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty") if getattr(self, k) is not None}
        try:
            return SamplingParams(
                n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, **kw)
        except ValueError as e:
            raise _params_error(e) from None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True


_FIELD_NAMES = {name for m in (CompletionRequest, ChatRequest, ChatMessage, StreamOptions)
                for name in m.model_fields}


def parse_body(raw: bytes, model: type[BaseModel]):
    """JSON body -> request model; malformed JSON, unknown or unsupported fields -> 400."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    for name in UNSUPPORTED:
        if name in data:
            raise bad_request(f"'{name}' is not supported by this server", name)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # loc mixes field names with list indices and union tags ("str", "list[int]").
        param = ".".join(x for x in err["loc"] if x in _FIELD_NAMES) or None
        if err["type"] == "extra_forbidden":
            param = ".".join(str(x) for x in err["loc"] if not isinstance(x, int))
            raise bad_request(f"unknown parameter '{param}'", param) from None
        raise bad_request(f"invalid value for '{param}': {err['msg']}", param) from None


# ---------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """Prometheus metrics in a registry of their own (several apps may live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.running = Gauge("llmserve_num_requests_running", "Requests with a slot", registry=r)
        self.waiting = Gauge("llmserve_num_requests_waiting", "Requests queued, not yet started",
                             registry=r)
        self.kv_pages_used = Gauge("llmserve_kv_pages_used", "KV pages held by sequences",
                                   registry=r)
        self.kv_pages_total = Gauge("llmserve_kv_pages_total", "Usable KV pages", registry=r)
        self.prefix_hit_rate = Gauge("llmserve_prefix_cache_hit_rate",
                                     "Prompt pages served by the prefix cache", registry=r)
        self.spec_acceptance = Gauge("llmserve_spec_decode_acceptance_rate",
                                     "Accepted / proposed draft tokens", registry=r)
        self.preemptions = Counter("llmserve_preemptions", "Sequences preempted", registry=r)
        self.generated = Counter("llmserve_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("llmserve_prompt_tokens", "Prompt tokens", registry=r)
        self.finished = Counter("llmserve_requests_finished", "Requests ended",
                                ["finish_reason"], registry=r)
        buckets = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
        self.ttft = Histogram("llmserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=buckets, registry=r)
        self.itl = Histogram("llmserve_inter_token_latency_seconds", "Between output tokens",
                             buckets=buckets, registry=r)
        self.e2e = Histogram("llmserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=buckets, registry=r)
        self._seen = {"preemptions": 0, "generated_tokens": 0}

    def update_engine(self, engine, running: int, waiting: int) -> None:
        """Reads the engine's counters (called on the engine thread after each step)."""
        self.running.set(running)
        self.waiting.set(waiting)
        blocks = engine.blocks
        self.kv_pages_total.set(blocks.num_pages - 1)
        self.kv_pages_used.set(blocks.num_pages - 1 - blocks.num_free_pages)
        st = blocks.stats
        if st.prefix_hits + st.prefix_misses:
            self.prefix_hit_rate.set(st.prefix_hits / (st.prefix_hits + st.prefix_misses))
        if getattr(engine, "spec", None) is not None:
            rate = engine.spec_metrics().get("acceptance_rate")
            if rate is not None:
                self.spec_acceptance.set(rate)
        self._count(self.preemptions, engine.stats, "preemptions")
        self._count(self.generated, engine.stats, "generated_tokens")

    def _count(self, counter, stats: dict, key: str) -> None:
        now = int(stats.get(key, 0))
        if now > self._seen[key]:
            counter.inc(now - self._seen[key])
        self._seen[key] = now


# ---------------------------------------------------------------------------------- engine loop
class Overloaded(Exception):
    """The waiting queue is at its limit (answered with 429)."""


@dataclasses.dataclass
class _Stream:
    """Where one engine request's outputs go, and its timing for the latency metrics."""

    aio: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: int  # which prompt of the HTTP request
    arrival: float
    started: bool = False
    last_time: Optional[float] = None
    num_tokens: int = 0


class EngineLoop:
    """The one thread that drives the engine; every other thread talks to it through a queue.

    ``max_waiting`` bounds the requests accepted but not yet started: past it, ``add`` raises
    ``Overloaded``. A ``ValueError`` from ``engine.add_request`` fails only that request; an
    exception from ``engine.step()`` fails every request in the engine with a 500, the device
    state is rebuilt (see ``recover``) and the loop keeps serving.
    """

    def __init__(self, engine, *, max_waiting: int = 256,
                 metrics: Optional[ServerMetrics] = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_waiting = 0  # accepted, no output yet (incl. those still in the inbox)
        self._num_running = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.step_errors = 0

    # ----------------------------------------------------------- any thread
    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="llmserve-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the engine thread; unfinished requests are aborted."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  out: asyncio.Queue, tag: int = 0) -> None:
        """Queues a request whose outputs go to ``out`` as ``(tag, RequestOutput | error)``.

        Returns once the engine has accepted it; raises ``ValueError`` if the engine rejects it
        and ``Overloaded`` if the waiting queue is full.
        """
        with self._lock:
            if self._num_waiting >= self.max_waiting:
                raise Overloaded(f"the server is at its limit of {self.max_waiting} waiting "
                                 "requests; retry later")
            self._num_waiting += 1
        aio = asyncio.get_running_loop()
        done = aio.create_future()
        stream = _Stream(aio, out, tag, time.time())
        self._inbox.put(("add", request_id, prompt_ids, params, stream, done))
        try:
            await done
        except asyncio.CancelledError:  # the client left while the engine was busy
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Aborts a request (no-op if it already ended); its pages are free after this step."""
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn()`` on the engine thread between steps (device side calls); its result."""
        aio = asyncio.get_running_loop()
        done = aio.create_future()
        self._inbox.put(("call", fn, aio, done))
        return await done

    # ----------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished_requests())
            if self._stop.is_set() or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a device or engine failure: fail this step's requests
                self._fail_all(e)
                continue
            now = time.time()
            for out in outputs:
                self._dispatch(out, now)
            self.metrics.update_engine(engine, self._num_running, self._num_waiting)
        for rid in list(self._streams):  # shutting down: tell the waiting handlers
            stream = self._streams[rid]
            self._abort(rid)
            _put(stream, APIError(503, "the server is shutting down", type="server_error"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            _, rid, ids, params, stream, done = item
            try:
                self.engine.add_request(rid, ids, params)
            except Exception as e:  # noqa: BLE001 - any rejection fails only this request
                with self._lock:
                    self._num_waiting -= 1
                _resolve(stream.aio, done, exc=e)
                return
            self._streams[rid] = stream
            self.metrics.prompt_tokens.inc(len(ids))
            _resolve(stream.aio, done, value=None)
        elif kind == "abort":
            self._abort(item[1])
        elif kind == "call":
            _, fn, aio, done = item
            try:
                _resolve(aio, done, value=fn())
            except Exception as e:  # noqa: BLE001 - the caller gets the error
                _resolve(aio, done, exc=e)

    def _forget(self, rid: str) -> Optional[_Stream]:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            with self._lock:
                if stream.started:
                    self._num_running -= 1
                else:
                    self._num_waiting -= 1
        return stream

    def _abort(self, rid: str) -> None:
        if self._forget(rid) is not None:
            self.engine.abort(rid)
            self.metrics.finished.labels("abort").inc()

    def _dispatch(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return  # aborted: the client is gone
        try:
            self._observe(stream, out, now)
        except Exception as e:  # noqa: BLE001 - a host-side failure ends only this request
            self._abort(out.request_id)
            _put(stream, APIError(500, f"request failed: {e!r}", type="server_error"))
            return
        if out.finished:
            self._forget(out.request_id)
            reasons = {o.finish_reason for o in out.outputs}
            self.metrics.finished.labels(",".join(sorted(str(r) for r in reasons))).inc()
            self.metrics.e2e.observe(now - stream.arrival)
        _put(stream, out)

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        if not stream.started:
            stream.started = True
            with self._lock:
                self._num_waiting -= 1
                self._num_running += 1
        n = sum(len(o.token_ids) for o in out.outputs)
        if n > stream.num_tokens:
            if stream.last_time is None:
                self.metrics.ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last_time) / (n - stream.num_tokens)
                for _ in range(n - stream.num_tokens):
                    self.metrics.itl.observe(gap)
            stream.last_time, stream.num_tokens = now, n

    def _fail_all(self, error: Exception) -> None:
        """A failed step: its requests get a 500; the engine rebuilds its device state and
        every other request keeps going (preempted and recomputed)."""
        self.step_errors += 1
        logging.getLogger(__name__).exception("engine step failed; failing its requests")
        try:
            failed = self.engine.recover()
        except Exception:  # noqa: BLE001 - keep the loop alive; fail everything instead
            logging.getLogger(__name__).exception("engine recovery failed")
            failed = list(self._streams)
        for rid in failed:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            self._abort(rid)
            _put(stream, APIError(500, f"engine step failed: {error!r}", type="server_error"))


def _resolve(aio: asyncio.AbstractEventLoop, fut: asyncio.Future, value=None, exc=None) -> None:
    def set_():
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    aio.call_soon_threadsafe(set_)


def _put(stream: _Stream, item) -> None:
    try:
        stream.aio.call_soon_threadsafe(stream.queue.put_nowait, (stream.tag, item))
    except RuntimeError:
        pass  # the event loop is closed: the server is shutting down


# ---------------------------------------------------------------------------------- text
class TextDelta:
    """Streamed text of one choice: what is new since the last chunk.

    With stop strings, the last ``max(len(stop)) - 1`` characters are held back until the
    request ends, because the engine trims a stop string that completes in a later token; so
    the chunks always concatenate to exactly the final (non-streamed) text.
    """

    def __init__(self, stop: list[str]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = ""
        self.num_tokens = 0

    def update(self, text: str, finished: bool) -> str:
        """The text to send now, given the choice's cumulative ``text``."""
        end = len(text) if finished else max(len(self.sent), len(text) - self.holdback)
        if not text.startswith(self.sent):  # never expected: resend nothing, keep going
            return ""
        delta = text[len(self.sent):end]
        self.sent += delta
        return delta


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, ids: list[int], entries: list, num_top: int,
                        offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset.

    ``entries`` are the engine's (or scorer's) per-token dicts, chosen token first; ``None``
    for the first prompt token.
    """
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(ids, entries):
        s = _token_str(tokenizer, tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry[tid])
        top = {}
        for t, lp in _top(entry, num_top):
            top.setdefault(_token_str(tokenizer, t), lp)
        out["top_logprobs"].append(top)
    return out


def _top(entry: dict, num_top: int) -> list:
    """The top-n alternatives of an entry ``{chosen: lp, alternatives...}``: the chosen token
    counts among them when it is one of the n most likely (the entry then has n items)."""
    items = list(entry.items())
    return items[1:] if len(items) > num_top else items


def chat_logprobs(tokenizer, ids: list[int], entries: list, num_top: int) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tid, entry in zip(ids, entries):
        s = _token_str(tokenizer, tid)
        top = [{"token": _token_str(tokenizer, t), "logprob": lp,
                "bytes": list(_token_str(tokenizer, t).encode())}
               for t, lp in _top(entry, num_top)]
        content.append({"token": s, "logprob": entry[tid], "bytes": list(s.encode()),
                        "top_logprobs": top})
    return {"content": content}


def _sse(payload: Union[dict, str]) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# ---------------------------------------------------------------------------------- app
@dataclasses.dataclass
class _Prompt:
    text: Optional[str]
    ids: list[int]


class OpenAIServing:
    """Request handling for both endpoints; shared by the route functions in ``create_app``."""

    def __init__(self, engine, tokenizer, loop: EngineLoop, model_name: str, scorer=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.loop = loop
        self.model_name = model_name
        self.scorer = scorer
        self.max_model_len = engine.config.max_model_len
        self.max_logprobs = engine.config.max_logprobs

    # ----------------------------------------------------------- validation
    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    def _check_len(self, prompt: _Prompt, max_tokens: Optional[int], param: str) -> None:
        n = len(prompt.ids)
        if n == 0:
            raise bad_request("the prompt is empty", param)
        if n >= self.max_model_len:
            raise bad_request(f"the prompt has {n} tokens; this model's maximum context length "
                              f"is {self.max_model_len} (prompt + at least one new token)",
                              param)
        if max_tokens and n + max_tokens > self.max_model_len:
            raise bad_request(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                              f"maximum context length {self.max_model_len}", "max_tokens")
        bad = [t for t in prompt.ids if not 0 <= t < self.engine.cfg.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range", param)

    def _check_logprobs(self, n: Optional[int], param: str) -> None:
        if n is not None and not 0 <= n <= self.max_logprobs:
            raise bad_request(f"{param}={n} must be in [0, {self.max_logprobs}] "
                              "(the server's max_logprobs)", param)

    def completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise bad_request("the prompt list is empty", "prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(_Prompt(item, self._encode(item)))
            else:
                out.append(_Prompt(None, list(item)))
        return out

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: send token ids", "prompt")
        return list(self.tokenizer.encode(text))

    def chat_prompt(self, req: ChatRequest) -> _Prompt:
        if not req.messages:
            raise bad_request("'messages' must hold at least one message", "messages")
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions",
                              "messages")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: only text is supported
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request("only text content parts are supported", "messages")
                    parts.append(part["text"])
                content = "".join(parts)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception is a 400
            raise bad_request(f"chat template error: {e}", "messages") from None
        return _Prompt(text, self._encode(text))

    # ----------------------------------------------------------- running
    async def _start(self, prompts: list[_Prompt], params: SamplingParams, prefix: str
                     ) -> tuple[list[str], asyncio.Queue]:
        """Adds one engine request per prompt, all feeding one queue; returns their ids."""
        q: asyncio.Queue = asyncio.Queue()
        rids: list[str] = []
        try:
            for i, p in enumerate(prompts):
                rid = f"{prefix}-{i}"
                await self.loop.add(rid, p.ids, params, q, tag=i)
                rids.append(rid)
        except Overloaded as e:
            self._abort(rids)
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ValueError as e:
            self._abort(rids)
            err = _params_error(e) if "SamplingParams" in str(e) else bad_request(str(e))
            raise err from None
        except BaseException:
            self._abort(rids)
            raise
        return rids, q

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.loop.abort(rid)

    async def _outputs(self, q: asyncio.Queue, count: int
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(tag, output) until all ``count`` requests finished; an engine error raises."""
        remaining = count
        while remaining:
            tag, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield tag, item

    async def _score(self, prompts: list[_Prompt], n: int) -> list[list]:
        if self.scorer is None:
            raise bad_request("prompt logprobs are not available on this server", "echo")
        return [await self.loop.call(lambda p=p: self.scorer.score(p.ids, n)) for p in prompts]

    # ----------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest, disconnected: "Watch"):
        """/v1/completions: a JSON response or an SSE stream."""
        self.check_model(req.model)
        self._check_logprobs(req.logprobs, "logprobs")
        prompts = self.completion_prompts(req)
        max_tokens = req.max_tokens
        if max_tokens is not None and max_tokens < 0:
            raise bad_request("max_tokens must be >= 0", "max_tokens")
        if max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens=0 is only allowed with echo (scoring)", "max_tokens")
        # max_tokens=0 scores only: no engine request is made; None runs to max_model_len.
        params = req.sampling_params(1 if max_tokens == 0 else max_tokens, req.logprobs)
        for p in prompts:
            self._check_len(p, max_tokens, "prompt")
        scores = None
        if req.echo and req.logprobs is not None:
            scores = await self._score(prompts, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        rids, q = ([], None) if max_tokens == 0 else await self._start(prompts, params, rid)
        head = dict(id=rid, object="text_completion", created=created, model=self.model_name)
        echo = CompletionEcho(self, req, prompts, scores, params.n)
        if req.stream:
            return self._stream_completions(req, head, prompts, params, rids, q, echo)
        disconnected.on_disconnect(lambda: self._abort(rids))
        finals: dict[int, RequestOutput] = {}
        try:
            if q is not None:
                async for tag, out in self._outputs(q, len(rids)):
                    if out.finished:
                        finals[tag] = out
        finally:
            self._abort([r for i, r in enumerate(rids) if i not in finals])
        choices = []
        for i in range(len(prompts)):
            for j in range(params.n):
                o = finals[i].outputs[j] if i in finals else None
                text = echo.text(i) + (o.text if o else "")
                lp = None
                if req.logprobs is not None:
                    lp = echo.logprobs(i, o)
                choices.append({"index": i * params.n + j, "text": text, "logprobs": lp,
                                "finish_reason": o.finish_reason if o else "length",
                                "stop_reason": _stop_reason(o)})
        return dict(head, choices=choices, usage=_usage(prompts, finals.values(), params.n))

    async def _stream_completions(self, req, head, prompts, params, rids, q, echo):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n = params.n
        deltas = {(i, j): TextDelta(params.stop) for i in range(len(prompts)) for j in range(n)}
        finals: dict[int, RequestOutput] = {}
        done = set()
        try:
            if req.echo:
                for i in range(len(prompts)):
                    for j in range(n):
                        lp = echo.logprobs(i, None) if req.logprobs is not None else None
                        finish = "length" if q is None else None
                        yield _sse(dict(head, choices=[{
                            "index": i * n + j, "text": echo.text(i), "logprobs": lp,
                            "finish_reason": finish}]))
            if q is not None:
                async for tag, out in self._outputs(q, len(rids)):
                    if out.finished:
                        finals[tag] = out
                    for o in out.outputs:
                        key = (tag, o.index)
                        if key in done:
                            continue
                        d = deltas[key]
                        text = d.update(o.text, o.finish_reason is not None)
                        new = o.token_ids[d.num_tokens:]
                        lp = None
                        if req.logprobs is not None and new:
                            lp = completion_logprobs(self.tokenizer, new,
                                                     o.logprobs[d.num_tokens:], req.logprobs)
                        d.num_tokens = len(o.token_ids)
                        if o.finish_reason is not None:
                            done.add(key)
                        if text or new or o.finish_reason is not None:
                            yield _sse(dict(head, choices=[{
                                "index": tag * n + o.index, "text": text, "logprobs": lp,
                                "finish_reason": o.finish_reason,
                                "stop_reason": _stop_reason(o)}]))
            if include_usage:
                yield _sse(dict(head, choices=[], usage=_usage(prompts, finals.values(), n)))
        except APIError as e:
            yield _sse(e.body())
        finally:
            self._abort([r for i, r in enumerate(rids) if i not in finals])
        yield _sse("[DONE]")

    # ----------------------------------------------------------- chat
    async def chat(self, req: ChatRequest, disconnected: "Watch"):
        """/v1/chat/completions: a JSON response or an SSE stream."""
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self._check_logprobs(req.top_logprobs, "top_logprobs")
        prompt = self.chat_prompt(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.max_completion_tokens is not None and req.max_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both",
                              "max_completion_tokens")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs)
        self._check_len(prompt, max_tokens, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        rids, q = await self._start([prompt], params, rid)
        head = dict(id=rid, object="chat.completion", created=int(time.time()),
                    model=self.model_name)
        if req.stream:
            return self._stream_chat(req, dict(head, object="chat.completion.chunk"), prompt,
                                     params, rids, q)
        disconnected.on_disconnect(lambda: self._abort(rids))
        final = None
        try:
            async for _, out in self._outputs(q, 1):
                final = out if out.finished else None
        finally:
            if final is None:
                self._abort(rids)
        choices = []
        for o in final.outputs:
            lp = chat_logprobs(self.tokenizer, o.token_ids, o.logprobs, params.logprobs) \
                if req.logprobs else None
            choices.append({"index": o.index, "message": {"role": "assistant", "content": o.text},
                            "logprobs": lp, "finish_reason": o.finish_reason,
                            "stop_reason": _stop_reason(o)})
        return dict(head, choices=choices, usage=_usage([prompt], [final], params.n))

    async def _stream_chat(self, req, head, prompt, params, rids, q):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = [TextDelta(params.stop) for _ in range(params.n)]
        final = None
        try:
            for j in range(params.n):
                yield _sse(dict(head, choices=[{"index": j, "delta": {"role": "assistant",
                                                                      "content": ""},
                                                "logprobs": None, "finish_reason": None}]))
            async for _, out in self._outputs(q, 1):
                final = out if out.finished else None
                for o in out.outputs:
                    d = deltas[o.index]
                    if d.num_tokens < 0:
                        continue  # already finished
                    text = d.update(o.text, o.finish_reason is not None)
                    new = o.token_ids[d.num_tokens:]
                    lp = None
                    if req.logprobs and new:
                        lp = chat_logprobs(self.tokenizer, new, o.logprobs[d.num_tokens:],
                                           params.logprobs)
                    d.num_tokens = len(o.token_ids)
                    if text or lp:
                        yield _sse(dict(head, choices=[{"index": o.index,
                                                        "delta": {"content": text},
                                                        "logprobs": lp, "finish_reason": None}]))
                    if o.finish_reason is not None:
                        d.num_tokens = -1
                        yield _sse(dict(head, choices=[{"index": o.index, "delta": {},
                                                        "logprobs": None,
                                                        "finish_reason": o.finish_reason,
                                                        "stop_reason": _stop_reason(o)}]))
            if include_usage:
                yield _sse(dict(head, choices=[], usage=_usage([prompt], [final], params.n)))
        except APIError as e:
            yield _sse(e.body())
        finally:
            if final is None:
                self._abort(rids)
        yield _sse("[DONE]")


class CompletionEcho:
    """The echoed prompt text and its logprobs for each prompt of a completions request."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, prompts: list[_Prompt],
                 scores: Optional[list[list]], n: int):
        self.serving, self.req, self.prompts, self.scores = serving, req, prompts, scores

    def text(self, i: int) -> str:
        if not self.req.echo:
            return ""
        p = self.prompts[i]
        return p.text if p.text is not None else self.serving.tokenizer.decode(p.ids)

    def logprobs(self, i: int, out) -> dict:
        """Prompt logprobs (when echoing) followed by the completion's."""
        tok = self.serving.tokenizer
        ids, entries = [], []
        if self.req.echo:
            ids += self.prompts[i].ids
            entries += self.scores[i]
        if out is not None:
            ids += out.token_ids
            entries += out.logprobs or []
        return completion_logprobs(tok, ids, entries, self.req.logprobs)


def _stop_reason(o) -> Optional[Union[int, str]]:
    return None if o is None or o.stop_reason is None else o.stop_reason


def _usage(prompts: list[_Prompt], finals, n: int) -> dict:
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


class Watch:
    """Watches a non-streaming request's connection; on disconnect runs the registered abort.

    (Streaming responses need no watch: Starlette cancels the stream when the client leaves,
    and the stream's ``finally`` aborts.)
    """

    def __init__(self, request):
        self.request = request
        self._task: Optional[asyncio.Task] = None

    def on_disconnect(self, fn: Callable[[], None]) -> None:
        async def watch():
            while True:
                message = await self.request.receive()
                if message["type"] == "http.disconnect":
                    fn()
                    return

        self._task = asyncio.ensure_future(watch())

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


def create_app(engine_or_llm, *, model_name: Optional[str] = None, api_key: Optional[str] = None,
               max_waiting: int = 256, scorer: Any = "auto", tokenizer: Any = None):
    """The FastAPI app serving ``engine_or_llm`` (an ``Engine`` or an ``LLM``).

    ``scorer``: a ``PromptScorer`` for prompt logprobs (echo + logprobs), ``"auto"`` to build
    one from the engine's parameters, or None to answer those requests with a 400.
    ``max_waiting``: waiting requests past which new ones get a 429. ``api_key``: when set,
    /v1 routes need ``Authorization: Bearer <api_key>`` (else 401). The engine thread starts
    and stops with the app's lifespan.
    """
    import contextlib

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    engine = getattr(engine_or_llm, "engine", engine_or_llm)
    tokenizer = tokenizer or engine.tokenizer
    if model_name is None:
        model_name = getattr(engine_or_llm, "model", None) or "llmserve"
    if scorer == "auto":
        scorer = _default_scorer(engine)
    loop = EngineLoop(engine, max_waiting=max_waiting)
    serving = OpenAIServing(engine, tokenizer, loop, model_name, scorer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="llmserve", lifespan=lifespan)
    app.state.loop = loop
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(),
                                                                 api_key.encode()):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def respond(request: Request, model: type[BaseModel], handler):
        authorize(request)
        req = parse_body(await request.body(), model)
        watch = Watch(request)
        try:
            result = await handler(req, watch)
        finally:
            watch.cancel()
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, CompletionRequest, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, ChatRequest, serving.chat)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "llmserve",
            "max_model_len": engine.config.max_model_len}]}

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _default_scorer(engine):
    """A PromptScorer over the engine's own parameters (None if they cannot be found)."""
    from llmserve.scoring import PromptScorer

    params = getattr(getattr(engine, "runner", None), "params", None)
    if params is None:
        return None
    return PromptScorer(engine.cfg, params, max_len=engine.config.max_model_len,
                        num_top=engine.config.max_logprobs)


class BackgroundServer:
    """Runs an app with uvicorn in a thread on 127.0.0.1 (tests, benchmarks, notebooks).

    ``with BackgroundServer(app) as srv: srv.url`` -> ``http://127.0.0.1:<free port>``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level="warning", lifespan="on"))
        self._thread: Optional[threading.Thread] = None

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
