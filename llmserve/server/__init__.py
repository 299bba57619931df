"""An OpenAI-compatible HTTP server over the engine: completions, chat, streaming, metrics.

One thread owns the engine (``EngineLoop``): it adds and aborts requests, runs side calls
(prompt scoring) and ``engine.step()``, and hands each ``RequestOutput`` to the asyncio queue of
the HTTP request that asked for it. HTTP handlers never touch the engine: they validate, enqueue
and stream. So the engine needs no locks and the event loop never blocks on a device step.

Endpoints (vLLM's conventions): ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
with ``stream: true`` as server-sent events ending in ``[DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text). ``create_app`` builds the app;
``llmserve.serve`` runs it with uvicorn.

One idea per module, imports running one way (app -> loop -> metrics, protocol):
  protocol.py  the OpenAI wire format: request models, parse_body, APIError, logprobs, SSE
  metrics.py   ServerMetrics: the Prometheus registry the engine thread updates
  loop.py      EngineLoop: the one thread that drives the engine
  app.py       OpenAIServing, create_app (the FastAPI routes), Watch, BackgroundServer
"""

from llmserve.server.app import BackgroundServer, OpenAIServing, Watch, create_app
from llmserve.server.loop import EngineLoop, Overloaded
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import (
    UNSUPPORTED,
    APIError,
    ChatMessage,
    ChatRequest,
    CompletionEcho,
    CompletionRequest,
    StreamOptions,
    TextDelta,
    bad_request,
    chat_logprobs,
    completion_logprobs,
    parse_body,
)

__all__ = [
    "UNSUPPORTED", "APIError", "BackgroundServer", "ChatMessage", "ChatRequest",
    "CompletionEcho", "CompletionRequest", "EngineLoop", "OpenAIServing", "Overloaded",
    "ServerMetrics", "StreamOptions", "TextDelta", "Watch", "bad_request", "chat_logprobs",
    "completion_logprobs", "create_app", "parse_body",
]
