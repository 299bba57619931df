"""The HTTP app: FastAPI routes over the engine thread, and a background runner for it.

``OpenAIServing`` checks a parsed request against the model, starts its engine requests through
the ``EngineLoop`` and builds the JSON response or the SSE stream; ``create_app`` wires it into
routes (API key, errors as OpenAI JSON, the engine thread's lifespan); ``BackgroundServer``
runs an app with uvicorn in a thread.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.loop import EngineLoop, Overloaded
from llmserve.server.protocol import (
    APIError,
    ChatRequest,
    CompletionEcho,
    CompletionRequest,
    Prompt,
    TextDelta,
    bad_request,
    chat_logprobs,
    completion_logprobs,
    params_error,
    parse_body,
    sse,
    stop_reason,
    usage,
)


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

    def _check_len(self, prompt: Prompt, max_tokens: Optional[int], param: str) -> None:
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

    def completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
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
                out.append(Prompt(item, self._encode(item)))
            else:
                out.append(Prompt(None, list(item)))
        return out

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer: send token ids", "prompt")
        return list(self.tokenizer.encode(text))

    def chat_prompt(self, req: ChatRequest) -> Prompt:
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
        return Prompt(text, self._encode(text))

    # ----------------------------------------------------------- running
    async def _start(self, prompts: list[Prompt], params: SamplingParams, prefix: str
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
            err = params_error(e) if "SamplingParams" in str(e) else bad_request(str(e))
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

    async def _score(self, prompts: list[Prompt], n: int) -> list[list]:
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
                                "stop_reason": stop_reason(o)})
        return dict(head, choices=choices, usage=usage(prompts, finals.values(), params.n))

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
                        yield sse(dict(head, choices=[{
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
                            yield sse(dict(head, choices=[{
                                "index": tag * n + o.index, "text": text, "logprobs": lp,
                                "finish_reason": o.finish_reason,
                                "stop_reason": stop_reason(o)}]))
            if include_usage:
                yield sse(dict(head, choices=[], usage=usage(prompts, finals.values(), n)))
        except APIError as e:
            yield sse(e.body())
        finally:
            self._abort([r for i, r in enumerate(rids) if i not in finals])
        yield sse("[DONE]")

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
                            "stop_reason": stop_reason(o)})
        return dict(head, choices=choices, usage=usage([prompt], [final], params.n))

    async def _stream_chat(self, req, head, prompt, params, rids, q):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = [TextDelta(params.stop) for _ in range(params.n)]
        final = None
        try:
            for j in range(params.n):
                yield sse(dict(head, choices=[{"index": j, "delta": {"role": "assistant",
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
                        yield sse(dict(head, choices=[{"index": o.index,
                                                        "delta": {"content": text},
                                                        "logprobs": lp, "finish_reason": None}]))
                    if o.finish_reason is not None:
                        d.num_tokens = -1
                        yield sse(dict(head, choices=[{"index": o.index, "delta": {},
                                                        "logprobs": None,
                                                        "finish_reason": o.finish_reason,
                                                        "stop_reason": stop_reason(o)}]))
            if include_usage:
                yield sse(dict(head, choices=[], usage=usage([prompt], [final], params.n)))
        except APIError as e:
            yield sse(e.body())
        finally:
            if final is None:
                self._abort(rids)
        yield sse("[DONE]")


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
